// Requests through the service end to end (tests/behaviour_cluster.h: a coordinator and four
// shard-worker processes on loopback, fresh per test): text pairs and multiple choice against
// references, and WatchJob's errors (unknown job, deadline, watchers going away) leaving the
// coordinator serving and stopping promptly.
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <string>
#include <vector>

#include "bertshard/v1/coordinator.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/behaviour_cluster.h"
#include "tests/cluster_fixture.h"
#include "tests/test_process.h"

namespace bertshard {
namespace {

using testing::BehaviourCluster;
using testing::CancelledMessage;
using testing::Cli;
using testing::Context;
using testing::DeadlineMessage;
using testing::FindOutput;
using testing::kBertModel;
using testing::kModel;
using testing::kMultipleChoice;
using testing::ReadAll;
using testing::ReadTensor;
using testing::Shape;
using testing::Shardctl;
using testing::TempDir;

// 6. Text pairs and multiple choice through the service, two jobs side by side. Pairs: [CLS] a
// [SEP] b [SEP] with token types 1 on the second segment, and the outputs equal an unsharded run
// (`shardctl run --local`, one rank) of the tokens the service reports. Multiple choice: tokens
// with `choices`, logits [batch, choices] equal to the checked-in reference, one prediction per
// choice group; text input is refused.
TEST_F(BehaviourCluster, TextPairsAndMultipleChoiceThroughTheService) {
  const std::string text_model = testing::CheckpointWithWordVocabulary(kBertModel, "pairs_model");
  const v1::Job pairs_job = Submit(text_model, 1, 2);
  const v1::Job choice_job = Submit(kMultipleChoice, 2, 1);
  ASSERT_EQ(Watch(pairs_job.id()).job().state(), v1::READY);
  ASSERT_EQ(Watch(choice_job.id()).job().state(), v1::READY);

  v1::InferRequest infer;
  infer.set_job_id(pairs_job.id());
  infer.mutable_text()->add_texts("w7 w8");
  infer.mutable_text()->add_text_pairs("w10 w11 w12");
  infer.mutable_text()->add_texts("w9");
  infer.mutable_text()->add_text_pairs("w13");
  v1::InferResponse response;
  grpc::Status s = stub_->Infer(Context().get(), infer, &response);
  ASSERT_TRUE(s.ok()) << s.error_message();
  const v1::TokenInputs& t = response.tokens();
  EXPECT_EQ(t.rows(), 2);
  EXPECT_EQ(t.seq(), 8);
  EXPECT_EQ(std::vector<int64_t>(t.input_ids().begin(), t.input_ids().end()),
            (std::vector<int64_t>{2, 7, 8, 3, 10, 11, 12, 3, 2, 9, 3, 13, 3, 0, 0, 0}));
  EXPECT_EQ(std::vector<int64_t>(t.token_type_ids().begin(), t.token_type_ids().end()),
            (std::vector<int64_t>{0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 1, 1, 0, 0, 0}));
  EXPECT_EQ(std::vector<int64_t>(t.attention_mask().begin(), t.attention_mask().end()),
            (std::vector<int64_t>{1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0}));
  const v1::NamedTensor* hidden = FindOutput(response, "last_hidden_state");
  const v1::NamedTensor* pooled = FindOutput(response, "pooler_output");
  ASSERT_NE(hidden, nullptr);
  ASSERT_NE(pooled, nullptr);
  EXPECT_EQ(Shape(*hidden), (std::vector<int64_t>{2, 8, 32}));
  EXPECT_EQ(Shape(*pooled), (std::vector<int64_t>{2, 32}));
  // The unsharded reference on the same tokens.
  const std::string input = TempDir() + "/pairs_input.json";
  {
    std::ofstream json(input);
    const auto rows = [&](const google::protobuf::RepeatedField<int64_t>& v) {
      std::string out = "[";
      for (int64_t r = 0; r < t.rows(); ++r) {
        out += r == 0 ? "[" : ", [";
        for (int64_t i = 0; i < t.seq(); ++i) {
          out += (i == 0 ? "" : ", ") + std::to_string(v[static_cast<int>(r * t.seq() + i)]);
        }
        out += "]";
      }
      return out + "]";
    };
    json << "{\"input_ids\": " << rows(t.input_ids()) << ", \"attention_mask\": " << rows(t.attention_mask())
         << ", \"token_type_ids\": " << rows(t.token_type_ids()) << "}";
  }
  const std::string reference = TempDir() + "/pairs_reference.safetensors";
  const Cli run = Shardctl({"run", "--local", "--checkpoint", text_model, "--input", input, "--output", reference});
  ASSERT_EQ(run.exit_code, 0) << run.output;
  const auto want_hidden = ReadTensor(reference, "last_hidden_state");
  const auto want_pooled = ReadTensor(reference, "pooler_output");
  EXPECT_EQ(want_hidden.first, Shape(*hidden));
  EXPECT_LE(MaxDiff(*hidden, want_hidden.second), 1e-5f);
  EXPECT_LE(MaxDiff(*pooled, want_pooled.second), 1e-5f);
  // The segments matter: the same tokens as one segment give other hidden states.
  v1::InferRequest one_segment;
  one_segment.set_job_id(pairs_job.id());
  *one_segment.mutable_tokens() = t;
  one_segment.mutable_tokens()->mutable_token_type_ids()->Clear();
  v1::InferResponse flat;
  s = stub_->Infer(Context().get(), one_segment, &flat);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_GT(MaxDiff(*FindOutput(flat, "last_hidden_state"), want_hidden.second), 1e-3f);
  // One pair per text.
  infer.mutable_text()->mutable_text_pairs()->RemoveLast();
  s = stub_->Infer(Context().get(), infer, &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(s.error_message(), "text_pairs needs one entry per text: 2 texts, 1 pairs");

  // Multiple choice: [batch 2, choices 2, seq 8] as rows 4 with choices 2.
  const auto j = nlohmann::json::parse(ReadAll(std::string(kMultipleChoice) + "/input.json"));
  v1::InferRequest choose;
  choose.set_job_id(choice_job.id());
  v1::TokenInputs* c = choose.mutable_tokens();
  c->set_choices(2);
  c->set_seq(8);
  for (size_t b = 0; b < j["input_ids"].size(); ++b) {
    for (size_t k = 0; k < j["input_ids"][b].size(); ++k) {
      c->set_rows(c->rows() + 1);
      for (const auto& v : j["input_ids"][b][k]) c->add_input_ids(v.get<int64_t>());
      for (const auto& v : j["attention_mask"][b][k]) c->add_attention_mask(v.get<int64_t>());
      for (const auto& v : j["token_type_ids"][b][k]) c->add_token_type_ids(v.get<int64_t>());
    }
  }
  ASSERT_EQ(c->rows(), 4);
  s = stub_->Infer(Context().get(), choose, &response);
  ASSERT_TRUE(s.ok()) << s.error_message();
  const auto want_logits = ReadTensor(std::string(kMultipleChoice) + "/expected.safetensors", "logits");
  ASSERT_EQ(want_logits.first, (std::vector<int64_t>{2, 2}));
  const v1::NamedTensor* logits = FindOutput(response, "logits");
  ASSERT_NE(logits, nullptr);
  EXPECT_EQ(Shape(*logits), (std::vector<int64_t>{2, 2}));
  EXPECT_LE(MaxDiff(*logits, want_logits.second), 1e-5f);
  ASSERT_EQ(response.predictions_size(), 2);
  for (int b = 0; b < 2; ++b) {
    const auto& labels = response.predictions(b).labels();
    ASSERT_EQ(labels.size(), 2);
    const std::vector<float>& want = want_logits.second;
    const int best = want[static_cast<size_t>(2 * b)] >= want[static_cast<size_t>(2 * b + 1)] ? 0 : 1;
    EXPECT_EQ(labels[0].id(), best);
    EXPECT_EQ(labels[0].label(), std::to_string(best));
    EXPECT_NEAR(labels[0].score() + labels[1].score(), 1.0f, 1e-5f);
  }
  // One choice group alone: its own logits.
  v1::InferRequest second = choose;
  v1::TokenInputs* g = second.mutable_tokens();
  g->set_rows(2);
  for (auto* field : {g->mutable_input_ids(), g->mutable_attention_mask(), g->mutable_token_type_ids()}) {
    field->erase(field->begin(), field->begin() + 16);
  }
  s = stub_->Infer(Context().get(), second, &response);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_LE(MaxDiff(response.outputs(0), {want_logits.second[2], want_logits.second[3]}), 1e-5f);
  // Rows that are no whole choice groups, and text, are refused.
  v1::InferRequest ragged = choose;
  ragged.mutable_tokens()->set_choices(3);
  s = stub_->Infer(Context().get(), ragged, &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("rows must be whole choice groups"), std::string::npos) << s.error_message();
  v1::InferRequest text;
  text.set_job_id(choice_job.id());
  text.mutable_text()->add_texts("w7");
  s = stub_->Infer(Context().get(), text, &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(s.error_message(), "text input is not supported for BertForMultipleChoice; send tokens");
}

// 8. WatchJob: an unknown id is NOT_FOUND; a watch past its deadline ends DEADLINE_EXCEEDED; a
// watcher that goes away ends its call. The coordinator keeps answering throughout, the watched job
// is unaffected and starts as usual, and nothing left over keeps the coordinator from stopping
// promptly.
TEST_F(BehaviourCluster, WatchJobErrorsLeaveTheCoordinatorServing) {
  v1::GetJobRequest unknown;
  unknown.set_job_id("job-that-does-not-exist");
  {
    auto context = Context(10);
    auto reader = stub_->WatchJob(context.get(), unknown);
    v1::JobEvent event;
    EXPECT_FALSE(reader->Read(&event));
    const grpc::Status s = reader->Finish();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
    EXPECT_EQ(s.error_message(), "no job job-that-does-not-exist");
  }
  const v1::Job running = Submit(kModel);
  ASSERT_EQ(Watch(running.id()).job().state(), v1::READY);
  const v1::Job waiting = Submit(kModel);
  ASSERT_EQ(waiting.state(), v1::PENDING);
  v1::GetJobRequest request;
  request.set_job_id(waiting.id());
  {
    auto context = Context(2);
    const auto start = std::chrono::steady_clock::now();
    auto reader = stub_->WatchJob(context.get(), request);
    v1::JobEvent event;
    ASSERT_TRUE(reader->Read(&event));
    EXPECT_EQ(event.job().state(), v1::PENDING);
    while (reader->Read(&event)) {
    }
    const grpc::Status s = reader->Finish();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << s.error_message();
    EXPECT_TRUE(DeadlineMessage(s, "job " + waiting.id() + " is still PENDING")) << s.error_message();
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  }
  v1::ListJobsResponse jobs;
  ASSERT_TRUE(stub_->ListJobs(Context().get(), v1::ListJobsRequest(), &jobs).ok());
  EXPECT_EQ(jobs.jobs_size(), 2);
  EXPECT_EQ(GetJob(waiting.id()).state(), v1::PENDING);

  // Watchers that go away, several at once.
  for (int w = 0; w < 4; ++w) {
    auto context = Context(60);
    auto reader = stub_->WatchJob(context.get(), request);
    v1::JobEvent event;
    ASSERT_TRUE(reader->Read(&event));  // the call is open on the server
    context->TryCancel();
    while (reader->Read(&event)) {
    }
    const grpc::Status s = reader->Finish();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::CANCELLED) << s.error_message();
    EXPECT_TRUE(CancelledMessage(s, "watcher went away")) << s.error_message();
  }
  jobs.Clear();
  ASSERT_TRUE(stub_->ListJobs(Context().get(), v1::ListJobsRequest(), &jobs).ok());
  EXPECT_EQ(jobs.jobs_size(), 2);
  EXPECT_EQ(GetJob(waiting.id()).state(), v1::PENDING);
  EXPECT_LE(InferDiff(running.id()), 1e-5f);
  v1::Job cancelled;
  ASSERT_TRUE(Cancel(running.id(), &cancelled).ok());
  const v1::JobEvent started = Watch(waiting.id());
  ASSERT_EQ(started.job().state(), v1::READY) << started.job().failure_cause();
  EXPECT_LE(InferDiff(waiting.id()), 1e-5f);
  // No watch handler is left behind: the coordinator drains at once (--drain_timeout is 10 s).
  const auto stopping = std::chrono::steady_clock::now();
  StopCoordinator();
  EXPECT_LT(std::chrono::steady_clock::now() - stopping, std::chrono::seconds(5));
}
}  // namespace
}  // namespace bertshard
