// A job's replicas through the scheduler's own interface (scheduler_replicas.cc), with fake
// worker daemons on loopback: placement, the choice of replica per forward, losing one while the
// others serve, scaling, bad counts, and a restart that takes each replica back on its own.
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "server/fake_worker.h"
#include "server/replica_keys.h"
#include "server/scheduler_test_fixture.h"

namespace bertshard::server {
namespace {

using ReplicasTest = SchedulerTest;

// What each worker was asked to load: the replica's key on it.
std::set<std::string> LoadedKeys(const std::vector<const FakeWorker*>& workers) {
  std::set<std::string> keys;
  for (const FakeWorker* w : workers) {
    for (const v1::LoadShardRequest& load : w->Loads()) keys.insert(load.job_id());
  }
  return keys;
}

std::set<std::string> WorkersOf(const v1::ReplicaStatus& replica) {
  std::set<std::string> ids;
  for (const v1::RankAssignment& a : replica.ranks()) ids.insert(a.worker_id());
  return ids;
}

// Two replicas of a 2-rank plan take four workers, each replica its own two, loaded under their
// own keys with their own rendezvous; the job lists both, READY, with their ranks.
TEST_F(ReplicasTest, EachReplicaIsPlacedOnItsOwnWorkers) {
  FakeWorker a, b, c, d;
  for (const FakeWorker* w : {&a, &b, &c, &d}) Register(*w);
  const v1::Job submitted = Submit(2, /*replicas=*/2);
  EXPECT_EQ(submitted.replicas(), 2);
  const v1::Job ready = Settled(submitted.id(), /*all_replicas=*/true);
  ASSERT_EQ(ready.state(), v1::READY) << ready.DebugString();
  EXPECT_EQ(ready.ranks_size(), 4);
  ASSERT_EQ(ready.replica_status_size(), 2) << ready.DebugString();
  std::set<std::string> all;
  for (const v1::ReplicaStatus& replica : ready.replica_status()) {
    EXPECT_EQ(replica.state(), v1::READY) << ready.DebugString();
    ASSERT_EQ(replica.ranks_size(), 2);
    for (const v1::RankAssignment& rank : replica.ranks()) EXPECT_EQ(rank.replica(), replica.replica());
    for (const std::string& id : WorkersOf(replica)) EXPECT_TRUE(all.insert(id).second) << "shared: " << id;
  }
  EXPECT_EQ(LoadedKeys({&a, &b, &c, &d}), (std::set<std::string>{ready.id(), ReplicaKey(ready.id(), 1)}));
  EXPECT_EQ(a.Reservations().size() + b.Reservations().size() + c.Reservations().size() + d.Reservations().size(),
            2u);  // one rendezvous per replica
  EXPECT_TRUE(pool_->Idle().empty());
}

// With fewer workers than its replicas need, the job serves on those placed and says what the
// others wait for; a worker coming later makes the next replica.
TEST_F(ReplicasTest, AReplicaWaitsForWorkersWhileTheOthersServe) {
  FakeWorker a, b;
  Register(a);
  const v1::Job ready = Settled(Submit(1, 2).id());
  ASSERT_EQ(ready.state(), v1::READY);
  ASSERT_EQ(ready.replica_status_size(), 2);
  EXPECT_EQ(ready.replica_status(1).state(), v1::PENDING);
  EXPECT_NE(ready.replica_status(1).reason().find("0 are free"), std::string::npos) << ready.DebugString();
  Register(b);
  const v1::Job both = Settled(ready.id(), true);
  ASSERT_EQ(both.replica_status_size(), 2);
  EXPECT_EQ(both.replica_status(1).state(), v1::READY) << both.DebugString();
  EXPECT_EQ(LoadedKeys({&b}), std::set<std::string>{ReplicaKey(ready.id(), 1)});
}

// Each forward takes the free replica idle the longest and holds it until it ends: two forwards
// run at once on two replicas, a third waits for one of them.
TEST_F(ReplicasTest, ForwardsTakeTheFreeReplicaIdleTheLongest) {
  FakeWorker a, b;
  Register(a);
  Register(b);
  const v1::Job ready = Settled(Submit(1, 2).id(), true);
  ASSERT_EQ(ready.state(), v1::READY);
  const absl::StatusOr<ForwardTarget> first = scheduler_->NextForward(ready.id(), 0, absl::Now());
  const absl::StatusOr<ForwardTarget> second = scheduler_->NextForward(ready.id(), 0, absl::Now());
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_NE(first->replica, second->replica);
  EXPECT_NE(first->ranks[0].worker_id, second->ranks[0].worker_id);
  EXPECT_EQ(first->sequence, 0);
  EXPECT_EQ(second->sequence, 0);  // numbered per replica
  // Each sent under its replica's key on the workers.
  EXPECT_EQ((std::set<std::string>{first->shard_key, second->shard_key}),
            (std::set<std::string>{ready.id(), ReplicaKey(ready.id(), 1)}));
  const absl::StatusOr<ForwardTarget> busy = scheduler_->NextForward(ready.id(), 0, absl::Now());
  EXPECT_EQ(busy.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(busy.status().message().find("busy"), std::string::npos) << busy.status();
  // A third forward waiting for a replica goes on when one ends.
  absl::StatusOr<ForwardTarget> waited = absl::UnknownError("not returned");
  std::thread batch([&] { waited = scheduler_->NextForward(ready.id(), 0, absl::Now() + absl::Seconds(60)); });
  scheduler_->EndForward(ready.id(), second->replica, second->generation);
  batch.join();
  ASSERT_TRUE(waited.ok()) << waited.status();
  EXPECT_EQ(waited->replica, second->replica);
  EXPECT_EQ(waited->sequence, 1);
  scheduler_->EndForward(ready.id(), first->replica, first->generation);
  scheduler_->EndForward(ready.id(), waited->replica, waited->generation);
  // Both free: the one idle the longest (first's) goes next.
  const absl::StatusOr<ForwardTarget> next = scheduler_->NextForward(ready.id(), 0, absl::Now());
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(next->replica, first->replica);
  const v1::Job counted = *scheduler_->GetJob(ready.id());
  EXPECT_EQ(counted.replica_status(first->replica).forwards_in_flight(), 1);
  EXPECT_EQ(counted.replica_status(second->replica).forwards(), 2);
}

// One replica losing a worker leaves the job READY on the other, which takes the forwards; the job
// says which replica is degraded and why, and the lost one comes back on a spare.
TEST_F(ReplicasTest, LosingAReplicaLeavesTheJobReadyOnTheOthers) {
  FakeWorker a, b, spare;
  const std::string a_id = Register(a);
  Register(b);
  const v1::Job ready = Settled(Submit(1, 2).id(), true);
  ASSERT_EQ(ready.state(), v1::READY);
  int32_t lost = -1;
  for (const v1::ReplicaStatus& r : ready.replica_status()) {
    if (WorkersOf(r).count(a_id) > 0) lost = r.replica();
  }
  ASSERT_GE(lost, 0);
  ASSERT_TRUE(Leave(a_id));
  const v1::Job degraded = *scheduler_->GetJob(ready.id());
  EXPECT_EQ(degraded.state(), v1::READY) << degraded.DebugString();
  EXPECT_NE(degraded.degraded().find(absl::StrCat("replica ", lost, ": lost worker ", a_id)), std::string::npos)
      << degraded.degraded();
  EXPECT_EQ(degraded.replica_status(lost).state(), v1::PENDING);
  EXPECT_EQ(degraded.restarts(), 1);
  for (int i = 0; i < 3; ++i) {
    const absl::StatusOr<ForwardTarget> next = scheduler_->NextForward(ready.id(), 0, absl::Now());
    ASSERT_TRUE(next.ok()) << next.status();
    EXPECT_NE(next->replica, lost);
    scheduler_->EndForward(ready.id(), next->replica, next->generation);
  }
  const std::string spare_id = Register(spare);
  const v1::Job back = Settled(ready.id(), true);
  EXPECT_EQ(back.degraded(), "");
  EXPECT_EQ(back.replica_status(lost).state(), v1::READY) << back.DebugString();
  EXPECT_EQ(WorkersOf(back.replica_status(lost)), std::set<std::string>{spare_id});
  EXPECT_EQ(LoadedKeys({&spare}), std::set<std::string>{ReplicaKey(ready.id(), lost)});
}

// Scale 1 -> 3 -> 1: new replicas are placed on idle workers; taking one away that runs a forward
// lets the forward finish, then unloads it (its workers go back to the pool).
TEST_F(ReplicasTest, ScalingUpAndDownDrainsTheForwardInFlight) {
  FakeWorker a, b, c;
  for (const FakeWorker* w : {&a, &b, &c}) Register(*w);
  const v1::Job ready = Settled(Submit(1).id());
  ASSERT_EQ(ready.state(), v1::READY);
  EXPECT_EQ(pool_->Idle().size(), 2u);
  const absl::StatusOr<v1::Job> up = scheduler_->ScaleJob(ready.id(), 3);
  ASSERT_TRUE(up.ok()) << up.status();
  EXPECT_EQ(up->replicas(), 3);
  const v1::Job three = Settled(ready.id(), true);
  ASSERT_EQ(three.replica_status_size(), 3);
  for (const v1::ReplicaStatus& r : three.replica_status()) EXPECT_EQ(r.state(), v1::READY) << three.DebugString();
  EXPECT_TRUE(pool_->Idle().empty());
  // Hold replica 2 with a forward, then scale to 1.
  std::vector<ForwardTarget> held;
  for (int i = 0; i < 3; ++i) held.push_back(*scheduler_->NextForward(ready.id(), 0, absl::Now()));
  for (const ForwardTarget& t : held) {
    if (t.replica != 2) scheduler_->EndForward(ready.id(), t.replica, t.generation);
  }
  const ForwardTarget& on_two = held[0].replica == 2 ? held[0] : held[1].replica == 2 ? held[1] : held[2];
  ASSERT_EQ(on_two.replica, 2);
  const absl::StatusOr<v1::Job> down = scheduler_->ScaleJob(ready.id(), 1);
  ASSERT_TRUE(down.ok()) << down.status();
  EXPECT_EQ(down->replicas(), 1);
  ASSERT_EQ(down->replica_status_size(), 2) << down->DebugString();  // 2 finishes its forward
  EXPECT_EQ(down->replica_status(1).replica(), 2);
  EXPECT_NE(down->replica_status(1).reason().find("scaled away"), std::string::npos);
  // Nothing new goes to replica 2 while it finishes.
  for (int i = 0; i < 2; ++i) {
    const absl::StatusOr<ForwardTarget> next = scheduler_->NextForward(ready.id(), 0, absl::Now());
    ASSERT_TRUE(next.ok()) << next.status();
    EXPECT_EQ(next->replica, 0);
    scheduler_->EndForward(ready.id(), next->replica, next->generation);
  }
  scheduler_->EndForward(ready.id(), on_two.replica, on_two.generation);
  const v1::Job one = *scheduler_->GetJob(ready.id());
  ASSERT_EQ(one.replica_status_size(), 1) << one.DebugString();
  EXPECT_EQ(one.ranks_size(), 1);
  EXPECT_EQ(one.state(), v1::READY);
  const std::string key1 = ReplicaKey(ready.id(), 1), key2 = ReplicaKey(ready.id(), 2);
  int unloaded = 0;
  for (FakeWorker* w : {&a, &b, &c}) {
    for (const std::string& key : LoadedKeys({w})) {
      if (key == key1 || key == key2) unloaded += w->WaitForUnload(key) ? 1 : 0;
    }
  }
  EXPECT_EQ(unloaded, 2);
}

// Shrinking keeps what serves: with replica 0 waiting for a worker after a loss and replica 1
// serving, scaling to 1 takes replica 0 away, and the job serves on, on replica 1 (its index kept).
TEST_F(ReplicasTest, ScalingDownTakesAwayAReplicaThatDoesNotServeFirst) {
  FakeWorker a, b;
  Register(a);
  Register(b);
  const v1::Job ready = Settled(Submit(1, 2).id(), true);
  ASSERT_EQ(ready.state(), v1::READY);
  ASSERT_TRUE(Leave(ready.replica_status(0).ranks(0).worker_id()));
  ASSERT_EQ(scheduler_->GetJob(ready.id())->replica_status(0).state(), v1::PENDING);
  const absl::StatusOr<v1::Job> one = scheduler_->ScaleJob(ready.id(), 1);
  ASSERT_TRUE(one.ok()) << one.status();
  ASSERT_EQ(one->replica_status_size(), 1) << one->DebugString();
  EXPECT_EQ(one->replica_status(0).replica(), 1);
  EXPECT_EQ(one->replica_status(0).state(), v1::READY);
  EXPECT_EQ(one->state(), v1::READY);
  EXPECT_EQ(one->degraded(), "");  // the lost one is gone, not recovering
  const absl::StatusOr<ForwardTarget> next = scheduler_->NextForward(ready.id(), 0, absl::Now());
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(next->replica, 1);
  scheduler_->EndForward(ready.id(), next->replica, next->generation);
  // Growing again takes the lowest free index.
  FakeWorker c;
  Register(c);
  ASSERT_TRUE(scheduler_->ScaleJob(ready.id(), 2).ok());
  const v1::Job two = Settled(ready.id(), true);
  ASSERT_EQ(two.replica_status_size(), 2) << two.DebugString();
  EXPECT_EQ(two.replica_status(0).replica(), 0);
  EXPECT_EQ(two.replica_status(0).state(), v1::READY) << two.DebugString();
}

// A replica past --max_restarts (its worker fails every load) does not end a job that serves on
// another replica: it keeps trying, every --restart_backoff_max, and Job.degraded says so.
TEST_F(ReplicasTest, AReplicaPastMaxRestartsKeepsTryingWhileAnotherServes) {
  FakeWorker good, bad(grpc::Status(grpc::StatusCode::INTERNAL, "the disk is on fire"));
  Register(good);
  Register(bad);
  const v1::Job job = Submit(1, 2);
  // Both replicas take turns on `bad` until one is on `good`; the other then fails on `bad` 3 times
  // in a row (max_restarts 2, no backoff here) and waits backoff_max.
  v1::Job seen;
  for (int i = 0; i < 10000; ++i) {
    seen = *scheduler_->GetJob(job.id());
    if (seen.degraded().find("past --max_restarts=2") != std::string::npos || seen.state() == v1::FAILED) break;
    absl::SleepFor(absl::Milliseconds(1));  // polling for the state, bounded: 10 s
  }
  EXPECT_EQ(seen.state(), v1::READY) << seen.DebugString();
  EXPECT_NE(seen.degraded().find("the disk is on fire (restart 3, past --max_restarts=2; again every 1m"),
            std::string::npos)
      << seen.DebugString();
  const absl::StatusOr<ForwardTarget> next = scheduler_->NextForward(job.id(), 0, absl::Now());
  ASSERT_TRUE(next.ok()) << next.status();  // the good replica serves
  EXPECT_EQ(next->ranks[0].address, good.Address());
}

// Counts outside 1..--max_replicas, and scaling a job that is not READY or has ended, are refused
// with the rule; nothing changes.
TEST_F(ReplicasTest, BadCountsAndJobsThatCannotScaleAreRefused) {
  options_.max_replicas = 3;
  Start();
  for (int replicas : {-1, 4}) {
    v1::SubmitJobRequest submit;
    submit.mutable_request()->set_checkpoint(checkpoint_);
    submit.set_replicas(replicas);
    const absl::StatusOr<v1::Job> refused = scheduler_->SubmitJob(submit, "test");
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << replicas;
    EXPECT_NE(refused.status().message().find("replicas must be 1..3"), std::string::npos) << refused.status();
  }
  const v1::Job pending = Submit(1);
  ASSERT_EQ(pending.state(), v1::PENDING);
  EXPECT_EQ(scheduler_->ScaleJob(pending.id(), 2).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(scheduler_->ScaleJob(pending.id(), 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(scheduler_->ScaleJob("job-nope", 2).status().code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(scheduler_->CancelJob(pending.id()).ok());
  EXPECT_EQ(scheduler_->ScaleJob(pending.id(), 2).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(scheduler_->GetJob(pending.id())->replicas(), 1);
  // fail_if_no_workers counts every replica's workers.
  FakeWorker a;
  Register(a);
  v1::SubmitJobRequest now;
  now.mutable_request()->set_checkpoint(checkpoint_);
  now.set_replicas(2);
  now.set_fail_if_no_workers(true);
  const absl::StatusOr<v1::Job> short_of_workers = scheduler_->SubmitJob(now, "test");
  EXPECT_EQ(short_of_workers.status().code(), absl::StatusCode::kFailedPrecondition) << short_of_workers.status();
  EXPECT_NE(short_of_workers.status().message().find("2 replicas of 1 ranks"), std::string::npos)
      << short_of_workers.status();
}

// A restarted coordinator takes back each replica whose ranks come back, and places again the
// others; the stored replica count holds.
TEST_F(ReplicasTest, ARestartTakesBackEachReplicaOnItsOwn) {
  store_path_ = std::string(testing::TempDir()) + "/replicas_restart.db";
  std::filesystem::remove(store_path_);
  options_.readopt_grace = absl::Hours(1);  // only the workers' own reports decide
  Start();
  FakeWorker a, b, spare;
  const std::string a_id = Register(a);
  Register(b);
  const v1::Job ready = Settled(Submit(1, 2).id(), true);
  ASSERT_EQ(ready.state(), v1::READY);
  std::string a_key, b_key;
  for (const v1::ReplicaStatus& r : ready.replica_status()) {
    (WorkersOf(r).count(a_id) > 0 ? a_key : b_key) = ReplicaKey(ready.id(), r.replica());
  }
  Start();  // the coordinator restarts; the store stays
  const v1::Job waiting = *scheduler_->GetJob(ready.id());
  EXPECT_EQ(waiting.replicas(), 2);
  EXPECT_NE(waiting.recovering(), "");
  // a comes back with its shard, b without (its replica is lost and placed again, on b or the spare).
  v1::RegisterWorkerRequest back;
  back.set_address(a.Address());
  v1::HeldShard* held = back.add_held();
  held->set_job_id(a_key);
  held->set_rank(0);
  held->set_world_size(1);
  held->set_next_sequence(5);
  scheduler_->RegisterWorker(back);
  Register(b);
  Register(spare);
  const v1::Job settled = Settled(ready.id(), true);
  ASSERT_EQ(settled.state(), v1::READY) << settled.DebugString();
  EXPECT_EQ(settled.recovering(), "");
  ASSERT_EQ(settled.replica_status_size(), 2);
  for (const v1::ReplicaStatus& r : settled.replica_status()) EXPECT_EQ(r.state(), v1::READY) << settled.DebugString();
  // a's replica numbers on from where it was; the other loaded afresh.
  const ReplicaOf adopted = ParseReplicaKey(a_key);
  bool numbered_on = false;
  for (int i = 0; i < 2; ++i) {
    const absl::StatusOr<ForwardTarget> next = scheduler_->NextForward(ready.id(), 0, absl::Now());
    ASSERT_TRUE(next.ok()) << next.status();
    if (next->replica == adopted.replica) {
      EXPECT_EQ(next->sequence, 5);
      numbered_on = true;
    } else {
      EXPECT_EQ(next->sequence, 0);
    }
  }
  EXPECT_TRUE(numbered_on) << settled.DebugString() << " adopted " << a_key;
  EXPECT_EQ(a.Loads().size(), 1u);  // taken back, not loaded again
}

// A job with bounds 1..2 (autoscale.h's rule, with short windows here): a replica held busy past
// up_after gets company once an idle worker can hold it; idle past down_after, the job goes back
// to one replica. Bad bounds are refused, and a count by hand ends the autoscaling.
TEST_F(ReplicasTest, AJobWithBoundsScalesByItsReplicasUtilisation) {
  options_.autoscale = {0.7, absl::Milliseconds(300), absl::Milliseconds(600)};
  Start();
  FakeWorker a, b;
  Register(a);
  Register(b);
  v1::SubmitJobRequest submit;
  submit.mutable_request()->set_checkpoint(checkpoint_);
  submit.set_min_replicas(1);
  submit.set_max_replicas(2);
  absl::StatusOr<v1::Job> job = scheduler_->SubmitJob(submit, "test");
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->replicas(), 1);  // starts at min
  EXPECT_EQ(job->max_replicas(), 2);
  ASSERT_EQ(Settled(job->id(), true).state(), v1::READY);
  // One forward held: the replica is busy all the time.
  const absl::StatusOr<ForwardTarget> held = scheduler_->NextForward(job->id(), 0, absl::Now());
  ASSERT_TRUE(held.ok()) << held.status();
  const auto replicas_become = [&](int n) {
    const absl::Time end = absl::Now() + absl::Seconds(20);
    while (absl::Now() < end) {
      const v1::Job now = *scheduler_->GetJob(job->id());
      if (now.replicas() == n) return now;
      absl::SleepFor(absl::Milliseconds(20));
    }
    return *scheduler_->GetJob(job->id());
  };
  const v1::Job up = replicas_become(2);
  EXPECT_EQ(up.replicas(), 2) << up.DebugString();
  scheduler_->EndForward(job->id(), held->replica, held->generation);
  ASSERT_EQ(Settled(job->id(), true).replica_status_size(), 2);
  const v1::Job down = replicas_become(1);
  EXPECT_EQ(down.replicas(), 1) << down.DebugString();
  EXPECT_EQ(down.min_replicas(), 1);
  // Bad bounds; a count by hand ends the autoscaling.
  EXPECT_EQ(scheduler_->ScaleJob(job->id(), 0, 2, 1).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(scheduler_->ScaleJob(job->id(), 3, 1, 2).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(scheduler_->ScaleJob(job->id(), 0, 1, 99).status().code(), absl::StatusCode::kInvalidArgument);
  submit.set_min_replicas(2);
  submit.set_max_replicas(0);
  EXPECT_EQ(scheduler_->SubmitJob(submit, "test").status().code(), absl::StatusCode::kInvalidArgument);
  const absl::StatusOr<v1::Job> by_hand = scheduler_->ScaleJob(job->id(), 1);
  ASSERT_TRUE(by_hand.ok()) << by_hand.status();
  EXPECT_EQ(by_hand->max_replicas(), 0);
  EXPECT_EQ(by_hand->utilisation(), 0);
}

// An autoscaled job's replica that finds no workers for down_after is given up (down to min),
// instead of freezing the job's scaling while it waits.
TEST_F(ReplicasTest, AnAutoscaledReplicaThatFindsNoWorkersIsGivenUp) {
  options_.autoscale = {0.7, absl::Milliseconds(300), absl::Milliseconds(600)};
  Start();
  FakeWorker a;
  Register(a);
  const v1::Job ready = Settled(Submit(1).id());
  const absl::StatusOr<v1::Job> two = scheduler_->ScaleJob(ready.id(), 2, 1, 2);  // one worker only
  ASSERT_TRUE(two.ok()) << two.status();
  ASSERT_EQ(two->replicas(), 2);
  v1::Job job;
  const absl::Time end = absl::Now() + absl::Seconds(20);
  while ((job = *scheduler_->GetJob(ready.id())).replicas() != 1 && absl::Now() < end) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_EQ(job.replicas(), 1) << job.DebugString();
  EXPECT_EQ(job.replica_status_size(), 1) << job.DebugString();
  EXPECT_EQ(job.max_replicas(), 2);
}

}  // namespace
}  // namespace bertshard::server
