// The fault matrix (issue 10 item 6): a worker SIGKILLed or SIGSTOPped at each phase of a job
// (load, rendezvous, forward, unload) and the coordinator SIGKILLed mid-load and mid-infer. Each
// row stops the process at the exact phase with a pause point (common/fault_point.h), injects the
// fault there, releases the others and checks:
//   - the coordinator's verdict and its cause (naming the worker when one died): since issue 22 a
//     lost worker loses the job's group, not the job, which goes back to PENDING to be placed again,
//   - the time from the fault to that verdict (printed, and bounded),
//   - that nothing hangs: the Infer in flight returns (UNAVAILABLE: with three workers for four
//     ranks no group comes back before its deadline), survivors are idle and hold nothing; a
//     stopped worker comes back after SIGCONT and the job is placed on the four again and serves,
//   - that the job database still holds the job after a coordinator restart.
// One row per test, each on a fresh cluster (a coordinator and four workers on loopback). The
// printed lines ("fault: ...") are the table in docs/RELIABILITY.md.
#include <dirent.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "tests/cluster_fixture.h"
#include "tests/test_process.h"

namespace bertshard {
namespace {

using testing::Cluster;
using testing::Context;
using testing::kModel;
using testing::ReadAll;
using testing::TempDir;
using testing::WaitExit;

enum class Fault { kKill, kStop };
struct Row {
  const char* name;  // the test's name
  Fault fault;
  const char* point;  // the pause point where the victim is caught
  bool coordinator;   // the coordinator is killed instead of a worker
};

class FaultMatrix : public Cluster, public ::testing::WithParamInterface<Row> {
 protected:
  FaultMatrix() { UseFaultDir(GetParam().name); }

  // The Infer in flight's deadline (worker_forward rows), seconds.
  const int row_deadline_s_ = 8;

  void Report(const std::string& outcome, absl::Duration detect) {
    std::printf("fault: %s: %s, detected in %.2f s\n", GetParam().name, outcome.c_str(), absl::ToDoubleSeconds(detect));
  }

