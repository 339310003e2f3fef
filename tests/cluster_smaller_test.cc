// Smaller shapes end to end (issue 22, the coordinator's --smaller_shapes) on a coordinator and four
// shard-worker processes on loopback: a TP 2 x PP 2 job on all four under eight closed-loop clients
// checking every answer against the reference. SIGKILL the worker of its last rank: with no spare,
// the job serves as TP 2 x PP 1 on two of the three left (any error only UNAVAILABLE, only for a
// request sent before it served again); a new worker process: it grows back to TP 2 x PP 2, and no
// request fails for that. Each time the workers it kept read less than a full load (they keep the
// tensors they held). Prints the times and bytes (a loaded, shared machine: no bound on speed).
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <functional>
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
using testing::kModel;

class SmallerShapes : public Cluster {
 protected:
  SmallerShapes() { coordinator_flags_ = {"--smaller_shapes"}; }

  // Polls the job (up to 2 minutes) until `done` holds; the job as last seen.
  v1::Job PollUntil(const std::string& id, const std::function<bool(const v1::Job&)>& done) {
    v1::Job seen;
    for (int i = 0; i < 6000; ++i) {
      seen = GetJob(id);
      if (done(seen) || seen.state() == v1::FAILED || seen.state() == v1::CANCELLED) return seen;
      usleep(20 * 1000);
    }
    return seen;
  }
};

TEST_F(SmallerShapes, AJobWithNoSpareServesSmallerAndGrowsBackWithoutAWrongAnswer) {
  const v1::Job job = Submit(kModel);  // TP 2 x PP 2: every worker
  const v1::Job first = WatchAllReplicas(job.id());
  ASSERT_EQ(first.state(), v1::READY);
  const int64_t full_read = first.replica_status(0).load_bytes_read();  // a load that keeps nothing
  EXPECT_EQ(first.replica_status(0).load_bytes_kept(), 0);
  EXPECT_GT(full_read, 0);
  constexpr int kClients = 8;
  std::unique_ptr<ClosedLoopClients> clients = ReferenceClients(job.id(), kClients);
  ASSERT_TRUE(clients->WaitAnswers(4 * kClients)) << "the clients are not being answered";

  const std::string victim = KillWorkerServing(job.id(), 3);
  ASSERT_NE(victim, "");
  const absl::Time killed = clients->Mark();
  const v1::Job smaller = PollUntil(job.id(), [](const v1::Job& j) {
    return j.state() == v1::READY && j.replica_status_size() == 1 && !j.replica_status(0).smaller_shape().empty();
  });
  const absl::Time smaller_ready = absl::Now();
  ASSERT_EQ(smaller.state(), v1::READY) << smaller.DebugString() << Logs();
  EXPECT_EQ(smaller.replica_status(0).smaller_shape(),
            "TP 2 x PP 1, FP32, " + std::filesystem::absolute(kModel).string());
  EXPECT_EQ(smaller.ranks_size(), 2);
  for (const auto& r : smaller.ranks()) EXPECT_NE(r.worker_id(), victim);
  EXPECT_NE(smaller.degraded().find("serves in a smaller shape (TP 2 x PP 1"), std::string::npos) << smaller.degraded();
  EXPECT_NE(smaller.degraded().find("lost worker " + victim), std::string::npos) << smaller.degraded();
  // The workers it kept took what they held of their new ranks: less was read than a full load.
  const v1::ReplicaStatus& folded = smaller.replica_status(0);
  EXPECT_GT(folded.load_bytes_kept(), 0);
  EXPECT_LT(folded.load_bytes_read(), full_read);
  // The smaller shape answers (each answer checked).
  ASSERT_TRUE(clients->WaitAnswers(clients->answered() + 4 * kClients)) << "no answers in the smaller shape";
  const absl::Time first_answer = clients->first_answer_after();

  // A worker joins: the job grows back on its three and the new one.
  const absl::Time joined = clients->Mark();
  LaunchWorker();
  const v1::Job back = PollUntil(job.id(), [](const v1::Job& j) {
    return j.state() == v1::READY && j.replica_status_size() == 1 && j.replica_status(0).smaller_shape().empty() &&
           j.ranks_size() == 4;
  });
  const absl::Time back_ready = absl::Now();
  ASSERT_EQ(back.state(), v1::READY) << back.DebugString() << Logs();
  EXPECT_EQ(back.ranks_size(), 4);
  EXPECT_EQ(back.degraded(), "");
  const v1::ReplicaStatus& grown = back.replica_status(0);
  EXPECT_GT(grown.load_bytes_kept(), 0);
  EXPECT_LT(grown.load_bytes_read(), full_read);
  ASSERT_TRUE(clients->WaitAnswers(clients->answered() + 4 * kClients)) << "no answers after growing back";
  clients->Stop();

  EXPECT_EQ(clients->wrong(), 0);
  int gap_errors = 0;
  for (const ClosedLoopClients::Failure& f : clients->failures()) {
    EXPECT_EQ(f.code, grpc::StatusCode::UNAVAILABLE) << f.message;
    EXPECT_LT(f.sent, smaller_ready) << "failed after the smaller shape served: " << f.message;
    ++gap_errors;
  }
  std::printf(
      "smaller shape: TP 2 x PP 2 on 4 workers, SIGKILL of rank 3's, no spare, %d clients: TP 2 x PP 1 READY %.2f s "
      "after the kill, first answer %.2f s after it, %d client errors (UNAVAILABLE); grown back to TP 2 x PP 2 "
      "%.2f s after a worker joined; checkpoint bytes read: full load %lld, TP 2 x PP 1 %lld (kept %lld), grown back "
      "%lld (kept %lld)\n",
      kClients, absl::ToDoubleSeconds(smaller_ready - killed), absl::ToDoubleSeconds(first_answer - killed), gap_errors,
      absl::ToDoubleSeconds(back_ready - joined), static_cast<long long>(full_read),
      static_cast<long long>(folded.load_bytes_read()), static_cast<long long>(folded.load_bytes_kept()),
      static_cast<long long>(grown.load_bytes_read()), static_cast<long long>(grown.load_bytes_kept()));
}

}  // namespace
}  // namespace bertshard
