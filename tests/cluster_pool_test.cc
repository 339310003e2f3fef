// The worker pool and the scheduler end to end (tests/behaviour_cluster.h: a coordinator and four
// shard-worker processes on loopback, fresh per test): PENDING jobs start by themselves when
// workers free up or join, and stay PENDING across a coordinator restart; two jobs share the pool
// and cancelling one leaves the other serving; a worker that registers again is listed once.
#include <signal.h>
#include <unistd.h>

#include <map>
#include <set>
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
using testing::Context;
using testing::kModel;
using testing::PollFor;
using testing::ReadAll;
using testing::States;

// 1. A PENDING job starts by itself when the job holding the workers is cancelled, and when a new
// worker registers.
TEST_F(BehaviourCluster, PendingJobStartsWhenWorkersFreeUpOrJoin) {
  const v1::Job first = Submit(kModel);
  ASSERT_EQ(Watch(first.id()).job().state(), v1::READY);
  const v1::Job waiting = Submit(kModel);
  ASSERT_EQ(waiting.state(), v1::PENDING);
  EXPECT_EQ(waiting.pending_reason(), "waiting for 4 healthy idle CPU workers (gloo); 0 are free");
  EXPECT_EQ(GetJob(waiting.id()).state(), v1::PENDING);  // still: nobody is free

  v1::Job cancelled;
  ASSERT_TRUE(Cancel(first.id(), &cancelled).ok());
  const v1::JobEvent started = Watch(waiting.id());  // no other call: it starts by itself
  ASSERT_EQ(started.job().state(), v1::READY) << started.job().failure_cause();
  EXPECT_EQ(States(started.job()), (std::vector<v1::JobState>{v1::PENDING, v1::PLANNED, v1::LOADING, v1::READY}));
  EXPECT_LE(InferDiff(waiting.id()), 1e-5f);

  // Every worker is busy again: a one-worker job waits, and starts on a worker that joins.
  const v1::Job small = Submit(kModel, 1, 1);
  ASSERT_EQ(small.state(), v1::PENDING);
  EXPECT_EQ(small.pending_reason(), "waiting for 1 healthy idle CPU worker (gloo); 0 are free");
  const int extra = LaunchWorker();
  const v1::JobEvent small_ready = Watch(small.id());
  ASSERT_EQ(small_ready.job().state(), v1::READY) << small_ready.job().failure_cause();
  std::string id;
  EXPECT_EQ(WorkerServing(small.id(), 0, &id), extra) << "the job did not start on the worker that joined";
  EXPECT_EQ(id, IdOf(extra));
  EXPECT_LE(InferDiff(small.id()), 1e-5f);
  EXPECT_LE(InferDiff(waiting.id()), 1e-5f);  // the 2 x 2 job is unaffected
  ExpectListedOnce(Workers());
}

// 2. Two jobs share the four workers: both READY at once on disjoint workers, both answer correctly
// (concurrently too), and cancelling one leaves the other serving.
TEST_F(BehaviourCluster, TwoJobsShareThePoolAndCancellingOneLeavesTheOther) {
  const v1::Job tp = Submit(kModel, 2, 1);
  const v1::Job pp = Submit(kModel, 1, 2);
  ASSERT_EQ(Watch(tp.id()).job().state(), v1::READY);
  ASSERT_EQ(Watch(pp.id()).job().state(), v1::READY);
  std::map<std::string, std::set<int>> ranks;
  for (const auto& w : ListedWorkers()) ranks[w.job_id()].insert(w.rank());
  EXPECT_EQ(ranks[tp.id()], (std::set<int>{0, 1}));
  EXPECT_EQ(ranks[pp.id()], (std::set<int>{0, 1}));
  EXPECT_EQ(ranks.size(), 2u);  // no idle worker left, none serving both

  std::vector<float> diffs(6, 1e9f);
  std::vector<std::thread> clients;
  for (int c = 0; c < 6; ++c) {
    clients.emplace_back([&, c] {
      v1::InferRequest infer;
      infer.set_job_id(c % 2 == 0 ? tp.id() : pp.id());
      *infer.mutable_tokens() = Tokens(c / 2 % 2);
      v1::InferResponse response;
      if (stub_->Infer(Context().get(), infer, &response).ok() && response.outputs_size() == 1) {
        diffs[static_cast<size_t>(c)] = MaxDiff(response.outputs(0), Expected(c / 2 % 2));
      }
    });
  }
  for (auto& t : clients) t.join();
  for (int c = 0; c < 6; ++c) EXPECT_LE(diffs[static_cast<size_t>(c)], 1e-5f) << "client " << c;

  v1::Job cancelled;
  const grpc::Status s = Cancel(tp.id(), &cancelled);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(cancelled.state(), v1::CANCELLED);
  EXPECT_TRUE(WaitUnloadedEverywhere(tp.id()));
  EXPECT_TRUE(PollFor(10, [&] { return HealthyIdle() == 2; })) << Workers().DebugString();
  EXPECT_EQ(GetJob(pp.id()).state(), v1::READY);
  EXPECT_LE(InferDiff(pp.id()), 1e-5f);
  // The survivor's workers still hold it.
  for (int r = 0; r < 2; ++r) {
    std::string id;
    const int i = WorkerServing(pp.id(), r, &id);
    ASSERT_GE(i, 0);
    EXPECT_TRUE(Holds(static_cast<size_t>(i), pp.id())) << "rank " << r;
  }
  v1::InferRequest infer;
  infer.set_job_id(tp.id());
  *infer.mutable_tokens() = Tokens();
  v1::InferResponse response;
  const grpc::Status refused = stub_->Infer(Context().get(), infer, &response);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(refused.error_message().find("is CANCELLED"), std::string::npos) << refused.error_message();
}