  // After the fault: the coordinator restarted still holds `job` in its final state.
  void CheckStoredAfterRestart(const v1::Job& final_job) {
    StopCoordinator();
    StartCoordinator();
    v1::ListJobsResponse jobs;
    ASSERT_TRUE(stub_->ListJobs(Context().get(), v1::ListJobsRequest(), &jobs).ok());
    bool found = false;
    for (const auto& j : jobs.jobs()) {
      if (j.id() != final_job.id()) continue;
      found = true;
      EXPECT_EQ(j.state(), final_job.state()) << j.failure_cause();
      EXPECT_EQ(j.failure_cause(), final_job.failure_cause());
    }
    EXPECT_TRUE(found) << "the job database lost " << final_job.id();
  }
};

TEST_P(FaultMatrix, Row) {
  const Row& row = GetParam();
  const std::string point = row.point;
  v1::Job job;
  if (point == "worker_load" || point == "worker_rendezvous") {
    Hold(point);
    job = Submit(kModel);
  } else {
    ASSERT_NO_FATAL_FAILURE(SubmitUntilServing(&job));
    Hold(point);
  }
  // Forward: an Infer in flight; unload: a cancel (it answers at once, the unloads follow).
  grpc::Status infer_status;
  absl::Time infer_returned;  // written by the thread, read after join
  std::thread infer_thread;
  if (point == "worker_forward") {
    infer_thread = std::thread([&] {
      v1::InferRequest infer;
      infer.set_job_id(job.id());
      *infer.mutable_tokens() = Cluster::Tokens();
      v1::InferResponse response;
      // A lost group's batch waits for the next one until shortly before this deadline.
      infer_status = stub_->Infer(Context(row_deadline_s_).get(), infer, &response);
      infer_returned = absl::Now();
    });
  }
  if (point == "worker_unload") {
    v1::GetJobRequest cancel;
    cancel.set_job_id(job.id());
    v1::Job cancelled;
    ASSERT_TRUE(stub_->CancelJob(Context().get(), cancel, &cancelled).ok());
  }
  // The coordinator dies once every worker is in the phase; a worker fault hits the first there.
  const std::vector<pid_t> reached = WaitReached(point, row.coordinator ? 4 : 1);
  ASSERT_FALSE(reached.empty()) << "no worker reached " << point;

  if (row.coordinator) {
    // The coordinator dies while a worker is held in the phase; the worker finishes it meanwhile.
    ASSERT_EQ(kill(coordinator_, SIGKILL), 0);
    WaitExit(coordinator_);
    coordinator_ = -1;
    Release(point);
    if (infer_thread.joinable()) {
      infer_thread.join();
      EXPECT_FALSE(infer_status.ok());
      EXPECT_EQ(infer_status.error_code(), grpc::StatusCode::UNAVAILABLE) << infer_status.error_message();
    }
    if (point == "worker_forward") {
      // The held forwards were under way, so they run to the end without the coordinator. It comes
      // back once every worker has finished (the next forward they expect is then 2:
      // SubmitUntilServing's Infer was 0); a forward still running when its worker registers
      // again would fail the job instead ("a forward was cut off"). The probe waits for the job's
      // lock, which a running forward holds.
      for (size_t i = 0; i < workers_.size(); ++i) {
        int64_t next = -1;
        for (int k = 0; k < 300 && (next = NextSequence(i, job.id())) != 2; ++k) usleep(100 * 1000);
        ASSERT_EQ(next, 2) << "worker " << i << " did not finish the held forward";
      }
    }
    const absl::Time restarted = absl::Now();
    StartCoordinator();
    ASSERT_TRUE(WaitForHealthy(4));
    const v1::JobEvent last = Watch(job.id());  // returns once the job is settled (not recovering)
    const absl::Duration detect = absl::Now() - restarted;
    if (point == "worker_load") {
      // A load the coordinator did not see finish is not trusted: the job is placed and loaded
      // again (it was failed before issue 22), saying why, and serves.
      EXPECT_EQ(last.job().state(), v1::READY) << last.job().failure_cause();
      // Any of its recoveries: a later one may follow (a run saw a worker judged unreachable, "No
      // such file or directory", while the job loaded again; the job still came back and served).
      bool placed_again_for_the_load = false;
      for (const v1::StateChange& change : last.job().history()) {
        placed_again_for_the_load |= change.state() == v1::PENDING && change.reason().rfind("recovering: ", 0) == 0 &&
                                     change.reason().find("while the job was loading") != std::string::npos;
      }
      EXPECT_TRUE(placed_again_for_the_load) << last.job().DebugString();
      Report("loaded again (" + RecoveryReason(last.job()) + "), READY, serves", detect);
      EXPECT_LE(InferDiff(job.id()), 1e-5f);
    } else {
      // The workers still hold a READY job: the restarted coordinator takes it back and serves.
      EXPECT_EQ(last.job().state(), v1::READY) << last.job().failure_cause();
      Report("READY again, serves", detect);
      EXPECT_LE(InferDiff(job.id()), 1e-5f);
    }
    CheckStoredAfterRestart(last.job());
    return;
  }

  const int victim = IndexOf(reached[0]);
  ASSERT_GE(victim, 0) << "pid " << reached[0] << " is not one of the workers";
  const pid_t victim_pid = workers_[static_cast<size_t>(victim)];
  const std::string victim_id = IdOf(victim);
  ASSERT_FALSE(victim_id.empty());
  const absl::Time faulted = absl::Now();
  if (row.fault == Fault::kKill) {
    KillWorker(victim);
  } else {
    ASSERT_EQ(kill(victim_pid, SIGSTOP), 0);
  }
  Release(point);  // the others go on (the stopped victim stays where it is)

  v1::Job final_job;
  absl::Duration detect;
  if (point == "worker_unload") {
    // The job was cancelled before the fault and stays so; the verdict is on the worker.
    final_job = GetJob(job.id());
    EXPECT_EQ(final_job.state(), v1::CANCELLED);
    bool dead = false;
    while (!dead && absl::Now() - faulted < absl::Seconds(20)) {
      v1::ListWorkersResponse workers;
      ASSERT_TRUE(stub_->ListWorkers(Context().get(), v1::ListWorkersRequest(), &workers).ok());
      for (const auto& w : workers.workers()) dead |= w.worker_id() == victim_id && !w.healthy();
      if (!dead) usleep(20 * 1000);
    }
    detect = absl::Now() - faulted;
    EXPECT_TRUE(dead) << victim_id << " still healthy";
    Report(std::string("CANCELLED; worker marked unhealthy"), detect);
  } else {
    final_job = WaitLost(job.id(), absl::Seconds(30));
    detect = absl::Now() - faulted;
    EXPECT_NE(final_job.state(), v1::FAILED) << final_job.failure_cause();
    EXPECT_NE(RecoveryReason(final_job).find(victim_id), std::string::npos) << final_job.DebugString();
    Report("group lost, placed again (" + RecoveryReason(final_job) + ")", detect);
    // Killed: seen at once when a call to it breaks, else within 3 1/4 heartbeat intervals (1 s);
    // stopped: 3 silent intervals. 6 s leaves room for a loaded CI machine.
    EXPECT_LT(detect, absl::Seconds(6));
  }
  if (infer_thread.joinable()) {
    // The call in flight is sent again once a group serves; none does before its deadline (the
    // victim is dead or still stopped), so it hears UNAVAILABLE, shortly before that deadline.
    infer_thread.join();
    EXPECT_EQ(infer_status.error_code(), grpc::StatusCode::UNAVAILABLE) << infer_status.error_message();
    EXPECT_LT(infer_returned - faulted, absl::Seconds(row_deadline_s_)) << infer_status.error_message();
  }
  if (point != "worker_unload") {
    final_job = GetJob(job.id());
    EXPECT_EQ(final_job.state(), v1::PENDING) << final_job.DebugString();  // three workers for four ranks
  }
  if (row.fault == Fault::kStop && point != "worker_unload") {
    // Continued, the worker drops its old shard and the job is placed on the four again.
    ASSERT_EQ(kill(victim_pid, SIGCONT), 0);
    final_job = WaitState(job.id(), v1::READY, absl::Seconds(40));
    EXPECT_EQ(final_job.state(), v1::READY) << final_job.DebugString();
    EXPECT_LE(InferDiff(job.id()), 1e-5f);
  } else {
    if (row.fault == Fault::kStop) {
      ASSERT_EQ(kill(victim_pid, SIGCONT), 0);
    }
    EXPECT_TRUE(WaitForWorkers(row.fault == Fault::kStop ? 4 : 3)) << "the workers are not idle";
    EXPECT_TRUE(WaitUnloadedEverywhere(job.id()));
  }
  CheckStoredAfterRestart(final_job);
}

const Row kRows[] = {
    {"KillWorkerAtLoad", Fault::kKill, "worker_load", false},
    {"StopWorkerAtLoad", Fault::kStop, "worker_load", false},
    {"KillWorkerAtRendezvous", Fault::kKill, "worker_rendezvous", false},
    {"StopWorkerAtRendezvous", Fault::kStop, "worker_rendezvous", false},
    {"KillWorkerAtForward", Fault::kKill, "worker_forward", false},
    {"StopWorkerAtForward", Fault::kStop, "worker_forward", false},
    {"KillWorkerAtUnload", Fault::kKill, "worker_unload", false},
    {"StopWorkerAtUnload", Fault::kStop, "worker_unload", false},
    {"KillCoordinatorMidLoad", Fault::kKill, "worker_load", true},
    {"KillCoordinatorMidInfer", Fault::kKill, "worker_forward", true},
};
INSTANTIATE_TEST_SUITE_P(Faults, FaultMatrix, ::testing::ValuesIn(kRows),
                         [](const ::testing::TestParamInfo<Row>& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace bertshard
