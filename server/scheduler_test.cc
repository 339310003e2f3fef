// The scheduler through its own interface, with fake worker daemons on loopback (fake_worker.h).
#include "server/scheduler.h"

#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "server/fake_worker.h"
#include "server/scheduler_test_fixture.h"
#include "server/worker_pool.h"

namespace bertshard::server {
namespace {

TEST_F(SchedulerTest, PlacesAWaitingJobWhenWorkersComeAndNumbersItsForwards) {
  FakeWorker a, b;
  const v1::Job submitted = Submit(2);
  EXPECT_EQ(submitted.state(), v1::PENDING);
  EXPECT_NE(submitted.pending_reason().find("CPU workers (gloo); 0 are free"), std::string::npos)
      << submitted.pending_reason();
  const std::string first = Register(a);
  EXPECT_NE(scheduler_->GetJob(submitted.id())->pending_reason().find("1 is free"), std::string::npos)
      << scheduler_->GetJob(submitted.id())->pending_reason();  // the reason follows the pool
  const std::string second = Register(b);
  const v1::Job ready = Settled(submitted.id());
  ASSERT_EQ(ready.state(), v1::READY) << ready.DebugString();
  ASSERT_EQ(ready.ranks_size(), 2);
  EXPECT_EQ(ready.ranks(0).worker_id(), first);
  EXPECT_EQ(ready.ranks(1).worker_id(), second);
  ASSERT_EQ(a.Loads().size(), 1u);
  ASSERT_EQ(b.Loads().size(), 1u);
  EXPECT_EQ(a.Loads()[0].rank(), 0);
  EXPECT_EQ(b.Loads()[0].rank(), 1);
  EXPECT_EQ(b.Loads()[0].master_addr(), "127.0.0.1");  // rank 0's host, with the port it reserved
  EXPECT_EQ(b.Loads()[0].master_port(), 4321);
  // One rendezvous secret for the load attempt: 32 random bytes, the same in the reservation and
  // every rank's load, so that only this job's ranks can use the store.
  ASSERT_EQ(a.Reservations().size(), 1u);
  const std::string secret = a.Reservations()[0].rendezvous_secret();
  EXPECT_EQ(secret.size(), 32u);
  EXPECT_EQ(a.Loads()[0].rendezvous_secret(), secret);
  EXPECT_EQ(b.Loads()[0].rendezvous_secret(), secret);
  EXPECT_TRUE(pool_->Idle().empty());
  for (int64_t sequence = 0; sequence < 3; ++sequence) {
    auto next = scheduler_->NextForward(submitted.id(), 0, absl::Now());
    ASSERT_TRUE(next.ok()) << next.status();
    EXPECT_EQ(next->sequence, sequence);
    ASSERT_EQ(next->ranks.size(), 2u);
    EXPECT_EQ(next->ranks[0].worker_id, first);
    EXPECT_EQ(next->ranks[1].address, b.Address());
    EXPECT_NE(next->abort, nullptr);
    // One forward at a time on the replica: the next waits for this one's end.
    EXPECT_EQ(scheduler_->NextForward(submitted.id(), 0, absl::Now()).status().code(), absl::StatusCode::kUnavailable);
    scheduler_->EndForward(submitted.id(), next->replica, next->generation);
  }
}

// A rank that fails to load loses the group: the survivor unloads and the job is placed and
// loaded again, until --max_restarts (2 here) losses in a row end it FAILED naming every one.
TEST_F(SchedulerTest, ARankThatKeepsFailingToLoadIsPlacedAgainUntilMaxRestarts) {
  FakeWorker good, bad(grpc::Status(grpc::StatusCode::INTERNAL, "the disk is on fire"));
  Register(good);
  const std::string bad_id = Register(bad);
  const v1::Job failed = Settled(Submit(2).id());
  ASSERT_EQ(failed.state(), v1::FAILED) << failed.DebugString();
  EXPECT_NE(failed.failure_cause().find("lost its workers 3 times in a row (--max_restarts=2): 1) worker " + bad_id +
                                        " (rank 1): the disk is on fire"),
            std::string::npos)
      << failed.failure_cause();
  EXPECT_EQ(bad.Loads().size(), 3u);  // the first load and two restarts
  // Told to unload at each loss: the two restarts' and the last, which ended the job.
  EXPECT_TRUE(good.WaitForUnload(failed.id(), 3));
  EXPECT_TRUE(bad.WaitForUnload(failed.id(), 3));
  EXPECT_EQ(pool_->Idle().size(), 2u);  // both free again
  EXPECT_EQ(scheduler_->NextForward(failed.id(), 0, absl::Now()).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

// A load refused for what it asks (here the checkpoint's files) would fail on any workers: FAILED
// at once, not placed again.
TEST_F(SchedulerTest, ALoadThatCanNeverSucceedFailsTheJobAtOnce) {
  FakeWorker good, refusing(grpc::Status(grpc::StatusCode::NOT_FOUND, "model.safetensors: no such file"));
  Register(good);
  const std::string refusing_id = Register(refusing);
  const v1::Job failed = Settled(Submit(2).id());
  ASSERT_EQ(failed.state(), v1::FAILED) << failed.DebugString();
  EXPECT_EQ(failed.failure_cause(), "worker " + refusing_id + " (rank 1): model.safetensors: no such file");
  EXPECT_EQ(refusing.Loads().size(), 1u);
  EXPECT_TRUE(good.WaitForUnload(failed.id()));
}

// A forward that failed loses the group instead of ending the job: the survivors unload, the job
// says it is recovering and why, is placed again ahead of the jobs waiting for a first placement,
// and serves again from sequence 0. A late report about the lost group changes nothing.
TEST_F(SchedulerTest, ALostGroupIsPlacedAgainAheadOfWaitingJobs) {
  FakeWorker a, b;
  Register(a);
  Register(b);
  const v1::Job first = Settled(Submit(2).id());
  ASSERT_EQ(first.state(), v1::READY);
  const v1::Job second = Submit(2);
  EXPECT_EQ(second.state(), v1::PENDING);
  for (int i = 0; i < 2; ++i) {
    const absl::StatusOr<ForwardTarget> served = scheduler_->NextForward(first.id(), 0, absl::Now());
    ASSERT_TRUE(served.ok()) << served.status();
    scheduler_->EndForward(first.id(), served->replica, served->generation);
  }
  const absl::StatusOr<ForwardTarget> lost_target = scheduler_->NextForward(first.id(), 0, absl::Now());
  ASSERT_TRUE(lost_target.ok());
  scheduler_->EndForward(first.id(), lost_target->replica, lost_target->generation);
  scheduler_->LoseGroup(first.id(), lost_target->replica, lost_target->generation,
                        "worker w (rank 1) at a: forward 2 failed", "");
  const v1::Job recovering = *scheduler_->GetJob(first.id());
  // Back to PENDING straight from READY, saying why; then (no backoff for a first loss) placed
  // again once the survivors unloaded, perhaps already by now; never ended.
  EXPECT_FALSE(recovering.state() == v1::FAILED || recovering.state() == v1::CANCELLED) << recovering.DebugString();
  EXPECT_EQ(recovering.restarts(), 1);
  int lost_at = -1;
  for (int i = 0; i < recovering.history_size(); ++i) {
    const v1::StateChange& change = recovering.history(i);
    EXPECT_FALSE(change.state() == v1::FAILED || change.state() == v1::CANCELLED) << recovering.DebugString();
    if (change.state() == v1::PENDING && change.reason().rfind("recovering: lost worker w (rank 1) at a: forward 2 "
                                                               "failed (restart 1 of at most 2)",
                                                               0) == 0) {
      EXPECT_EQ(lost_at, -1) << "lost twice: " << recovering.DebugString();
      lost_at = i;
    }
  }
  ASSERT_GE(lost_at, 1) << recovering.DebugString();
  EXPECT_EQ(recovering.history(lost_at - 1).state(), v1::READY);
  for (int i = lost_at + 1; i < recovering.history_size(); ++i) {
    const v1::JobState expected[] = {v1::PLANNED, v1::LOADING, v1::READY};
    EXPECT_EQ(recovering.history(i).state(), expected[i - lost_at - 1]) << recovering.DebugString();
  }
  EXPECT_TRUE(a.WaitForUnload(first.id()));
  EXPECT_TRUE(b.WaitForUnload(first.id()));
  const v1::Job back = Settled(first.id());
  ASSERT_EQ(back.state(), v1::READY) << back.DebugString();
  EXPECT_EQ(back.degraded(), "");
  EXPECT_EQ(a.Loads().size(), 2u);
  EXPECT_EQ(scheduler_->GetJob(second.id())->state(), v1::PENDING);  // the recovering job went first
  scheduler_->LoseGroup(first.id(), lost_target->replica, lost_target->generation, "late news of the lost group", "");
  EXPECT_EQ(scheduler_->GetJob(first.id())->state(), v1::READY);
  const absl::StatusOr<ForwardTarget> next = scheduler_->NextForward(first.id(), 0, absl::Now());
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(next->sequence, 0);  // the new group's first forward
  EXPECT_NE(next->generation, lost_target->generation);
}

// A worker that leaves (SIGTERM) loses its job's group: the job waits, saying so, until a spare
// comes, and serves again on it.
TEST_F(SchedulerTest, ALeavingWorkersJobIsPlacedAgainOnASpareAndUnknownOnesRegisterAgain) {
  FakeWorker a, spare;
  const std::string id = Register(a);
  const v1::Job ready = Settled(Submit(1).id());
  ASSERT_EQ(ready.state(), v1::READY);
  ASSERT_TRUE(Leave(id));
  const v1::Job waiting = *scheduler_->GetJob(ready.id());
  EXPECT_EQ(waiting.state(), v1::PENDING);
  const std::string lost = "lost worker " + id + " (rank 0) at " + a.Address() + " is shutting down";
  EXPECT_EQ(waiting.degraded().rfind(lost, 0), 0u) << waiting.degraded();
  EXPECT_EQ(waiting.pending_reason().rfind("recovering: " + lost, 0), 0u) << waiting.pending_reason();
  EXPECT_NE(waiting.pending_reason().find("0 are free"), std::string::npos) << waiting.pending_reason();
  EXPECT_TRUE(pool_->Idle().empty());  // out of the pool until it beats again
  // Requests wait for the group meanwhile: the serving path is given the runtime.
  bool given_runtime = false;
  ASSERT_TRUE(scheduler_
                  ->WithServingRuntime(ready.id(),
                                       [&](const std::shared_ptr<JobRuntime>& runtime, const absl::StatusOr<v1::Job>&) {
                                         given_runtime = runtime != nullptr;
                                         return absl::OkStatus();
                                       })
                  .ok());
  EXPECT_TRUE(given_runtime);
  EXPECT_EQ(scheduler_->NextForward(ready.id(), 0, absl::Now()).status().code(), absl::StatusCode::kUnavailable);
  const std::string spare_id = Register(spare);
  const v1::Job back = Settled(ready.id());
  ASSERT_EQ(back.state(), v1::READY) << back.DebugString();
  ASSERT_EQ(back.ranks_size(), 1);
  EXPECT_EQ(back.ranks(0).worker_id(), spare_id);
  v1::HeartbeatRequest unknown;
  unknown.set_worker_id("worker-9-old");
  EXPECT_EQ(scheduler_->Heartbeat(unknown).status().code(), absl::StatusCode::kNotFound);
}

// A batch waiting for a lost group (NextForward) goes on once the group is READY again on a spare,
// numbered from 0, long before its own deadline. (It usually blocks before the spare comes; should
// it arrive after, it is answered at once, the same.)
TEST_F(SchedulerTest, ABatchWaitingForTheGroupGoesOnWhenItIsBack) {
  FakeWorker a, spare;
  const std::string id = Register(a);
  const v1::Job ready = Settled(Submit(1).id());
  ASSERT_EQ(ready.state(), v1::READY);
  ASSERT_TRUE(Leave(id));
  ASSERT_EQ(scheduler_->GetJob(ready.id())->state(), v1::PENDING);
  absl::StatusOr<ForwardTarget> waited = absl::UnknownError("not returned");
  absl::Duration took;
  std::thread batch([&] {
    const absl::Time start = absl::Now();
    waited = scheduler_->NextForward(ready.id(), 0, start + absl::Seconds(60));
    took = absl::Now() - start;
  });
  const std::string spare_id = Register(spare);
  batch.join();
  ASSERT_TRUE(waited.ok()) << waited.status();
  EXPECT_LT(took, absl::Seconds(30));
  EXPECT_EQ(waited->sequence, 0);
  ASSERT_EQ(waited->ranks.size(), 1u);
  EXPECT_EQ(waited->ranks[0].worker_id, spare_id);
}

// The second loss in a row waits out its backoff before the job is placed again, saying until when,
// even with a worker free.
TEST_F(SchedulerTest, ASecondLossInARowWaitsOutItsBackoff) {
  options_.restarts.backoff_initial = absl::Hours(1);
  options_.restarts.max_restarts = 5;
  Start();
  FakeWorker a, b, c;
  const std::string a_id = Register(a);
  const v1::Job ready = Settled(Submit(1).id());
  ASSERT_EQ(ready.state(), v1::READY);
  ASSERT_TRUE(Leave(a_id));
  const std::string b_id = Register(b);  // the first restart is at once
  ASSERT_EQ(Settled(ready.id()).state(), v1::READY);
  ASSERT_TRUE(Leave(b_id));
  Register(c);
  const v1::Job backing_off = *scheduler_->GetJob(ready.id());
  EXPECT_EQ(backing_off.state(), v1::PENDING);
  EXPECT_EQ(backing_off.restarts(), 2);
  EXPECT_NE(backing_off.pending_reason().find("(backoff: 2 losses in a row)"), std::string::npos)
      << backing_off.pending_reason();
  EXPECT_TRUE(c.Loads().empty());
  EXPECT_EQ(pool_->Idle().size(), 1u);  // c, left free
}

// Cancelled while it waits out a backoff: the job ends CANCELLED at once, a batch waiting for its
// group is released (FAILED_PRECONDITION, the job no longer serves; JobServing adds the loss), and
// no restart follows. (The batch may also arrive after the cancel: the same answer, at once.)
TEST_F(SchedulerTest, CancelledWhileBackingOffItEndsAndReleasesTheBatchesWaiting) {
  options_.restarts.backoff_initial = absl::Hours(1);
  options_.restarts.max_restarts = 5;
  Start();
  FakeWorker a, b, c;
  const std::string a_id = Register(a);
  const v1::Job ready = Settled(Submit(1).id());
  ASSERT_EQ(ready.state(), v1::READY);
  ASSERT_TRUE(Leave(a_id));
  const std::string b_id = Register(b);
  ASSERT_EQ(Settled(ready.id()).state(), v1::READY);
  ASSERT_TRUE(Leave(b_id));  // the second loss: an hour's backoff
  ASSERT_EQ(scheduler_->GetJob(ready.id())->state(), v1::PENDING);
  absl::StatusOr<ForwardTarget> waited = absl::UnknownError("not returned");
  absl::Duration took;
  std::thread batch([&] {
    const absl::Time start = absl::Now();
    waited = scheduler_->NextForward(ready.id(), 0, start + absl::Seconds(60));
    took = absl::Now() - start;
  });
  const absl::StatusOr<v1::Job> cancelled = scheduler_->CancelJob(ready.id());
  batch.join();
  ASSERT_TRUE(cancelled.ok()) << cancelled.status();
  EXPECT_EQ(cancelled->state(), v1::CANCELLED);
  EXPECT_EQ(waited.status().code(), absl::StatusCode::kFailedPrecondition) << waited.status();
  EXPECT_LT(took, absl::Seconds(30));  // released, not left to its deadline
  Register(c);
  EXPECT_TRUE(c.Loads().empty());  // nothing placed again
  EXPECT_EQ(scheduler_->GetJob(ready.id())->state(), v1::CANCELLED);
}

// Placement happens within the call that makes it possible, so what has not loaded by the time
// RegisterWorker returns never will.
TEST_F(SchedulerTest, DrainedOrStoppedItPlacesNothingAndServesNothing) {
  FakeWorker a;
  scheduler_->Drain();
  Register(a);
  const v1::Job job = Submit(1);
  EXPECT_EQ(scheduler_->GetJob(job.id())->state(), v1::PENDING);
  EXPECT_TRUE(a.Loads().empty());
  scheduler_->Stop();
  bool called = false;
  const absl::Status refused =
      scheduler_->WithServingRuntime(job.id(), [&](const std::shared_ptr<JobRuntime>&, const absl::StatusOr<v1::Job>&) {
        called = true;
        return absl::OkStatus();
      });
  EXPECT_EQ(refused.code(), absl::StatusCode::kUnavailable) << refused;
  EXPECT_FALSE(called);
}

TEST_F(SchedulerTest, SaysWhyAJobDoesNotServeAndListsWithoutTheServingLock) {
  const v1::Job job = Submit(1);
  absl::StatusOr<v1::Job> seen = absl::UnknownError("not called");
  ASSERT_TRUE(
      scheduler_
          ->WithServingRuntime(job.id(),
                               [&](const std::shared_ptr<JobRuntime>& serving, const absl::StatusOr<v1::Job>& j) {
                                 EXPECT_EQ(serving, nullptr);
                                 seen = j;
                                 return absl::OkStatus();
                               })
          .ok());
  ASSERT_TRUE(seen.ok()) << seen.status();
  EXPECT_EQ(seen->state(), v1::PENDING);
  // ListJobs from inside the serving lock would deadlock if it listed under that lock.
  auto listed = scheduler_->ListJobs(10, "");
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->jobs.size(), 1u);
  EXPECT_EQ(listed->jobs[0].id(), job.id());
}

// An ended job keeps no runtime (its plan, progress, serving state): memory follows the live jobs.
// Its record stays in the store.
TEST_F(SchedulerTest, AnEndedJobKeepsNoRuntime) {
  FakeWorker worker;
  Register(worker);
  const v1::Job ready = Settled(Submit(1).id());
  ASSERT_EQ(ready.state(), v1::READY);
  const v1::Job waiting = Submit(1);  // PENDING: the one worker is taken
  const auto runtimes = [this] {
    std::vector<std::string> ids;
    scheduler_->ForEachRuntime([&](const std::string& id, JobRuntime&) { ids.push_back(id); });
    return ids;
  };
  EXPECT_EQ(runtimes(), (std::vector<std::string>{ready.id(), waiting.id()}));
  ASSERT_TRUE(scheduler_->CancelJob(ready.id()).ok());
  const v1::Job placed = Settled(waiting.id());  // the freed worker takes the waiting job
  EXPECT_EQ(placed.state(), v1::READY);
  EXPECT_EQ(runtimes(), std::vector<std::string>{waiting.id()});
  ASSERT_TRUE(scheduler_->CancelJob(waiting.id()).ok());
  EXPECT_TRUE(runtimes().empty());
  EXPECT_EQ(scheduler_->GetJob(ready.id())->state(), v1::CANCELLED);
  EXPECT_EQ(scheduler_->CountJobsByState()->at(v1::CANCELLED), 2);
  // Ended jobs do not count against the client's quota, and cannot be cancelled again.
  EXPECT_EQ(scheduler_->CancelJob(ready.id()).status().code(), absl::StatusCode::kFailedPrecondition);
}

// --job_retention: ended jobs older than it leave the database at the monitor's next sweep; jobs
// that have not ended stay, however old.
TEST(SchedulerRetention, EndedJobsPastRetentionAreDeleted) {
  ClusterOptions options;
  options.heartbeat_interval = absl::Milliseconds(40);  // the monitor looks every 10 ms
  options.job_retention = absl::Milliseconds(200);
  options.retention_sweep_interval = absl::Milliseconds(20);
  WorkerPool pool(options, "test");
  auto store = jobs::JobStore::Open(":memory:");
  ASSERT_TRUE(store.ok());
  auto scheduler = Scheduler::Create(options, *std::move(store), &pool);
  ASSERT_TRUE(scheduler.ok()) << scheduler.status();
  const std::filesystem::path dir = std::filesystem::path(testing::TempDir()) / "retention_model";
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "config.json") << R"({"architectures": ["BertForMaskedLM"]})";
  v1::SubmitJobRequest submit;
  submit.mutable_request()->set_checkpoint(dir.string());
  auto ended = (*scheduler)->SubmitJob(submit, "test");
  auto waiting = (*scheduler)->SubmitJob(submit, "test");  // PENDING: no workers
  ASSERT_TRUE(ended.ok() && waiting.ok());
  ASSERT_TRUE((*scheduler)->CancelJob(ended->id()).ok());
  EXPECT_TRUE((*scheduler)->GetJob(ended->id()).ok());  // kept for the retention period
  const absl::Time give_up = absl::Now() + absl::Seconds(20);
  while ((*scheduler)->GetJob(ended->id()).ok() && absl::Now() < give_up) absl::SleepFor(absl::Milliseconds(20));
  EXPECT_EQ((*scheduler)->GetJob(ended->id()).status().code(), absl::StatusCode::kNotFound);
  absl::SleepFor(absl::Milliseconds(300));  // well past retention
  auto still = (*scheduler)->GetJob(waiting->id());
  ASSERT_TRUE(still.ok()) << still.status();
  EXPECT_EQ(still->state(), v1::PENDING);
}

}  // namespace
}  // namespace bertshard::server