// 3. PENDING jobs survive a coordinator restart as PENDING (their history intact) while the READY
// job is taken back, and start once its workers are free. Each worker is listed once after the
// workers registered again with the new coordinator.
TEST_F(BehaviourCluster, PendingJobsStayPendingAcrossACoordinatorRestart) {
  const v1::Job running = Submit(kModel);
  ASSERT_EQ(Watch(running.id()).job().state(), v1::READY);
  const v1::Job pp = Submit(kModel, 1, 2);
  const v1::Job tp = Submit(kModel, 2, 1);
  ASSERT_EQ(pp.state(), v1::PENDING);
  ASSERT_EQ(tp.state(), v1::PENDING);

  StopCoordinator();
  StartCoordinator();
  for (const v1::Job& before : {pp, tp}) {
    const v1::Job after = GetJob(before.id());
    EXPECT_EQ(after.state(), v1::PENDING);
    EXPECT_EQ(after.pending_reason(), before.pending_reason());
    EXPECT_EQ(States(after), (std::vector<v1::JobState>{v1::PENDING}));
  }
  const v1::JobEvent back = Watch(running.id());
  ASSERT_EQ(back.job().state(), v1::READY) << back.job().failure_cause();
  EXPECT_EQ(GetJob(pp.id()).state(), v1::PENDING);  // the workers came back serving the READY job
  EXPECT_EQ(GetJob(tp.id()).state(), v1::PENDING);
  const v1::ListWorkersResponse workers = Workers();
  ExpectListedOnce(workers);
  for (const auto& w : workers.workers()) EXPECT_TRUE(w.healthy()) << w.DebugString();

  v1::Job cancelled;
  ASSERT_TRUE(Cancel(running.id(), &cancelled).ok());
  const v1::JobEvent pp_ready = Watch(pp.id());
  const v1::JobEvent tp_ready = Watch(tp.id());
  ASSERT_EQ(pp_ready.job().state(), v1::READY) << pp_ready.job().failure_cause();
  ASSERT_EQ(tp_ready.job().state(), v1::READY) << tp_ready.job().failure_cause();
  EXPECT_LE(InferDiff(pp.id()), 1e-5f);
  EXPECT_LE(InferDiff(tp.id()), 1e-5f);
}

