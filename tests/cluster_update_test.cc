// Live updates end to end (issue 22 item 4) on a coordinator and four shard-worker processes on
// loopback, under eight closed-loop clients checking every answer:
//   - TP 2 -> TP 1 x PP 2 of the same checkpoint: every answer equals the reference, none fails,
//     and the old shape's workers are idle again once it has drained;
//   - a 2-replica job moved to another checkpoint (a new model version): every answer is wholly the
//     old model's or wholly the new one's, none fails, and once switched every answer is the new;
//   - a shape the checkpoint cannot take is INVALID_ARGUMENT and the old shape serves on.
// Prints the time to switch and the latency p50/p99 before and during the update (a loaded, shared
// machine: no bound asserted on speed).
#include <atomic>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

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

class Update : public Cluster {
 protected:
  v1::Job SubmitShape(const std::string& checkpoint, int tp, int pp, int replicas) {
    v1::SubmitJobRequest submit;
    submit.mutable_request()->set_checkpoint(std::filesystem::absolute(checkpoint).string());
    submit.mutable_request()->mutable_parallel()->set_tp_size(tp);
    submit.mutable_request()->mutable_parallel()->set_pp_size(pp);
    submit.set_replicas(replicas);
    v1::Job job;
    const grpc::Status s = stub_->SubmitJob(Context().get(), submit, &job);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return job;
  }
  grpc::Status UpdateTo(const v1::Job& job, const std::string& checkpoint, int tp, int pp, v1::Job* updated) {
    v1::UpdateJobRequest update;
    update.set_job_id(job.id());
    *update.mutable_request() = job.request();
    update.mutable_request()->set_checkpoint(std::filesystem::absolute(checkpoint).string());
    update.mutable_request()->mutable_parallel()->set_tp_size(tp);
    update.mutable_request()->mutable_parallel()->set_pp_size(pp);
    return stub_->UpdateJob(Context().get(), update, updated);
  }
  // The logits of one Infer of `job`; empty when it failed.
  std::vector<float> Logits(const std::string& job) {
    v1::InferRequest infer;
    infer.set_job_id(job);
    *infer.mutable_tokens() = Tokens();
    v1::InferResponse response;
    const grpc::Status status = stub_->Infer(Context().get(), infer, &response);
    EXPECT_TRUE(status.ok()) << status.error_message();
    if (!status.ok() || response.outputs_size() != 1) return {};
    return {response.outputs(0).values().begin(), response.outputs(0).values().end()};
  }
  static void PrintLatency(const char* what, const ClosedLoopClients& clients, absl::Time from, absl::Time to) {
    std::printf("%s: p50 %.1f ms, p99 %.1f ms\n", what, absl::ToDoubleMilliseconds(clients.Latency(0.5, from, to)),
                absl::ToDoubleMilliseconds(clients.Latency(0.99, from, to)));
  }
};

