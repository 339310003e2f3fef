// Replicas end to end (issue 22) on a coordinator and four shard-worker processes on loopback: a
// TP 1 job with two replicas under eight closed-loop clients checking every answer against the
// reference. SIGKILL the worker of one replica: the other answers every request (no client error
// at all), and the lost replica is READY again on a spare. Scale 1 -> 3 -> 1 under the same load:
// the new replicas take forwards once READY, the ones taken away finish theirs, no request fails.
// Prints the failover and scaling times (a loaded, shared machine: no bound asserted on speed).
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>

#include "absl/time/clock.h"
#include "bertshard/v1/coordinator.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/closed_loop_clients.h"
#include "tests/cluster_fixture.h"

namespace bertshard {
namespace {

using testing::ClosedLoopClients;
using testing::Cluster;
using testing::Context;
using testing::ExpectNoFailure;
using testing::kModel;
using testing::ReadAll;

class Replicas : public Cluster {
 protected:
  v1::Job SubmitReplicas(int replicas) {
    v1::SubmitJobRequest submit;
    submit.mutable_request()->set_checkpoint(std::filesystem::absolute(kModel).string());
    submit.set_replicas(replicas);
    v1::Job job;
    const grpc::Status s = stub_->SubmitJob(Context().get(), submit, &job);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return job;
  }
  static int ReadyReplicas(const v1::Job& job) {
    int ready = 0;
    for (const v1::ReplicaStatus& r : job.replica_status()) ready += r.state() == v1::READY ? 1 : 0;
    return ready;
  }
};

TEST_F(Replicas, ALostReplicaFailsNoRequestAndComesBackOnASpare) {
  const v1::Job job = SubmitReplicas(2);
  const v1::Job ready = WatchAllReplicas(job.id());
  ASSERT_EQ(ReadyReplicas(ready), 2) << ready.DebugString();
  constexpr int kClients = 8;
  std::unique_ptr<ClosedLoopClients> clients = ReferenceClients(job.id(), kClients);
  ASSERT_TRUE(clients->WaitAnswers(4 * kClients)) << "the clients are not being answered";
  // The worker of replica 1 (known to the workers by the replica's key).
  std::string victim_id;
  const int victim = WorkerServing(job.id() + "/replica-1", 0, &victim_id);
  ASSERT_GE(victim, 0);
  KillWorker(victim);
  const absl::Time killed = clients->Mark();
  // Seen lost (it may be back already: its count of losses stays).
  v1::Job lost;
  for (int i = 0; i < 1000 && lost.restarts() == 0; ++i) {
    lost = GetJob(job.id());
    if (lost.restarts() == 0) usleep(20 * 1000);
  }
  ASSERT_EQ(lost.restarts(), 1) << lost.DebugString();
  EXPECT_EQ(lost.state(), v1::READY) << lost.DebugString();
  if (!lost.degraded().empty()) {
    EXPECT_EQ(lost.degraded().rfind("replica 1: lost worker " + victim_id, 0), 0u) << lost.DebugString();
  }
  // The job never left READY: the lost replica's story is in its status and Job.degraded only.
  const v1::Job back = WatchAllReplicas(job.id());
  const absl::Time ready_again = absl::Now();
  ASSERT_EQ(back.state(), v1::READY) << back.DebugString();
  ASSERT_EQ(ReadyReplicas(back), 2) << back.DebugString();
  EXPECT_EQ(back.degraded(), "");
  for (const auto& r : back.ranks()) EXPECT_NE(r.worker_id(), victim_id);
  bool served = false;  // from its first READY on, never anything else
  for (const v1::StateChange& change : back.history()) {
    if (served) {
      EXPECT_EQ(change.state(), v1::READY) << "the job stopped serving: " << back.DebugString();
    }
    served |= change.state() == v1::READY;
  }
  ASSERT_TRUE(clients->WaitAnswers(clients->answered() + 4 * kClients)) << "no answers after the replica came back";
  clients->Stop();
  ExpectNoFailure(*clients);
  std::printf(
      "failover: 2 replicas of TP 1, SIGKILL of replica 1's worker, %d clients: first answer after the kill %.3f s, "
      "lost replica READY again %.2f s, %zu client errors\n",
      kClients, absl::ToDoubleSeconds(clients->first_answer_after() - killed),
      absl::ToDoubleSeconds(ready_again - killed), clients->failures().size());
}

TEST_F(Replicas, ScalingOneToThreeToOneUnderLoadFailsNoRequest) {
  const v1::Job job = SubmitReplicas(1);
  ASSERT_EQ(WatchAllReplicas(job.id()).state(), v1::READY);
  constexpr int kClients = 8;
  std::unique_ptr<ClosedLoopClients> clients = ReferenceClients(job.id(), kClients);
  ASSERT_TRUE(clients->WaitAnswers(2 * kClients));
  v1::ScaleJobRequest scale;
  scale.set_job_id(job.id());
  scale.set_replicas(3);
  v1::Job scaled;
  const absl::Time up = absl::Now();
  ASSERT_TRUE(stub_->ScaleJob(Context().get(), scale, &scaled).ok());
  EXPECT_EQ(scaled.replicas(), 3);
  const v1::Job three = WatchAllReplicas(job.id());
  const absl::Duration up_took = absl::Now() - up;
  ASSERT_EQ(ReadyReplicas(three), 3) << three.DebugString();
  // Every replica takes forwards under load.
  const int64_t before = clients->answered();
  ASSERT_TRUE(clients->WaitAnswers(before + 12 * kClients));
  const v1::Job busy = GetJob(job.id());
  for (const v1::ReplicaStatus& r : busy.replica_status()) EXPECT_GT(r.forwards(), 0) << busy.DebugString();
  scale.set_replicas(1);
  const absl::Time down = absl::Now();
  ASSERT_TRUE(stub_->ScaleJob(Context().get(), scale, &scaled).ok());
  EXPECT_EQ(scaled.replicas(), 1);
  // The two taken away finish their forwards, unload, and their workers are idle again.
  EXPECT_TRUE(WaitForWorkers(3)) << GetJob(job.id()).DebugString();
  const absl::Duration down_took = absl::Now() - down;
  const v1::Job one = GetJob(job.id());
  EXPECT_EQ(one.replica_status_size(), 1) << one.DebugString();
  EXPECT_EQ(one.ranks_size(), 1);
  ASSERT_TRUE(clients->WaitAnswers(clients->answered() + 4 * kClients));
  clients->Stop();
  ExpectNoFailure(*clients);
  std::printf(
      "scaling: TP 1 job, %d clients: 1 -> 3 replicas READY in %.2f s, 3 -> 1 and workers idle in %.2f s, "
      "%zu client errors\n",
      kClients, absl::ToDoubleSeconds(up_took), absl::ToDoubleSeconds(down_took), clients->failures().size());
}

// Item 5: a coordinator SIGKILLed under a 2-replica job, with one replica's worker killed while it
// is away, takes back the replica whose worker comes back with its shard (numbered on: the worker
// refuses a forward out of order) and places the other again on a spare; no FAILED in between.
TEST_F(Replicas, ACoordinatorKilledTakesBackOneReplicaAndPlacesTheOtherAgain) {
  const v1::Job job = SubmitReplicas(2);
  ASSERT_EQ(ReadyReplicas(WatchAllReplicas(job.id())), 2);
  for (int i = 0; i < 3; ++i) EXPECT_LE(InferDiff(job.id()), 1e-5f);
  // Where each replica's worker listens (a worker registering again keeps its address, not its id).
  const v1::Job before = GetJob(job.id());
  ASSERT_EQ(before.replica_status_size(), 2);
  const std::string kept_address = before.replica_status(0).ranks(0).worker_address();
  const std::string lost_address = before.replica_status(1).ranks(0).worker_address();
  std::string lost_id;
  const int lost = WorkerServing(job.id() + "/replica-1", 0, &lost_id);
  ASSERT_GE(lost, 0);
  stub_.reset();
  kill(coordinator_, SIGKILL);
  testing::WaitExit(coordinator_);
  coordinator_ = -1;
  KillWorker(lost);
  StartCoordinator();
  const v1::Job back = WatchAllReplicas(job.id());  // the grace period for replica 1, then placed again
  ASSERT_EQ(back.state(), v1::READY) << back.DebugString();
  ASSERT_EQ(ReadyReplicas(back), 2) << back.DebugString();
  for (const auto& change : back.history()) EXPECT_NE(change.state(), v1::FAILED) << change.reason();
  // Replica 0 taken back where it was, never lost; replica 1 placed again elsewhere.
  EXPECT_EQ(back.replica_status(0).ranks(0).worker_address(), kept_address) << back.DebugString();
  EXPECT_EQ(back.replica_status(0).restarts(), 0) << back.DebugString();
  EXPECT_NE(back.replica_status(1).ranks(0).worker_address(), lost_address) << back.DebugString();
  EXPECT_EQ(back.replica_status(1).restarts(), 1) << back.DebugString();
  for (int i = 0; i < 4; ++i) EXPECT_LE(InferDiff(job.id()), 1e-5f);  // both replicas answer, in order
  const v1::Job served = GetJob(job.id());
  for (const v1::ReplicaStatus& r : served.replica_status()) EXPECT_GT(r.forwards(), 0) << served.DebugString();
}

// Autoscaling (issue 22 item 3) on real workers: a job with bounds 1..2 under eight closed-loop
// clients gets its second replica once its one replica has been busy (past a target of 0.4) for
// --autoscale_up_after, fails
// no request meanwhile, and goes back to one replica once idle for --autoscale_down_after.
class AutoscaledReplicas : public Replicas {
 protected:
  void SetUp() override {
    // The test model's forward is tiny next to a request's round trip: eight closed-loop clients
    // keep its one replica ~0.6 busy (measured 0.58), under the default target of 0.7.
    coordinator_flags_ = {"--autoscale_target=0.4", "--autoscale_up_after=1s", "--autoscale_down_after=2s"};
    Replicas::SetUp();
  }
  // The job once it wants `n` replicas (or after 30 s).
  v1::Job WaitForReplicas(const std::string& id, int n) {
    v1::Job job;
    for (int i = 0; i < 1500 && (job = GetJob(id)).replicas() != n; ++i) usleep(20 * 1000);
    return job;
  }
};

TEST_F(AutoscaledReplicas, AJobWithBoundsGrowsUnderLoadAndShrinksWhenIdle) {
  v1::SubmitJobRequest submit;
  submit.mutable_request()->set_checkpoint(std::filesystem::absolute(kModel).string());
  submit.set_min_replicas(1);
  submit.set_max_replicas(2);
  v1::Job job;
  ASSERT_TRUE(stub_->SubmitJob(Context().get(), submit, &job).ok());
  ASSERT_EQ(ReadyReplicas(WatchAllReplicas(job.id())), 1);
  constexpr int kClients = 8;
  std::unique_ptr<ClosedLoopClients> clients = ReferenceClients(job.id(), kClients);
  const absl::Time loaded = absl::Now();
  const v1::Job grown = WaitForReplicas(job.id(), 2);
  const absl::Duration up = absl::Now() - loaded;
  ASSERT_EQ(grown.replicas(), 2) << grown.DebugString();
  ASSERT_EQ(ReadyReplicas(WatchAllReplicas(job.id())), 2);
  ASSERT_TRUE(clients->WaitAnswers(clients->answered() + 4 * kClients));
  clients->Stop();
  ExpectNoFailure(*clients);
  const absl::Time idle = absl::Now();
  const v1::Job shrunk = WaitForReplicas(job.id(), 1);
  EXPECT_EQ(shrunk.replicas(), 1) << shrunk.DebugString();
  EXPECT_TRUE(WaitForWorkers(3));
  std::printf(
      "autoscaling 1..2, %d clients: utilisation %.2f, 2 replicas wanted after %.2f s of load, back to 1 "
      "after %.2f s idle, %zu client errors\n",
      kClients, grown.utilisation(), absl::ToDoubleSeconds(up), absl::ToDoubleSeconds(absl::Now() - idle),
      clients->failures().size());
}

}  // namespace
}  // namespace bertshard
