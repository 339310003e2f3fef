// Cancellation end to end (tests/behaviour_cluster.h: a coordinator and four shard-worker
// processes on loopback, fresh per test, phases held at the workers' and the coordinator's pause
// points): cancelling PENDING, LOADING and PLANNED jobs leaves no shard behind and no worker asked
// to load them, a worker registering again while its job is PLANNED fails it, and callers of Infer
// whose deadline passes or who go away while their forward is held leave the job serving.
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "bertshard/v1/coordinator.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/behaviour_cluster.h"
#include "tests/cluster_fixture.h"
#include "tests/test_process.h"

namespace bertshard {
namespace {

using testing::BehaviourCluster;
using testing::CancelledMessage;
using testing::Context;
using testing::DeadlineMessage;
using testing::kModel;
using testing::NowMillis;
using testing::PollFor;
using testing::ReadAll;
using testing::States;

// 4. Cancel of a PENDING job and of a LOADING one (its workers held before reading a tensor): both
// CANCELLED with their history, the workers idle at once and holding nothing, and the held loads,
// released afterwards, leave no shard behind (no worker ever reports one for the heartbeats to
// drop). A job cancelled while LOADING but before any rank was asked to load (the coordinator's
// call reserving rank 0's rendezvous port held up by stopping that worker) is never loaded once the
// call goes through: no worker is asked to load it (server/cluster.cc LoadJob used to go on and
// load it on workers it had already marked idle). The workers then serve a new job.
// (PLANNED: CancelAndReRegistrationWhileAJobIsPlanned.)
TEST_F(BehaviourCluster, CancelPendingAndLoadingJobs) {
  Hold("worker_load");
  const v1::Job loading = Submit(kModel);
  ASSERT_FALSE(WaitReached("worker_load", 4).empty());
  ASSERT_EQ(WaitState(loading.id(), v1::LOADING).state(), v1::LOADING);

  const v1::Job pending = Submit(kModel);
  ASSERT_EQ(pending.state(), v1::PENDING);
  v1::Job cancelled;
  grpc::Status s = Cancel(pending.id(), &cancelled);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(cancelled.state(), v1::CANCELLED);
  EXPECT_EQ(States(cancelled), (std::vector<v1::JobState>{v1::PENDING, v1::CANCELLED}));
  EXPECT_EQ(cancelled.history(cancelled.history_size() - 1).reason(), "cancelled by request");
  EXPECT_EQ(GetJob(pending.id()).state(), v1::CANCELLED);
  s = Cancel(pending.id(), &cancelled);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(s.error_message(), "job " + pending.id() + " is already CANCELLED");

  s = Cancel(loading.id(), &cancelled);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(cancelled.state(), v1::CANCELLED);
  EXPECT_EQ(States(cancelled), (std::vector<v1::JobState>{v1::PENDING, v1::PLANNED, v1::LOADING, v1::CANCELLED}));
  EXPECT_EQ(cancelled.failure_cause(), "");
  EXPECT_TRUE(PollFor(10, [&] { return HealthyIdle() == 4; })) << Workers().DebugString();
  for (const auto& w : ListedWorkers()) EXPECT_EQ(w.job_id(), "") << w.DebugString();
  EXPECT_TRUE(WaitUnloadedEverywhere(loading.id()));

  // Let the held loads go on: each worker goes past the pause point (it then picks its GEMM path,
  // which it logs once), notices the cancellation and drops what it read.
  Release("worker_load");
  for (size_t i = 0; i < workers_.size(); ++i) {
    EXPECT_TRUE(PollFor(
        20,
        [&] {
          return ReadAll(WorkerLog(static_cast<size_t>(spawn_index_[i]))).find("job " + loading.id() + " rank") !=
                 std::string::npos;
        }))
        << "worker " << i << " did not go on loading after the release";
  }

  // Cancelled while its loading is being set up: LOADING, its rank 0's worker stopped (SIGSTOP) so
  // that the coordinator's call reserving the rendezvous port waits, cancelled, then continued.
  // The call then succeeds, and the coordinator must not go on to load a cancelled job. Rank 0 is
  // the first healthy idle worker in id order (ListWorkers' order, the scheduler's too).
  std::string first_idle;
  for (const auto& w : ListedWorkers()) {
    if (first_idle.empty() && w.healthy() && w.job_id().empty()) first_idle = w.worker_id();
  }
  const int stalled = IndexOfId(first_idle);
  ASSERT_GE(stalled, 0);
  ASSERT_EQ(kill(workers_[static_cast<size_t>(stalled)], SIGSTOP), 0);
  stopped_.push_back(workers_[static_cast<size_t>(stalled)]);
  const v1::Job setting_up = Submit(kModel, 1, 1);
  ASSERT_EQ(setting_up.ranks_size(), 1);
  EXPECT_EQ(setting_up.ranks(0).worker_id(), first_idle);
  EXPECT_EQ(WaitState(setting_up.id(), v1::LOADING).state(), v1::LOADING);
  s = Cancel(setting_up.id(), &cancelled);
  EXPECT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(cancelled.state(), v1::CANCELLED);
  ASSERT_EQ(kill(workers_[static_cast<size_t>(stalled)], SIGCONT), 0);  // well within 3 heartbeats
  stopped_.clear();

  // The same workers serve a new job (loads and a forward: the old loads are long over by then).
  v1::Job next;
  ASSERT_NO_FATAL_FAILURE(SubmitUntilServing(&next));
  EXPECT_LE(InferDiff(next.id()), 1e-5f);
  // Two heartbeats from every worker since: a shard of the cancelled job kept by a finished load
  // would have been reported by the first, and the worker told to unload it (which it logs).
  for (int round = 0; round < 2; ++round) {
    const int64_t since = NowMillis();
    EXPECT_TRUE(PollFor(10, [&] {
      for (const auto& w : ListedWorkers()) {
        if (w.last_heartbeat_unix_millis() <= since) return false;
      }
      return true;
    }));
  }
  for (size_t i = 0; i < workers_.size(); ++i) {
    const std::string log = ReadAll(WorkerLog(static_cast<size_t>(spawn_index_[i])));
    EXPECT_EQ(log.find("unloading job " + loading.id()), std::string::npos)
        << "worker " << i << " kept a shard of the cancelled job until a heartbeat dropped it:\n"
        << log;
    EXPECT_FALSE(Holds(i, loading.id())) << "worker " << i;
    // Never even asked to load it (a load logs the GEMM path it picks for a new shape, here 1 x 1).
    EXPECT_EQ(log.find("job " + setting_up.id() + " rank"), std::string::npos)
        << "worker " << i << " was asked to load a job cancelled before its loads started:\n"
        << log;
    EXPECT_EQ(log.find("unloading job " + setting_up.id()), std::string::npos) << "worker " << i << ":\n" << log;
    EXPECT_FALSE(Holds(i, setting_up.id())) << "worker " << i;
  }
  EXPECT_EQ(GetJob(loading.id()).state(), v1::CANCELLED);
  EXPECT_EQ(GetJob(setting_up.id()).state(), v1::CANCELLED);
}

// 4b. The PLANNED window: workers are assigned, the load has not begun. The coordinator's load
// thread is held at its start ("coordinator_planned"). A job cancelled there is CANCELLED and no
// worker is ever asked to load it. A worker that registers again there under a new id (its entry
// replaced) loses the job's group naming it (it is placed again); before the fix the load thread looked the old id up
// with std::map::at and the exception ended the coordinator.
TEST_F(BehaviourCluster, CancelAndReRegistrationWhileAJobIsPlanned) {
  Hold("coordinator_planned");
  const v1::Job planned = Submit(kModel);
  ASSERT_FALSE(WaitReached("coordinator_planned", 1).empty());
  ASSERT_EQ(GetJob(planned.id()).state(), v1::PLANNED);
  v1::Job cancelled;
  grpc::Status s = Cancel(planned.id(), &cancelled);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(cancelled.state(), v1::CANCELLED);
  EXPECT_EQ(States(cancelled), (std::vector<v1::JobState>{v1::PENDING, v1::PLANNED, v1::CANCELLED}));
  EXPECT_TRUE(PollFor(10, [&] { return HealthyIdle() == 4; })) << Workers().DebugString();

  // Next: a one-worker job held in the window while its worker registers again, without it.
  ClearReached("coordinator_planned");
  const v1::Job second = Submit(kModel, 1, 1);
  ASSERT_EQ(second.ranks_size(), 1);
  ASSERT_FALSE(WaitReached("coordinator_planned", 1).empty());
  ASSERT_EQ(GetJob(second.id()).state(), v1::PLANNED);
  v1::RegisterWorkerRequest again;
  again.set_address(second.ranks(0).worker_address());
  v1::RegisterWorkerResponse registered;
  s = stub_->RegisterWorker(Context().get(), again, &registered);
  ASSERT_TRUE(s.ok()) << s.error_message();
  ASSERT_NE(registered.worker_id(), second.ranks(0).worker_id());
  Release("coordinator_planned");  // both held load threads go on

  // The job lost its group naming the replaced worker, and is placed and loaded again.
  const v1::Job lost = WaitLost(second.id());
  EXPECT_NE(lost.state(), v1::FAILED) << lost.failure_cause();
  EXPECT_NE(RecoveryReason(lost).find(second.ranks(0).worker_id()), std::string::npos) << lost.DebugString();
  const v1::Job back = WaitState(second.id(), v1::READY, absl::Seconds(40));
  EXPECT_EQ(back.state(), v1::READY) << back.DebugString();
  v1::Job second_cancelled;
  ASSERT_TRUE(Cancel(second.id(), &second_cancelled).ok());  // its worker back for the next job
  // The worker daemon itself comes back: its next heartbeat is NOT_FOUND (the registration above
  // replaced its entry) and it registers again, replacing that entry. A job placed before then
  // would go to the entry made above, and fail when the daemon registers without its shard.
  EXPECT_TRUE(PollFor(10, [&] {
    for (const auto& w : ListedWorkers()) {
      if (w.address() == again.address()) return w.healthy() && w.worker_id() != registered.worker_id();
    }
    return false;
  })) << Workers().DebugString();
  // The coordinator is alive and the pool usable: a job loads and answers on it.
  v1::Job next;
  ASSERT_NO_FATAL_FAILURE(SubmitUntilServing(&next));
  EXPECT_LE(InferDiff(next.id()), 1e-5f);
  // No worker was ever asked to load the job cancelled while PLANNED (a load logs "job ID rank").
  for (size_t i = 0; i < workers_.size(); ++i) {
    const std::string log = ReadAll(WorkerLog(static_cast<size_t>(spawn_index_[i])));
    EXPECT_EQ(log.find("job " + planned.id() + " rank"), std::string::npos) << "worker " << i << ":\n" << log;
    EXPECT_FALSE(Holds(i, planned.id())) << "worker " << i;
  }
  EXPECT_EQ(GetJob(planned.id()).state(), v1::CANCELLED);
}

// 5. A caller whose deadline passes while its forward is held on the workers gets
// DEADLINE_EXCEEDED, and one that goes away (TryCancel) CANCELLED; either way the job stays READY,
// the held forward finishes once released, and the next requests are answered correctly (the
// ranks' forward sequence is intact).
TEST_F(BehaviourCluster, InferCallersThatLeaveMidForwardLeaveTheJobServing) {
  v1::Job job;
  ASSERT_NO_FATAL_FAILURE(SubmitUntilServing(&job));

  Hold("worker_forward");
  grpc::Status late;
  std::chrono::steady_clock::duration took{};
  std::thread caller([&] {
    v1::InferResponse response;
    const auto start = std::chrono::steady_clock::now();
    late = InferReference(job.id(), &response, Context(4).get());
    took = std::chrono::steady_clock::now() - start;
  });
  const bool reached = !WaitReached("worker_forward", 4).empty();
  caller.join();
  ASSERT_TRUE(reached) << "the forward did not reach the workers";
  EXPECT_EQ(late.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << late.error_message();
  EXPECT_TRUE(DeadlineMessage(late, "the deadline passed while the request's batch ran")) << late.error_message();
  EXPECT_LT(took, std::chrono::seconds(10));
  v1::Job after = GetJob(job.id());
  EXPECT_EQ(after.state(), v1::READY) << after.failure_cause();
  Release("worker_forward");
  v1::InferResponse response;
  grpc::Status s = InferReference(job.id(), &response, Context().get());
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_LE(MaxDiff(response.outputs(0), Expected()), 1e-5f);

  // The held forward ended before the answer above (one forward at a time): hold again.
  ClearReached("worker_forward");
  Hold("worker_forward");
  auto context = Context(60);
  grpc::Status gone;
  caller = std::thread([&] {
    v1::InferResponse ignored;
    gone = InferReference(job.id(), &ignored, context.get());
  });
  const bool reached_again = !WaitReached("worker_forward", 4).empty();
  context->TryCancel();
  caller.join();
  ASSERT_TRUE(reached_again) << "the forward did not reach the workers";
  EXPECT_EQ(gone.error_code(), grpc::StatusCode::CANCELLED) << gone.error_message();
  EXPECT_TRUE(CancelledMessage(gone, "the caller went away while the request's batch ran")) << gone.error_message();
  after = GetJob(job.id());
  EXPECT_EQ(after.state(), v1::READY) << after.failure_cause();
  Release("worker_forward");
  for (int i = 0; i < 2; ++i) {
    s = InferReference(job.id(), &response, Context().get());
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_LE(MaxDiff(response.outputs(0), Expected()), 1e-5f);
  }
  after = GetJob(job.id());
  EXPECT_EQ(after.state(), v1::READY) << after.failure_cause();
  for (const auto& change : after.history()) EXPECT_NE(change.state(), v1::FAILED) << change.reason();
}
}  // namespace
}  // namespace bertshard