TEST_F(Update, Tp2ToTp1Pp2UnderLoadFailsNoRequest) {
  const v1::Job job = SubmitShape(kModel, 2, 1, 1);
  ASSERT_EQ(WatchAllReplicas(job.id()).state(), v1::READY);
  constexpr int kClients = 8;
  auto clients = ReferenceClients(job.id(), kClients);
  const absl::Time start = absl::Now();
  ASSERT_TRUE(clients->WaitAnswers(4 * kClients));
  // Refused, and nothing changes: 4 heads do not split over 3 ranks.
  v1::Job refused;
  EXPECT_EQ(UpdateTo(job, kModel, 3, 1, &refused).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_FALSE(GetJob(job.id()).has_update());
  const absl::Time updating = absl::Now();
  v1::Job updated;
  const grpc::Status accepted = UpdateTo(job, kModel, 1, 2, &updated);
  ASSERT_TRUE(accepted.ok()) << accepted.error_message();
  EXPECT_EQ(updated.update().version(), 1);
  const v1::Job done = WatchAllReplicas(job.id());
  const absl::Time switched = absl::Now();
  EXPECT_EQ(done.state(), v1::READY);
  EXPECT_EQ(done.version(), 1) << done.DebugString();
  EXPECT_EQ(done.request().parallel().tp_size(), 1);
  EXPECT_EQ(done.request().parallel().pp_size(), 2);
  // The old shape drains and its two workers are idle again.
  EXPECT_TRUE(WaitForWorkers(2)) << GetJob(job.id()).DebugString();
  const v1::Job after = GetJob(job.id());
  EXPECT_EQ(after.ranks_size(), 2);
  ASSERT_EQ(after.replica_status_size(), 1) << after.DebugString();
  EXPECT_EQ(after.replica_status(0).version(), 1);
  const absl::Time drained = absl::Now();
  ASSERT_TRUE(clients->WaitAnswers(clients->answered() + 4 * kClients)) << "no answers from the new shape";
  clients->Stop();
  ExpectNoFailure(*clients);
  std::printf(
      "live update TP 2 -> TP 1 x PP 2, %d clients: switched after %.2f s, old shape unloaded after %.2f s, "
      "%zu client errors\n",
      kClients, absl::ToDoubleSeconds(switched - updating), absl::ToDoubleSeconds(drained - updating),
      clients->failures().size());
  PrintLatency("latency before the update", *clients, start, updating);
  PrintLatency("latency during the update", *clients, updating, drained);
}

TEST_F(Update, ToAnotherCheckpointEachAnswerIsWhollyTheOldModelsOrTheNew) {
  // The new model version: the same architecture and sizes, other weights.
  const std::string v2 = std::filesystem::absolute(testing::TempDir() + "/masked_lm_v2").string();
  const testing::Cli init = testing::Shardctl({"init-checkpoint", "--variant", "BertForMaskedLM", "--seed", "11",
                                               "--config", std::string(kModel) + "/config.json", "--out", v2});
  ASSERT_EQ(init.exit_code, 0) << init.all();
  // Its answer, from a job of its own (the service's answers match HF's elsewhere).
  const v1::Job probe = SubmitShape(v2, 1, 1, 1);
  ASSERT_EQ(WatchAllReplicas(probe.id()).state(), v1::READY);
  const std::vector<float> new_logits = Logits(probe.id());
  ASSERT_FALSE(new_logits.empty());
  v1::GetJobRequest cancel;
  cancel.set_job_id(probe.id());
  v1::Job cancelled;
  ASSERT_TRUE(stub_->CancelJob(Context().get(), cancel, &cancelled).ok());
  ASSERT_TRUE(WaitForWorkers(4));
  const std::vector<float> old_logits = Expected();
  float apart = 0;
  for (size_t i = 0; i < old_logits.size() && i < new_logits.size(); ++i) {
    apart = std::max(apart, std::fabs(old_logits[i] - new_logits[i]));
  }
  ASSERT_GT(apart, 1e-2f) << "the two versions must answer differently";

  const v1::Job job = SubmitShape(kModel, 1, 1, 2);
  ASSERT_EQ(WatchAllReplicas(job.id()).state(), v1::READY);
  std::atomic<int> old_answers{0}, new_answers{0}, new_after_switch{0}, old_after_switch{0};
  std::atomic<bool> switched_seen{false};
  constexpr int kClients = 8;
  auto clients = std::make_unique<ClosedLoopClients>(kClients, [&, id = job.id()] {
    const bool after_switch = switched_seen.load();
    v1::InferRequest infer;
    infer.set_job_id(id);
    *infer.mutable_tokens() = Tokens();
    v1::InferResponse response;
    const grpc::Status status = stub_->Infer(Context(60).get(), infer, &response);
    bool is_old = false, is_new = false;
    if (status.ok() && response.outputs_size() == 1) {
      std::vector<float> got(response.outputs(0).values().begin(), response.outputs(0).values().end());
      is_old = got.size() == old_logits.size() && MaxDiff(response.outputs(0), old_logits) <= 1e-5f;
      is_new = got.size() == new_logits.size() && MaxDiff(response.outputs(0), new_logits) <= 1e-5f;
    }
    (is_old ? old_answers : new_answers) += (is_old || is_new) ? 1 : 0;
    if (after_switch) (is_old ? old_after_switch : new_after_switch) += (is_old || is_new) ? 1 : 0;
    return ClosedLoopClients::Outcome{status, is_old || is_new};
  });
  ASSERT_TRUE(clients->WaitAnswers(4 * kClients));
  const absl::Time updating = absl::Now();
  v1::Job updated;
  const grpc::Status accepted = UpdateTo(job, v2, 1, 1, &updated);
  ASSERT_TRUE(accepted.ok()) << accepted.error_message();
  const v1::Job done = WatchAllReplicas(job.id());
  const absl::Time switched = absl::Now();
  // Requests sent from now on come after the switch, while the old shape may still drain: none of
  // them may reach it.
  switched_seen = true;
  EXPECT_EQ(done.version(), 1) << done.DebugString();
  EXPECT_EQ(done.request().checkpoint(), v2);
  EXPECT_TRUE(WaitForWorkers(2)) << GetJob(job.id()).DebugString();
  ASSERT_TRUE(clients->WaitAnswers(clients->answered() + 4 * kClients));
  clients->Stop();
  ExpectNoFailure(*clients);
  EXPECT_GT(new_after_switch.load(), 0);
  EXPECT_EQ(old_after_switch.load(), 0) << "the old model answered after the switch";
  std::printf(
      "live update to another checkpoint, 2 replicas, %d clients: switched after %.2f s; %d answers of the "
      "old model, %d of the new, %zu client errors\n",
      kClients, absl::ToDoubleSeconds(switched - updating), old_answers.load(), new_answers.load(),
      clients->failures().size());
  PrintLatency("latency during the update", *clients, updating, switched);
}

}  // namespace
}  // namespace bertshard
