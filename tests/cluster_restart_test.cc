// Coordinator restarts under a serving cluster (a coordinator and four shard-worker processes on
// loopback, a fresh cluster per test): a restarted coordinator takes back the READY jobs whose
// ranks all come back, fails the others naming the missing rank, and has workers unload what it
// does not know; a draining coordinator fails no job.
#include <condition_variable>
#include <filesystem>
#include <mutex>
#include <thread>

#include "absl/time/clock.h"
#include "bertshard/v1/coordinator.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/cluster_fixture.h"
#include "tests/test_process.h"

namespace bertshard {
namespace {

using testing::Cluster;
using testing::Context;
using testing::kModel;
using testing::ReadAll;
// Issue 7: a coordinator restart ends no job. The workers still hold the READY job's ranks and
// report them when they register again; the job is READY again and inference continues where it
// was (the workers refuse a forward numbered out of order, so a rebuilt sequence is checked too).
TEST_F(Cluster, CoordinatorRestartTakesBackReadyJobs) {
  const v1::Job job = Submit(kModel);
  ASSERT_EQ(Watch(job.id()).job().state(), v1::READY);
  EXPECT_LE(InferDiff(job.id()), 1e-5f);

  StopCoordinator();
  StartCoordinator();
  const v1::JobEvent back = Watch(job.id());  // returns once the job is no longer recovering
  ASSERT_EQ(back.job().state(), v1::READY) << back.job().failure_cause() << ReadAll(data_dir_ + ".log");
  EXPECT_EQ(back.job().recovering(), "");
  for (const auto& change : back.job().history()) EXPECT_NE(change.state(), v1::FAILED) << change.reason();
  EXPECT_LE(InferDiff(job.id()), 1e-5f);
  EXPECT_LE(InferDiff(job.id()), 1e-5f);
  // The ranks point at the workers' new ids, and the pool shows them serving the job.
  v1::ListWorkersResponse workers;
  ASSERT_TRUE(stub_->ListWorkers(Context().get(), v1::ListWorkersRequest(), &workers).ok());
  int serving = 0;
  for (const auto& w : workers.workers()) serving += w.job_id() == job.id() ? 1 : 0;
  EXPECT_EQ(serving, 4) << workers.DebugString();
  ASSERT_EQ(back.job().ranks_size(), 4);
  for (const auto& r : back.job().ranks()) {
    bool known = false;
    for (const auto& w : workers.workers()) known |= w.worker_id() == r.worker_id() && w.rank() == r.rank();
    EXPECT_TRUE(known) << r.DebugString();
  }
}

// Issue 22 item 5: a restarted coordinator whose job's rank does not come back places the job
// again (the ranks that came back unload) instead of failing it; with a spare it serves again.
TEST_F(Cluster, CoordinatorRestartPlacesAgainAJobWhoseRankDidNotComeBack) {
  const v1::Job job = Submit(kModel);
  ASSERT_EQ(Watch(job.id()).job().state(), v1::READY);
  std::string victim_id;
  const int victim = WorkerServing(job.id(), 3, &victim_id);
  ASSERT_GE(victim, 0);
  StopCoordinator();
  KillWorker(victim);  // dies while the coordinator is away
  StartCoordinator();
  LaunchWorker();                             // a spare
  const v1::JobEvent last = Watch(job.id());  // the 6 s grace period, then placed and loaded again
  ASSERT_EQ(last.job().state(), v1::READY) << last.job().DebugString();
  const std::string cause = RecoveryReason(last.job());
  EXPECT_NE(cause.find("rank 3 (last on worker " + victim_id), std::string::npos) << cause;
  EXPECT_NE(cause.find("did not come back"), std::string::npos) << cause;
  for (const auto& r : last.job().ranks()) EXPECT_NE(r.worker_id(), victim_id);
  EXPECT_LE(InferDiff(job.id()), 1e-5f);
}

TEST_F(Cluster, WorkersUnloadJobsTheCoordinatorDoesNotKnow) {
  const v1::Job job = Submit(kModel);
  ASSERT_EQ(Watch(job.id()).job().state(), v1::READY);
  StopCoordinator();
  for (const char* suffix : {"", "-wal", "-shm"}) std::filesystem::remove(data_dir_ + "/jobs.db" + suffix);
  StartCoordinator();
  v1::ListJobsResponse jobs;
  ASSERT_TRUE(stub_->ListJobs(Context().get(), v1::ListJobsRequest(), &jobs).ok());
  EXPECT_EQ(jobs.jobs_size(), 0);
  EXPECT_TRUE(WaitUnloadedEverywhere(job.id()));
  EXPECT_TRUE(WaitForWorkers(4));
}

// A SIGTERM drain held open by a watcher for several heartbeat intervals: the coordinator takes
// no heartbeats meanwhile, and must not blame the workers for it.
class ShortDrainCluster : public Cluster {
 protected:
  ShortDrainCluster() { drain_timeout_ = "4s"; }  // four heartbeat intervals
};

TEST_F(ShortDrainCluster, DrainingCoordinatorFailsNoJob) {
  const v1::Job job = Submit(kModel);
  ASSERT_EQ(Watch(job.id()).job().state(), v1::READY);
  const v1::Job waiting = Submit(kModel);  // every worker is busy: PENDING, and watched
  ASSERT_EQ(waiting.state(), v1::PENDING);
  std::mutex mu;
  std::condition_variable opened_cv;
  bool opened = false;
  std::thread watcher([&] {
    v1::GetJobRequest request;
    request.set_job_id(waiting.id());
    auto context = Context();
    auto reader = stub_->WatchJob(context.get(), request);
    v1::JobEvent event;
    bool first = true;
    while (reader->Read(&event)) {
      if (!first) continue;
      first = false;
      std::lock_guard<std::mutex> lock(mu);
      opened = true;  // the first event (the job as it is) came: the call is open on the server
      opened_cv.notify_all();
    }
    reader->Finish();
  });
  {
    // The watch is open before the signal.
    std::unique_lock<std::mutex> lock(mu);
    EXPECT_TRUE(opened_cv.wait_for(lock, std::chrono::seconds(30), [&] { return opened; })) << "the watch did not open";
  }
  const absl::Time stopping = absl::Now();
  StopCoordinator();
  watcher.join();
  EXPECT_GE(absl::Now() - stopping, absl::Seconds(3)) << "the drain did not last; the test proves nothing";
  StartCoordinator();
  const v1::Job stored = GetJob(job.id());  // as the draining coordinator left it
  EXPECT_EQ(stored.state(), v1::READY) << stored.failure_cause();
  for (const auto& change : stored.history()) EXPECT_NE(change.state(), v1::FAILED) << change.reason();
  EXPECT_EQ(GetJob(waiting.id()).state(), v1::PENDING);
  ASSERT_EQ(Watch(job.id()).job().state(), v1::READY);
  EXPECT_LE(InferDiff(job.id()), 1e-5f);
}
}  // namespace
}  // namespace bertshard
