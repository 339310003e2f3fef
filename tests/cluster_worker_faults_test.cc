// Workers failing under a serving cluster (a coordinator and four shard-worker processes on
// loopback, a fresh cluster per test): a worker killed with SIGKILL loses its job's group with a
// cause naming it (at once when it dies during an inference, whatever the heartbeat interval) and
// the job waits to be placed again (no spare here: it stays PENDING, recovering), a worker stalled
// briefly keeps its job, one stopped past the threshold loses it and, once continued, the job is
// placed again and serves, and one sent SIGTERM leaves the pool at once. A killed worker's job stays
// PENDING across a coordinator restart. With a spare, a killed worker's job serves again by itself
// (RecoversOnASpareUnderClients). (Faults at each phase of a job: tests/fault_matrix_test.cc.)
#include <atomic>
#include <cstdio>
#include <filesystem>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "bertshard/v1/coordinator.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/closed_loop_clients.h"
#include "tests/cluster_fixture.h"
#include "tests/test_process.h"

namespace bertshard {
namespace {

using testing::Cluster;
using testing::Context;
using testing::kModel;
using testing::ReadAll;
using testing::WaitExit;
TEST_F(Cluster, KilledWorkersJobWaitsToBePlacedAgainAndCoordinatorRestartKeepsJobs) {
  const v1::Job job = Submit(kModel);
  const v1::JobEvent ready = Watch(job.id());
  ASSERT_EQ(ready.job().state(), v1::READY) << ready.job().failure_cause();
  // Kill the worker serving rank 3 between requests.
  const std::string victim_id = KillWorkerServing(job.id(), 3);
  ASSERT_FALSE(victim_id.empty());
  v1::InferRequest infer;
  infer.set_job_id(job.id());
  *infer.mutable_tokens() = Tokens();
  v1::InferResponse response;
  // No group comes back (three workers for four ranks): the request waits for one until shortly
  // before its deadline, then hears UNAVAILABLE, saying why.
  const grpc::Status waited = stub_->Infer(Context(4).get(), infer, &response);
  EXPECT_EQ(waited.error_code(), grpc::StatusCode::UNAVAILABLE) << waited.error_message();
  const v1::Job lost = WaitLost(job.id());
  EXPECT_EQ(lost.state(), v1::PENDING);
  EXPECT_NE(lost.degraded().find(victim_id), std::string::npos) << lost.DebugString();
  EXPECT_NE(RecoveryReason(lost).find("rank 3"), std::string::npos) << lost.DebugString();
  EXPECT_EQ(lost.restarts(), 1);
  // shardctl says it too: `jobs` in its detail, `job` in the degraded field.
  const std::string server = "--server=127.0.0.1:" + std::to_string(port_);
  const testing::Cli listed = testing::Shardctl({"jobs", server});
  EXPECT_EQ(listed.exit_code, 0) << listed.output;
  EXPECT_NE(listed.output.find("recovering: lost worker " + victim_id), std::string::npos) << listed.output;
  const testing::Cli shown = testing::Shardctl({"job", server, job.id()});
  EXPECT_EQ(shown.exit_code, 0) << shown.output;
  EXPECT_NE(shown.output.find("degraded"), std::string::npos) << shown.output;
  EXPECT_NE(shown.output.find("lost worker " + victim_id), std::string::npos) << shown.output;
  EXPECT_TRUE(WaitForWorkers(3));  // the survivors are idle again
  // Within 3 1/4 heartbeat intervals of its last heartbeat the coordinator marks it dead.
  bool dead = false;
  v1::ListWorkersResponse workers;
  for (int i = 0; i < 200 && !dead; ++i) {
    ASSERT_TRUE(stub_->ListWorkers(Context().get(), v1::ListWorkersRequest(), &workers).ok());
    for (const auto& w : workers.workers()) dead |= (w.worker_id() == victim_id && !w.healthy());
    if (!dead) usleep(50 * 1000);
  }
  EXPECT_TRUE(dead);

  // A new job while one worker is gone stays PENDING, or is refused when asked not to wait.
  v1::SubmitJobRequest no_wait;
  no_wait.mutable_request()->set_checkpoint(std::filesystem::absolute(kModel).string());
  no_wait.mutable_request()->mutable_parallel()->set_tp_size(2);
  no_wait.mutable_request()->mutable_parallel()->set_pp_size(2);
  no_wait.set_fail_if_no_workers(true);
  v1::Job refused;
  EXPECT_EQ(stub_->SubmitJob(Context().get(), no_wait, &refused).error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  const v1::Job pending = Submit(kModel);
  EXPECT_EQ(pending.state(), v1::PENDING);

  // Restart the coordinator: it still lists every job, and the workers register again.
  StopCoordinator();
  StartCoordinator();
  v1::ListJobsResponse jobs;
  ASSERT_TRUE(stub_->ListJobs(Context().get(), v1::ListJobsRequest(), &jobs).ok());
  ASSERT_EQ(jobs.jobs_size(), 2);
  EXPECT_EQ(jobs.jobs(0).id(), job.id());
  EXPECT_EQ(jobs.jobs(0).state(), v1::PENDING);  // still waiting to be placed again
  EXPECT_NE(jobs.jobs(0).degraded().find("lost worker " + victim_id), std::string::npos) << jobs.jobs(0).DebugString();
  EXPECT_NE(RecoveryReason(jobs.jobs(0)).find(victim_id), std::string::npos) << jobs.jobs(0).DebugString();
  EXPECT_EQ(jobs.jobs(1).state(), v1::PENDING);
  EXPECT_TRUE(WaitForWorkers(3)) << ReadAll(data_dir_ + ".log") << ReadAll(WorkerLog(0)) << ReadAll(WorkerLog(1))
                                 << ReadAll(WorkerLog(2)) << ReadAll(WorkerLog(3)) <<
      [&] {
        std::string alive;
        for (pid_t p : workers_) {  // survivors still running?
          int status = 0;
          const pid_t r = waitpid(p, &status, WNOHANG);
          alive += "pid " + std::to_string(p) + (r == 0 ? " alive; " : " exited with " + std::to_string(status) + "; ");
        }
        return alive;
      }()
                                 << [&] {
                                      v1::ListWorkersResponse w;
                                      stub_->ListWorkers(Context().get(), v1::ListWorkersRequest(), &w);
                                      return w.DebugString();
                                    }();
}

// Issue 22: a TP 2 job on four workers (two spares), under closed-loop clients checking every
// answer against the reference. SIGKILL one of its workers: the group is lost, placed again on the
// spares and loaded, and the job is READY again by itself; the batch in flight is sent again on the
// new group, so clients see no error at all, or at most UNAVAILABLE for requests made during the
// gap (never a wrong answer, never another code). Prints the time from the kill to the first answer
// to a request sent after it and to READY again (loaded, shared machine: no bound asserted on speed).
TEST_F(Cluster, KilledWorkersJobServesAgainOnASpareUnderClients) {
  const v1::Job job = Submit(kModel, 2, 1);
  ASSERT_EQ(Watch(job.id()).job().state(), v1::READY);
  const std::vector<float> expected = Expected();
  constexpr int kClients = 8;  // issue 22: 8-16 closed-loop clients
  testing::ClosedLoopClients clients(kClients, [&] {
    v1::InferRequest infer;
    infer.set_job_id(job.id());
    *infer.mutable_tokens() = Tokens();
    v1::InferResponse response;
    const grpc::Status status = stub_->Infer(Context(60).get(), infer, &response);
    return testing::ClosedLoopClients::Outcome{
        status, response.outputs_size() == 1 && MaxDiff(response.outputs(0), expected) <= 1e-5f};
  });
  ASSERT_TRUE(clients.WaitAnswers(8)) << "the clients are not being answered";
  std::string victim_id;
  const int victim = WorkerServing(job.id(), 1, &victim_id);
  ASSERT_GE(victim, 0);
  KillWorker(victim);
  // After the kill: a request sent before it may have been answered by the old group.
  const absl::Time killed = clients.Mark();
  const v1::Job lost = WaitLost(job.id());
  EXPECT_NE(RecoveryReason(lost).find(victim_id), std::string::npos) << lost.DebugString();
  const v1::Job back = WaitState(job.id(), v1::READY, absl::Seconds(40));
  const absl::Time ready_again = absl::Now();
  ASSERT_EQ(back.state(), v1::READY) << back.DebugString();
  EXPECT_EQ(back.degraded(), "");
  for (const auto& r : back.ranks()) EXPECT_NE(r.worker_id(), victim_id);
  // Served on the new group: more answers after it is READY (each client's next requests).
  ASSERT_TRUE(clients.WaitAnswers(clients.answered() + 4 * kClients)) << "no answers after the job was READY again";
  clients.Stop();
  EXPECT_EQ(clients.wrong(), 0);
  const std::vector<testing::ClosedLoopClients::Failure> failures = clients.failures();
  for (const auto& f : failures) {
    EXPECT_EQ(f.code, grpc::StatusCode::UNAVAILABLE) << f.message;
    EXPECT_GE(f.sent, killed - absl::Seconds(1)) << "an error before the fault: " << f.message;
    EXPECT_LT(f.sent, ready_again) << "an error after the job was READY again: " << f.message;
  }
  const absl::Time first_after_kill = clients.first_answer_after();
  std::printf(
      "recovery: TP 2 job, SIGKILL of rank 1, %d clients: first answer after the kill %.2f s, READY again "
      "%.2f s, %zu client errors\n",
      kClients, absl::ToDoubleSeconds(first_after_kill - killed), absl::ToDoubleSeconds(ready_again - killed),
      failures.size());
}

// A healthy worker that stalls for less than the threshold keeps its job: SIGSTOP for 1.6 s, more
// than the old 1.5-interval threshold (which failed the job every time), less than 3 intervals
// minus the at most one interval since its last heartbeat. It serves requests afterwards.
TEST_F(Cluster, AWorkerStalledBrieflyKeepsItsJob) {
  const v1::Job job = Submit(kModel);
  const v1::JobEvent ready = Watch(job.id());
  ASSERT_EQ(ready.job().state(), v1::READY) << ready.job().failure_cause();
  std::string id;
  const int i = WorkerServing(job.id(), 1, &id);
  ASSERT_GE(i, 0);
  const pid_t pid = workers_[static_cast<size_t>(i)];
  ASSERT_EQ(kill(pid, SIGSTOP), 0);
  usleep(1600 * 1000);  // the stall itself, not a wait for anything
  const int64_t continued = absl::ToUnixMillis(absl::Now());
  ASSERT_EQ(kill(pid, SIGCONT), 0);
  // Past the point where the stall is judged: the coordinator has taken a heartbeat the worker
  // sent after it, so the silence it could fail the job for is over.
  bool beat = false;
  for (int k = 0; k < 400 && !beat; ++k) {
    v1::ListWorkersResponse workers;
    ASSERT_TRUE(stub_->ListWorkers(Context().get(), v1::ListWorkersRequest(), &workers).ok());
    for (const auto& w : workers.workers()) beat |= w.worker_id() == id && w.last_heartbeat_unix_millis() > continued;
    if (!beat) usleep(20 * 1000);
  }
  ASSERT_TRUE(beat) << "no heartbeat from " << id << " within ~10 s of SIGCONT";
  v1::GetJobRequest get;
  get.set_job_id(job.id());
  v1::Job after;
  ASSERT_TRUE(stub_->GetJob(Context().get(), get, &after).ok());
  EXPECT_EQ(after.state(), v1::READY) << after.failure_cause();
  v1::InferRequest infer;
  infer.set_job_id(job.id());
  *infer.mutable_tokens() = Tokens();
  v1::InferResponse response;
  const grpc::Status s = stub_->Infer(Context().get(), infer, &response);
  EXPECT_TRUE(s.ok()) << s.error_message();
}

// SIGSTOP during a forward for longer than the threshold (3 intervals of 1 s): the job loses its
// group naming the stopped worker, and once continued the worker drops its old shard, the job is
// placed on the four again and serves; the Infer in flight is answered on the new group, or hears
// UNAVAILABLE (never a hang, never another error).
TEST_F(Cluster, AWorkerStoppedPastTheThresholdLosesItsGroupAndTheJobServesAgainOnceContinued) {
  v1::Job job;
  ASSERT_NO_FATAL_FAILURE(SubmitUntilServing(&job));
  std::string id;
  const int i = WorkerServing(job.id(), 1, &id);
  ASSERT_GE(i, 0);
  const pid_t pid = workers_[static_cast<size_t>(i)];
  ASSERT_EQ(kill(pid, SIGSTOP), 0);
  std::atomic<bool> returned{false};
  grpc::Status infer_status;
  std::thread infer_thread([&] {
    v1::InferRequest infer;
    infer.set_job_id(job.id());
    *infer.mutable_tokens() = Tokens();
    v1::InferResponse response;
    infer_status = stub_->Infer(Context(30).get(), infer, &response);
    returned = true;
  });
  const v1::Job lost = WaitLost(job.id());
  EXPECT_NE(lost.state(), v1::FAILED) << lost.failure_cause();
  EXPECT_NE(RecoveryReason(lost).find(id), std::string::npos) << lost.DebugString();
  EXPECT_EQ(kill(pid, SIGCONT), 0);
  const v1::Job back = WaitState(job.id(), v1::READY, absl::Seconds(40));
  infer_thread.join();
  ASSERT_EQ(back.state(), v1::READY) << back.DebugString();
  EXPECT_EQ(back.degraded(), "");
  EXPECT_TRUE(returned);
  EXPECT_TRUE(infer_status.ok() || infer_status.error_code() == grpc::StatusCode::UNAVAILABLE)
      << infer_status.error_code() << " " << infer_status.error_message();
  EXPECT_LE(InferDiff(job.id()), 1e-5f);
}

// A worker sent SIGTERM leaves the pool at once (it says so before draining), well before its
// heartbeats' silence would show (3 intervals of 1 s), so no job is placed on it meanwhile.
TEST_F(Cluster, ASigtermedWorkerLeavesThePoolAtOnce) {
  std::string id;
  ASSERT_TRUE(WaitForWorkers(4));
  const std::string log = ReadAll(WorkerLog(static_cast<size_t>(spawn_index_[0])));
  const size_t at = log.find(" as worker-");
  ASSERT_NE(at, std::string::npos) << log;
  id = log.substr(at + 4, log.find(' ', at + 4) - (at + 4));
  const auto start = std::chrono::steady_clock::now();
  kill(workers_[0], SIGTERM);
  bool gone = false;
  while (!gone && std::chrono::steady_clock::now() - start < std::chrono::milliseconds(1500)) {
    v1::ListWorkersResponse workers;
    ASSERT_TRUE(stub_->ListWorkers(Context().get(), v1::ListWorkersRequest(), &workers).ok());
    for (const auto& w : workers.workers()) gone |= w.worker_id() == id && !w.healthy();
    if (!gone) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_TRUE(gone) << "worker " << id << " still healthy 1.5 s after SIGTERM";
  EXPECT_EQ(WaitExit(workers_[0]), 0);
  workers_.erase(workers_.begin());
  spawn_index_.erase(spawn_index_.begin());
}

// Heartbeats far apart: a failed forward must lose the job's group by itself, not when the liveness
// monitor would notice the dead worker. The forward is held at its start on every
// worker (a pause point), the first worker there is killed, and the others are let go.
class SlowHeartbeatCluster : public Cluster {
 protected:
  SlowHeartbeatCluster() {
    heartbeat_interval_ = "20s";
    collective_timeout_s_ = "20";  // surviving ranks may wait this long in a collective
    UseFaultDir("slow_heartbeat");
  }
};

TEST_F(SlowHeartbeatCluster, WorkerKilledDuringAnInferenceLosesTheGroupAtOnce) {
  v1::Job job;
  ASSERT_NO_FATAL_FAILURE(SubmitUntilServing(&job));
  Hold("worker_forward");
  grpc::Status status;
  absl::Time returned;
  std::thread client([&] {
    v1::InferRequest infer;
    infer.set_job_id(job.id());
    *infer.mutable_tokens() = Tokens();
    v1::InferResponse response;
    // No group can come back (three workers for four ranks): the retry waits until shortly before
    // this deadline.
    status = stub_->Infer(Context(5).get(), infer, &response);
    returned = absl::Now();
  });
  const std::vector<pid_t> reached = WaitReached("worker_forward", 1);
  const int victim = reached.empty() ? -1 : IndexOf(reached[0]);
  const std::string victim_id = victim < 0 ? "" : IdOf(victim);
  const absl::Time killed = absl::Now();
  if (victim >= 0) KillWorker(victim);
  Release("worker_forward");
  client.join();
  ASSERT_GE(victim, 0) << "no worker reached its forward";
  EXPECT_FALSE(status.ok());
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE) << status.error_message();
  // Well under the 20 s heartbeat interval and collective timeout; loose for a loaded machine.
  EXPECT_LT(returned - killed, absl::Seconds(6));
  const v1::Job lost = GetJob(job.id());  // already lost: nothing waits for the monitor
  EXPECT_EQ(lost.state(), v1::PENDING);
  EXPECT_NE(RecoveryReason(lost).find(victim_id), std::string::npos) << lost.DebugString();
  EXPECT_TRUE(WaitForWorkers(3));  // the survivors were told to unload
  EXPECT_TRUE(WaitUnloadedEverywhere(job.id()));
}
}  // namespace
}  // namespace bertshard