// 7. A worker that registers again is listed once. From the same address while its old entry serves
// a job: holding the rank it keeps the job (the ranks point at its new id, inference goes on); the
// real worker, whose heartbeats then name an id the coordinator no longer knows, registers again
// itself, and keeps it too. Without its shard: the job loses its group naming it (then cancelled,
// every worker ends up idle and without the job). A worker stopped past the heartbeat threshold comes back as the same
// entry.
TEST_F(BehaviourCluster, AWorkerThatRegistersAgainIsListedOnce) {
  const v1::Job job = Submit(kModel);
  ASSERT_EQ(Watch(job.id()).job().state(), v1::READY);
  std::string old_id;
  const int index = WorkerServing(job.id(), 1, &old_id);
  ASSERT_GE(index, 0);
  std::string address;
  for (const auto& w : ListedWorkers()) {
    if (w.worker_id() == old_id) address = w.address();
  }
  ASSERT_FALSE(address.empty());

  // Registers again from the same address, as a worker that lost touch does, holding its rank.
  v1::RegisterWorkerRequest again;
  again.set_address(address);
  v1::HeldShard* held = again.add_held();
  held->set_job_id(job.id());
  held->set_rank(1);
  held->set_world_size(4);
  v1::RegisterWorkerResponse registered;
  grpc::Status s = stub_->RegisterWorker(Context().get(), again, &registered);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_NE(registered.worker_id(), old_id);
  EXPECT_EQ(registered.unload_job_ids_size(), 0);
  v1::ListWorkersResponse workers = Workers();
  ExpectListedOnce(workers);
  for (const auto& w : workers.workers()) {
    if (w.address() != address) continue;
    EXPECT_EQ(w.worker_id(), registered.worker_id());
    EXPECT_EQ(w.job_id(), job.id());
    EXPECT_EQ(w.rank(), 1);
  }
  v1::Job kept = GetJob(job.id());
  EXPECT_EQ(kept.state(), v1::READY) << kept.failure_cause();
  ASSERT_EQ(kept.ranks_size(), 4);
  EXPECT_EQ(kept.ranks(1).worker_id(), registered.worker_id());
  EXPECT_LE(InferDiff(job.id()), 1e-5f);
  // The real worker registers again by itself (its heartbeats get NOT_FOUND).
  const std::string log = WorkerLog(static_cast<size_t>(spawn_index_[static_cast<size_t>(index)]));
  EXPECT_TRUE(PollFor(10, [&] { return Count(ReadAll(log), "registered with") == 2; })) << ReadAll(log);
  const std::string own_id = IdOf(index);
  EXPECT_NE(own_id, registered.worker_id());
  workers = Workers();
  ExpectListedOnce(workers);
  for (const auto& w : workers.workers()) {
    if (w.address() == address) {
      EXPECT_EQ(w.worker_id(), own_id);
    }
  }
  kept = GetJob(job.id());
  EXPECT_EQ(kept.state(), v1::READY) << kept.failure_cause();
  EXPECT_EQ(kept.ranks(1).worker_id(), own_id);
  EXPECT_LE(InferDiff(job.id()), 1e-5f);

  // Again from rank 2's address, without its shard: the job loses its group naming the worker (and
  // would be placed again; it is cancelled here, so that what follows sees every worker idle).
  std::string rank2_id;
  ASSERT_GE(WorkerServing(job.id(), 2, &rank2_id), 0);
  again.set_address(kept.ranks(2).worker_address());
  again.clear_held();
  s = stub_->RegisterWorker(Context().get(), again, &registered);
  ASSERT_TRUE(s.ok()) << s.error_message();
  const v1::Job lost = GetJob(job.id());
  EXPECT_NE(lost.state(), v1::FAILED);
  EXPECT_EQ(RecoveryReason(lost), "recovering: lost worker " + rank2_id + " (rank 2) at " +
                                      kept.ranks(2).worker_address() +
                                      " registered again without its shard (restart 1 of at most 10)");
  v1::Job cancelled;
  ASSERT_TRUE(Cancel(job.id(), &cancelled).ok());
  EXPECT_TRUE(WaitUnloadedEverywhere(job.id()));
  // Its real worker still held rank 2 and was told to drop it when it registered again (what
  // CancelPendingAndLoadingJobs checks no worker had to be told).
  const int rank2 = IndexOfId(rank2_id);
  ASSERT_GE(rank2, 0);
  EXPECT_NE(ReadAll(WorkerLog(static_cast<size_t>(spawn_index_[static_cast<size_t>(rank2)])))
                .find("unloading job " + job.id() + ": the coordinator does not keep it here"),
            std::string::npos);
  EXPECT_TRUE(PollFor(10, [&] { return HealthyIdle() == 4; })) << Workers().DebugString();
  ExpectListedOnce(Workers());

  // Stopped past the threshold (3 heartbeat intervals), then continued: unhealthy, then the same
  // entry healthy again, not a second one.
  const std::string stopped_id = IdOf(0);
  ASSERT_EQ(kill(workers_[0], SIGSTOP), 0);
  stopped_.push_back(workers_[0]);
  const auto state_of = [&](const std::string& id) {
    for (const auto& w : ListedWorkers()) {
      if (w.worker_id() == id) return w.healthy() ? 1 : 0;
    }
    return -1;
  };
  EXPECT_TRUE(PollFor(15, [&] { return state_of(stopped_id) == 0; })) << Workers().DebugString();
  ASSERT_EQ(kill(workers_[0], SIGCONT), 0);
  stopped_.clear();
  EXPECT_TRUE(PollFor(10, [&] { return HealthyIdle() == 4; })) << Workers().DebugString();
  EXPECT_EQ(state_of(stopped_id), 1);
  ExpectListedOnce(Workers());
  v1::Job next;
  ASSERT_NO_FATAL_FAILURE(SubmitUntilServing(&next));
}
}  // namespace
}  // namespace bertshard
