// Live updates through the scheduler's own interface (scheduler_updates.cc), with fake worker
// daemons on loopback: the new shape loads beside the old and the job switches once it serves; the
// old shape keeps its replicas while a request path holds requests for it, then unloads; an update
// short of workers goes replica by replica; refusals (a shape the planner refuses, a job not
// READY, an update while one runs), abort, a new replica whose load is refused, and a restart in
// the middle.
#include <filesystem>
#include <fstream>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "server/fake_worker.h"
#include "server/job_assets.h"
#include "server/job_serving.h"
#include "server/replica_keys.h"
#include "server/scheduler_test_fixture.h"

namespace bertshard::server {
namespace {

class UpdatesTest : public SchedulerTest {
 protected:
  // A second checkpoint (a new model version) beside the fixture's.
  std::string OtherCheckpoint() {
    const std::filesystem::path dir = std::filesystem::path(testing::TempDir()) / "scheduler_model_v2";
    std::filesystem::create_directories(dir);
    std::ofstream(dir / "config.json") << R"({"architectures": ["BertForMaskedLM"], "num_hidden_layers": 6})";
    return dir.string();
  }
  absl::StatusOr<v1::Job> Update(const std::string& id, int tp, const std::string& checkpoint = "") {
    v1::UpdateJobRequest update;
    update.set_job_id(id);
    update.mutable_request()->set_checkpoint(checkpoint.empty() ? checkpoint_ : checkpoint);
    update.mutable_request()->mutable_parallel()->set_tp_size(tp);
    return scheduler_->UpdateJob(update);
  }
  absl::StatusOr<v1::Job> Abort(const std::string& id) {
    v1::UpdateJobRequest abort;
    abort.set_job_id(id);
    abort.set_abort(true);
    return scheduler_->UpdateJob(abort);
  }
  // The job's request path as the first request would make it (Cluster::ServingFor), held by the
  // test as a caller inside it would hold it.
  std::shared_ptr<JobServing> HoldServing(const std::string& id) {
    std::shared_ptr<JobServing> held;
    scheduler_->ForEachRuntime([&](const std::string& job_id, JobRuntime& runtime) {
      if (job_id != id) return;
      JobServingOptions options;
      options.version = runtime.shape->version;
      runtime.job_serving = std::make_shared<JobServing>(
          id, runtime.shape->plan, RefusedJobAssets(absl::InternalError("none")), scheduler_.get(), options);
      held = runtime.job_serving;
    });
    return held;
  }
  // Waits (up to 30 s) for `n` idle workers.
  bool IdleWorkers(size_t n) {
    const absl::Time end = absl::Now() + absl::Seconds(30);
    while (pool_->Idle().size() != n) {
      if (absl::Now() > end) return false;
      absl::SleepFor(absl::Milliseconds(10));
    }
    return true;
  }
  static std::set<int32_t> Versions(const v1::Job& job) {
    std::set<int32_t> versions;
    for (const v1::ReplicaStatus& r : job.replica_status()) versions.insert(r.version());
    return versions;
  }
};

// TP 2 -> TP 1 with a spare: the new replica loads beside the old on the idle worker, the job
// switches (request, version and plan stored), and the old replica's workers unload and are free.
TEST_F(UpdatesTest, TheNewShapeLoadsBesideTheOldAndTheOldUnloadsOnceSwitched) {
  FakeWorker a, b, c;
  for (const FakeWorker* w : {&a, &b, &c}) Register(*w);
  const v1::Job ready = Settled(Submit(2).id());
  ASSERT_EQ(ready.state(), v1::READY);
  absl::StatusOr<v1::Job> updating = Update(ready.id(), 1);
  ASSERT_TRUE(updating.ok()) << updating.status();
  EXPECT_TRUE(updating->has_update());
  EXPECT_EQ(updating->update().version(), 1);
  EXPECT_EQ(updating->state(), v1::READY);  // the old shape serves meanwhile
  const v1::Job done = Settled(ready.id(), /*all_replicas=*/true);
  EXPECT_FALSE(done.has_update()) << done.DebugString();
  EXPECT_EQ(done.version(), 1);
  EXPECT_EQ(done.request().parallel().tp_size(), 1);
  EXPECT_NE(done.last_update().find("TP 2 x PP 1"), std::string::npos) << done.last_update();
  EXPECT_NE(done.last_update().find("-> TP 1 x PP 1"), std::string::npos) << done.last_update();
  ASSERT_TRUE(IdleWorkers(2));
  const v1::Job after = *scheduler_->GetJob(ready.id());
  ASSERT_EQ(after.replica_status_size(), 1) << after.DebugString();
  EXPECT_EQ(after.replica_status(0).version(), 1);
  EXPECT_EQ(after.replica_status(0).replica(), 1);  // the lowest index free when it was added
  EXPECT_EQ(after.ranks_size(), 1);
  EXPECT_TRUE(a.WaitForUnload(ready.id()));
  EXPECT_TRUE(b.WaitForUnload(ready.id()));
  ASSERT_EQ(c.Loads().size(), 1u);
  EXPECT_EQ(c.Loads()[0].plan().world_size(), 1);
  EXPECT_EQ(c.Loads()[0].job_id(), ReplicaKey(ready.id(), 1));
  // Forwards of the new shape go to it; none is left for the old.
  const absl::StatusOr<ForwardTarget> next = scheduler_->NextForward(ready.id(), 1, absl::Now());
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(next->replica, 1);
  scheduler_->EndForward(ready.id(), next->replica, next->generation);
  EXPECT_EQ(scheduler_->NextForward(ready.id(), 0, absl::Now()).status().code(), absl::StatusCode::kFailedPrecondition);
}

// Requests already in the old shape's request path finish there: its replica stays (and takes
// their forwards) until nothing holds the path, and new requests go to the new shape.
TEST_F(UpdatesTest, TheOldShapeKeepsItsReplicaWhileItsRequestPathIsHeld) {
  FakeWorker a, b;
  Register(a);
  Register(b);
  const v1::Job ready = Settled(Submit(1).id());
  std::shared_ptr<JobServing> held = HoldServing(ready.id());
  ASSERT_NE(held, nullptr);
  ASSERT_TRUE(Update(ready.id(), 1, OtherCheckpoint()).ok());
  const v1::Job switched = Settled(ready.id(), true);
  EXPECT_EQ(switched.version(), 1);
  EXPECT_EQ(switched.request().checkpoint(), OtherCheckpoint());
  EXPECT_EQ(Versions(switched), (std::set<int32_t>{0, 1})) << switched.DebugString();
  // The old shape still answers its own requests, the new its.
  const absl::StatusOr<ForwardTarget> old_forward = scheduler_->NextForward(ready.id(), 0, absl::Now());
  ASSERT_TRUE(old_forward.ok()) << old_forward.status();
  EXPECT_EQ(old_forward->replica, 0);
  scheduler_->EndForward(ready.id(), old_forward->replica, old_forward->generation);
  const absl::StatusOr<ForwardTarget> new_forward = scheduler_->NextForward(ready.id(), 1, absl::Now());
  ASSERT_TRUE(new_forward.ok()) << new_forward.status();
  EXPECT_EQ(new_forward->replica, 1);
  scheduler_->EndForward(ready.id(), new_forward->replica, new_forward->generation);
  // A further update waits for the drain.
  EXPECT_EQ(Update(ready.id(), 1).status().code(), absl::StatusCode::kFailedPrecondition);
  held.reset();  // the last caller is done: the old replica unloads
  EXPECT_TRUE(a.WaitForUnload(ready.id()));
  ASSERT_TRUE(IdleWorkers(1));
  EXPECT_EQ(Versions(*scheduler_->GetJob(ready.id())), (std::set<int32_t>{1}));
}

// Two replicas on exactly two workers: one old replica goes to make room, the new one loads on its
// worker, the job switches once the old shape is down to one, and the second new replica takes
// the last old one's worker; the job is READY throughout.
TEST_F(UpdatesTest, ShortOfWorkersTheUpdateGoesReplicaByReplica) {
  FakeWorker a, b;
  Register(a);
  Register(b);
  const v1::Job ready = Settled(Submit(1, 2).id(), true);
  ASSERT_EQ(ready.replica_status_size(), 2);
  ASSERT_TRUE(Update(ready.id(), 1, OtherCheckpoint()).ok());
  const v1::Job done = Settled(ready.id(), true);
  EXPECT_EQ(done.version(), 1) << done.DebugString();
  ASSERT_EQ(done.replica_status_size(), 2) << done.DebugString();
  for (const v1::ReplicaStatus& r : done.replica_status()) {
    EXPECT_EQ(r.version(), 1);
    EXPECT_EQ(r.state(), v1::READY);
  }
  bool served = false;
  for (const v1::StateChange& change : done.history()) {
    if (served) {
      EXPECT_EQ(change.state(), v1::READY) << "the job stopped serving: " << done.DebugString();
    }
    served |= change.state() == v1::READY;
  }
  EXPECT_EQ(a.Loads().size() + b.Loads().size(), 4u);  // two old, two new
}

// One replica and no idle worker: the update waits and says for what; a worker that comes lets
// it go on.
TEST_F(UpdatesTest, AnUpdateWithNoRoomWaitsAndSaysWhy) {
  FakeWorker a, b;
  Register(a);
  const v1::Job ready = Settled(Submit(1).id());
  ASSERT_TRUE(Update(ready.id(), 1, OtherCheckpoint()).ok());
  const v1::Job waiting = *scheduler_->GetJob(ready.id());
  ASSERT_TRUE(waiting.has_update());
  EXPECT_NE(waiting.update().progress().find("0 of 1 new replicas READY"), std::string::npos)
      << waiting.update().progress();
  EXPECT_NE(waiting.update().progress().find("waits"), std::string::npos) << waiting.update().progress();
  EXPECT_EQ(waiting.state(), v1::READY);
  EXPECT_EQ(waiting.degraded(), "");
  // Scaling waits for the update too.
  EXPECT_EQ(scheduler_->ScaleJob(ready.id(), 2).status().code(), absl::StatusCode::kFailedPrecondition);
  Register(b);
  const v1::Job done = Settled(ready.id(), true);
  EXPECT_EQ(done.version(), 1);
  EXPECT_FALSE(done.has_update());
}

// What cannot be updated is refused, and the old shape serves on.
TEST_F(UpdatesTest, RefusesWhatCannotBeUpdated) {
  FakeWorker a;
  Register(a);
  const v1::Job ready = Settled(Submit(1).id());
  // BERT-base's 12 heads do not split over 5 ranks: the planner's INVALID_ARGUMENT.
  EXPECT_EQ(Update(ready.id(), 5).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Update(ready.id(), 1, "/no/such/model").status().code(), absl::StatusCode::kInvalidArgument);
  v1::UpdateJobRequest empty;
  empty.set_job_id(ready.id());
  EXPECT_EQ(scheduler_->UpdateJob(empty).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Update("job-none", 1).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(Abort(ready.id()).status().code(), absl::StatusCode::kFailedPrecondition);  // none runs
  const v1::Job unchanged = *scheduler_->GetJob(ready.id());
  EXPECT_FALSE(unchanged.has_update());
  EXPECT_EQ(unchanged.version(), 0);
  EXPECT_EQ(unchanged.state(), v1::READY);
  // One update at a time (the first waits for a worker here).
  ASSERT_TRUE(Update(ready.id(), 1).ok());
  EXPECT_EQ(Update(ready.id(), 1).status().code(), absl::StatusCode::kFailedPrecondition);
  // A job that is not READY.
  const v1::Job pending = Submit(1);
  EXPECT_EQ(Update(pending.id(), 1).status().code(), absl::StatusCode::kFailedPrecondition);
}

// Aborted, the new replicas go (their workers free again) and the old shape serves on.
TEST_F(UpdatesTest, AnAbortedUpdateLeavesTheOldShapeServing) {
  FakeWorker a, b, c;
  for (const FakeWorker* w : {&a, &b}) Register(*w);
  const v1::Job ready = Settled(Submit(2).id());
  ASSERT_TRUE(Update(ready.id(), 2, OtherCheckpoint()).ok());  // waits: one worker short
  Register(c);
  const absl::StatusOr<v1::Job> aborted = Abort(ready.id());
  ASSERT_TRUE(aborted.ok()) << aborted.status();
  EXPECT_FALSE(aborted->has_update());
  EXPECT_NE(aborted->last_update().find("version 1: aborted by request"), std::string::npos) << aborted->last_update();
  EXPECT_EQ(aborted->version(), 0);
  EXPECT_EQ(Versions(*aborted), (std::set<int32_t>{0}));
  ASSERT_TRUE(IdleWorkers(1));
  const absl::StatusOr<ForwardTarget> next = scheduler_->NextForward(ready.id(), 0, absl::Now());
  ASSERT_TRUE(next.ok()) << next.status();
  scheduler_->EndForward(ready.id(), next->replica, next->generation);
}

// A new replica whose load the worker refuses for what it asks ends the update, not the job.
TEST_F(UpdatesTest, ANewShapeTheWorkersRefuseEndsTheUpdateNotTheJob) {
  FakeWorker a;
  FakeWorker refusing(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "no such tensor"));
  Register(a);
  const v1::Job ready = Settled(Submit(1).id());
  Register(refusing);
  ASSERT_TRUE(Update(ready.id(), 1, OtherCheckpoint()).ok());
  const v1::Job ended = Settled(ready.id(), true);
  EXPECT_EQ(ended.state(), v1::READY);
  EXPECT_FALSE(ended.has_update());
  EXPECT_EQ(ended.version(), 0);
  EXPECT_NE(ended.last_update().find("could not load"), std::string::npos) << ended.last_update();
  EXPECT_NE(ended.last_update().find("no such tensor"), std::string::npos) << ended.last_update();
}

// Three replicas of TP 1 on three workers moved to TP 2: two old replicas go at once (one would
// not free enough), the new one serves, the job switches, and the last old replica's worker waits
// for the rest (the pool holds one TP 2 replica only; the job serves on it).
TEST_F(UpdatesTest, ShortOfWorkersTheOldShapeFreesAsManyAsOneNewReplicaNeeds) {
  FakeWorker a, b, c;
  for (const FakeWorker* w : {&a, &b, &c}) Register(*w);
  const v1::Job ready = Settled(Submit(1, 3).id(), true);
  ASSERT_EQ(ready.replica_status_size(), 3);
  ASSERT_TRUE(Update(ready.id(), 2).ok());
  v1::Job job;
  const absl::Time end = absl::Now() + absl::Seconds(30);
  while ((job = *scheduler_->GetJob(ready.id())).version() != 1 && absl::Now() < end) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  ASSERT_EQ(job.version(), 1) << job.DebugString();
  EXPECT_EQ(job.state(), v1::READY);
  EXPECT_EQ(job.request().parallel().tp_size(), 2);
  ASSERT_TRUE(IdleWorkers(1));  // the last old replica drained
  job = *scheduler_->GetJob(ready.id());
  int serving = 0, waiting = 0;
  for (const v1::ReplicaStatus& r : job.replica_status()) {
    EXPECT_EQ(r.version(), 1) << job.DebugString();
    serving += r.state() == v1::READY ? 1 : 0;
    waiting += r.state() == v1::PENDING ? 1 : 0;
  }
  EXPECT_EQ(serving, 1) << job.DebugString();
  EXPECT_EQ(waiting, 2) << job.DebugString();
}

// An old replica lost while its shape drains is not placed again (it would take workers for a
// shape that only drains): the job's replicas are the new shape's.
TEST_F(UpdatesTest, AnOldReplicaLostWhileDrainingIsNotPlacedAgain) {
  FakeWorker a, b, c;
  const std::string first = Register(a);
  const v1::Job ready = Settled(Submit(1).id());
  Register(b);
  Register(c);
  std::shared_ptr<JobServing> held = HoldServing(ready.id());
  ASSERT_TRUE(Update(ready.id(), 1, OtherCheckpoint()).ok());
  ASSERT_EQ(Versions(Settled(ready.id(), true)), (std::set<int32_t>{0, 1}));
  ASSERT_TRUE(Leave(first));
  const v1::Job after = *scheduler_->GetJob(ready.id());
  EXPECT_EQ(Versions(after), (std::set<int32_t>{1})) << after.DebugString();
  EXPECT_EQ(after.degraded(), "");
  EXPECT_EQ(pool_->Idle().size(), 1u);  // c: nothing was placed on it
  held.reset();
}

// Cancelled while an update runs: the job ends, and keeps no update.
TEST_F(UpdatesTest, ACancelledJobKeepsNoUpdate) {
  FakeWorker a;
  Register(a);
  const v1::Job ready = Settled(Submit(1).id());
  ASSERT_TRUE(Update(ready.id(), 1, OtherCheckpoint()).ok());  // waits for a worker
  const absl::StatusOr<v1::Job> cancelled = scheduler_->CancelJob(ready.id());
  ASSERT_TRUE(cancelled.ok()) << cancelled.status();
  EXPECT_EQ(cancelled->state(), v1::CANCELLED);
  EXPECT_FALSE(cancelled->has_update());
  EXPECT_NE(cancelled->last_update().find("ended with the job"), std::string::npos) << cancelled->last_update();
}

// A new replica that keeps losing its workers (every load fails) past --max_restarts ends the
// update, not the job.
TEST_F(UpdatesTest, ANewReplicaPastMaxRestartsEndsTheUpdate) {
  FakeWorker a;
  FakeWorker failing(grpc::Status(grpc::StatusCode::UNAVAILABLE, "the device went away"));
  Register(a);
  const v1::Job ready = Settled(Submit(1).id());
  Register(failing);
  ASSERT_TRUE(Update(ready.id(), 1, OtherCheckpoint()).ok());
  const v1::Job ended = Settled(ready.id(), true);
  EXPECT_EQ(ended.state(), v1::READY) << ended.DebugString();
  EXPECT_FALSE(ended.has_update());
  EXPECT_EQ(ended.version(), 0);
  EXPECT_NE(ended.last_update().find("lost its workers 3 times in a row (--max_restarts=2)"), std::string::npos)
      << ended.last_update();
  EXPECT_EQ(failing.Loads().size(), 3u);  // the first load and --max_restarts (2) more
}

// A coordinator restart in the middle: the update is in the store, and goes on.
TEST_F(UpdatesTest, ARestartedCoordinatorGoesOnWithTheUpdate) {
  store_path_ = std::string(testing::TempDir()) + "/updates.db";
  std::filesystem::remove(store_path_);
  Start();
  FakeWorker a, b;
  Register(a);
  const v1::Job ready = Settled(Submit(1).id());
  ASSERT_TRUE(Update(ready.id(), 1, OtherCheckpoint()).ok());  // waits for a worker
  Start();
  const v1::Job taken_back = *scheduler_->GetJob(ready.id());
  ASSERT_TRUE(taken_back.has_update()) << taken_back.DebugString();
  EXPECT_EQ(taken_back.update().version(), 1);
  EXPECT_EQ(taken_back.update().request().checkpoint(), OtherCheckpoint());
  Register(a);
  Register(b);
  const v1::Job done = Settled(ready.id(), true);
  EXPECT_EQ(done.version(), 1) << done.DebugString();
  EXPECT_EQ(done.request().checkpoint(), OtherCheckpoint());
  EXPECT_FALSE(done.has_update());
}

}  // namespace
}  // namespace bertshard::server
