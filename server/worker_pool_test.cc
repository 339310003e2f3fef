#include "server/worker_pool.h"

#include <string>

#include "gtest/gtest.h"

namespace bertshard::server {
namespace {

// No worker processes: the pool's channels connect lazily, and nothing here calls a worker.
class WorkerPoolTest : public ::testing::Test {
 protected:
  WorkerPoolTest() : pool_(Options(), "inc1") {}

  static ClusterOptions Options() {
    ClusterOptions options;
    options.heartbeat_interval = absl::Seconds(1);
    options.missed_heartbeats = 3;
    return options;
  }

  v1::WorkerInfo Add(int port, const std::string& device = "", const std::string& previous = "") {
    v1::RegisterWorkerRequest request;
    request.set_address("127.0.0.1:" + std::to_string(port));
    request.set_device(device);
    request.set_previous_worker_id(previous);
    request.set_free_memory_bytes(1000);
    return pool_.Add(request);
  }

  static std::vector<std::string> Ids(const std::vector<IdleWorker>& idle) {
    std::vector<std::string> ids;
    for (const IdleWorker& w : idle) ids.push_back(w.worker_id);
    return ids;
  }

  WorkerPool pool_;
};

TEST_F(WorkerPoolTest, GivesIdsOfThisIncarnationAndKeepsAFreePreviousOne) {
  const v1::WorkerInfo first = Add(9);
  EXPECT_EQ(first.worker_id(), "worker-1-inc1");
  EXPECT_EQ(first.device(), "cpu");  // a worker that predates the field
  EXPECT_TRUE(first.healthy());
  EXPECT_EQ(Add(10, "cuda:0", "worker-7-old").worker_id(), "worker-7-old");
  // Taken already: a new one, never someone else's entry.
  EXPECT_EQ(Add(11, "", "worker-7-old").worker_id(), "worker-2-inc1");
  EXPECT_EQ(pool_.List().workers_size(), 3);
}

TEST_F(WorkerPoolTest, AWorkerRegisteringAgainReplacesItsEntry) {
  const v1::WorkerInfo old = Add(9);
  ASSERT_TRUE(pool_.Assign(old.worker_id(), "job-1", 2));
  EXPECT_FALSE(pool_.RemoveByAddress("127.0.0.1:10").has_value());
  const std::optional<v1::WorkerInfo> removed = pool_.RemoveByAddress("127.0.0.1:9");
  ASSERT_TRUE(removed.has_value());
  EXPECT_EQ(removed->worker_id(), old.worker_id());
  EXPECT_EQ(removed->job_id(), "job-1");  // the scheduler decides what that means for the job
  EXPECT_EQ(removed->rank(), 2);
  EXPECT_EQ(pool_.List().workers_size(), 0);
  EXPECT_EQ(pool_.Beat(old.worker_id(), 0).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(WorkerPoolTest, HeartbeatsAreRecordedAndUnknownIdsMustRegisterAgain) {
  const v1::WorkerInfo w = Add(9);
  const absl::StatusOr<v1::WorkerInfo> before = pool_.Beat(w.worker_id(), 42);
  ASSERT_TRUE(before.ok()) << before.status();
  EXPECT_EQ(before->free_memory_bytes(), 1000);
  EXPECT_EQ(pool_.Find(w.worker_id())->free_memory_bytes(), 42);
  const absl::Status unknown = pool_.Beat("worker-9-inc0", 0).status();
  EXPECT_EQ(unknown.code(), absl::StatusCode::kNotFound);
  EXPECT_NE(unknown.message().find("register again"), std::string::npos) << unknown;
}

// Silent for more than missed_heartbeats intervals: out of the placement pool, all at once, with
// the job each served; back with its next heartbeat.
TEST_F(WorkerPoolTest, SilentWorkersLeaveThePlacementPoolUntilTheyBeatAgain) {
  const v1::WorkerInfo busy = Add(9);
  const v1::WorkerInfo idle = Add(10);
  ASSERT_TRUE(pool_.Assign(busy.worker_id(), "job-1", 0));
  EXPECT_TRUE(pool_.TakeSilent(absl::Now() + absl::Seconds(2)).empty());  // within 3 intervals
  const std::vector<WorkerDeparture> silent = pool_.TakeSilent(absl::Now() + absl::Seconds(5));
  ASSERT_EQ(silent.size(), 2u);
  EXPECT_EQ(silent[0].info.worker_id(), busy.worker_id());
  EXPECT_EQ(silent[0].info.job_id(), "job-1");
  EXPECT_GE(silent[0].silent, absl::Seconds(5));
  EXPECT_TRUE(pool_.Idle().empty());
  EXPECT_TRUE(pool_.TakeSilent(absl::Now() + absl::Seconds(5)).empty());  // said once
  const absl::StatusOr<v1::WorkerInfo> back = pool_.Beat(idle.worker_id(), 0);
  ASSERT_TRUE(back.ok());
  EXPECT_FALSE(back->healthy());  // the caller learns it was away
  pool_.MarkHealthy(idle.worker_id());
  EXPECT_EQ(Ids(pool_.Idle()), std::vector<std::string>{idle.worker_id()});
}

TEST_F(WorkerPoolTest, ReleasingAJobFreesItsWorkersAndReturnsTheHealthyOnesChannels) {
  const v1::WorkerInfo a = Add(9);
  const v1::WorkerInfo b = Add(10);
  const v1::WorkerInfo other = Add(11);
  ASSERT_TRUE(pool_.Assign(a.worker_id(), "job-1", 0));
  ASSERT_TRUE(pool_.Assign(b.worker_id(), "job-1", 1));
  ASSERT_TRUE(pool_.Assign(other.worker_id(), "job-2", 0));
  EXPECT_FALSE(pool_.Assign("worker-99-inc1", "job-1", 0));
  EXPECT_TRUE(pool_.Idle().empty());
  ASSERT_EQ(pool_.MarkUnhealthy(b.worker_id())->rank(), 1);
  const std::vector<WorkerStub> holding = pool_.Release("job-1");
  ASSERT_EQ(holding.size(), 1u);  // the unhealthy one has nothing to drop
  EXPECT_EQ(holding[0].worker_id, a.worker_id());
  EXPECT_EQ(holding[0].address, "127.0.0.1:9");
  EXPECT_NE(holding[0].stub, nullptr);
  EXPECT_NE(holding[0].health, nullptr);
  EXPECT_EQ(Ids(pool_.Idle()), std::vector<std::string>{a.worker_id()});
  EXPECT_EQ(pool_.Find(b.worker_id())->job_id(), "");
  EXPECT_EQ(pool_.Find(other.worker_id())->job_id(), "job-2");
  pool_.Unassign(other.worker_id());
  EXPECT_EQ(Ids(pool_.Idle()), (std::vector<std::string>{a.worker_id(), other.worker_id()}));
}

TEST_F(WorkerPoolTest, IdleWorkersCarryTheirDevicesAndStubsNameOneThatLeft) {
  const v1::WorkerInfo gpu = Add(9, "cuda:1");
  const std::vector<IdleWorker> idle = pool_.Idle();
  ASSERT_EQ(idle.size(), 1u);
  EXPECT_EQ(idle[0].device, "cuda:1");
  EXPECT_EQ(idle[0].address, "127.0.0.1:9");
  const absl::StatusOr<std::vector<WorkerStub>> stubs = pool_.Stubs({gpu.worker_id()});
  ASSERT_TRUE(stubs.ok()) << stubs.status();
  EXPECT_EQ((*stubs)[0].worker_id, gpu.worker_id());
  const absl::Status gone = pool_.Stubs({gpu.worker_id(), "worker-5-inc1"}).status();
  EXPECT_EQ(gone.code(), absl::StatusCode::kNotFound);
  EXPECT_NE(gone.message().find("worker worker-5-inc1 left the pool"), std::string::npos) << gone;
}

// A survivor of a lost group drops its shard before it may be placed again (the new load would
// race the unload); a new entry for its address starts clear.
TEST_F(WorkerPoolTest, AnUnloadingWorkerIsNotIdleUntilItsUnloadEnds) {
  const v1::WorkerInfo a = Add(9001);
  const v1::WorkerInfo b = Add(9002);
  pool_.SetUnloading(a.worker_id(), true);
  EXPECT_EQ(Ids(pool_.Idle()), std::vector<std::string>{b.worker_id()});
  EXPECT_TRUE(pool_.SetUnloading(a.worker_id(), false));  // it was
  EXPECT_FALSE(pool_.SetUnloading(a.worker_id(), false));
  EXPECT_EQ(Ids(pool_.Idle()), (std::vector<std::string>{a.worker_id(), b.worker_id()}));
  pool_.SetUnloading(b.worker_id(), true);
  pool_.SetUnloading("no-such-worker", true);
  ASSERT_TRUE(pool_.RemoveByAddress(b.address()).has_value());
  const v1::WorkerInfo b_again = Add(9002);
  EXPECT_EQ(Ids(pool_.Idle()), (std::vector<std::string>{a.worker_id(), b_again.worker_id()}));
}

// Review of issue 22's first stage: a heartbeat that did not list the lost job's shard cleared the
// flag while the coordinator's Unload call was still on its way, and the job was placed on the
// worker again to race it (ALREADY_EXISTS); a failed call cleared it too.
TEST_F(WorkerPoolTest, AWorkerWithAnUnloadCallOnItsWayIsNotIdleWhateverAHeartbeatSays) {
  const v1::WorkerInfo a = Add(9001);
  pool_.BeginUnloadCall(a.worker_id());
  pool_.SetUnloading(a.worker_id(), false);  // a heartbeat that lists no shard of a live job
  EXPECT_TRUE(pool_.Idle().empty());
  EXPECT_TRUE(pool_.EndUnloadCall(a.worker_id(), /*unloaded=*/true));
  EXPECT_EQ(Ids(pool_.Idle()), std::vector<std::string>{a.worker_id()});
  // A failed call: kept out until a heartbeat says the shard is gone.
  pool_.BeginUnloadCall(a.worker_id());
  EXPECT_FALSE(pool_.EndUnloadCall(a.worker_id(), /*unloaded=*/false));
  EXPECT_TRUE(pool_.Idle().empty());
  EXPECT_TRUE(pool_.SetUnloading(a.worker_id(), false));
  EXPECT_EQ(Ids(pool_.Idle()), std::vector<std::string>{a.worker_id()});
  pool_.BeginUnloadCall("no-such-worker");
  EXPECT_FALSE(pool_.EndUnloadCall("no-such-worker", true));
}

}  // namespace
}  // namespace bertshard::server
