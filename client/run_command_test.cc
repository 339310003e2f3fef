#include "client/run_command.h"

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include "absl/strings/match.h"
#include "client/captured_run.h"
#include "gtest/gtest.h"
#include "planner/planner.h"

namespace bertshard::client {
namespace {

v1::ShardPlan SmallPlan(v1::ModelVariant variant) {
  v1::PlanRequest request;
  request.set_variant(variant);
  request.mutable_config()->set_vocab_size(100);
  request.mutable_config()->set_max_position_embeddings(16);
  auto plan = planner::Plan(request);
  EXPECT_TRUE(plan.ok()) << plan.status();
  return plan.ok() ? *plan : v1::ShardPlan();
}

TEST(ParseTokenJson, FlattensAndFillsTheMaskAndTokenTypes) {
  auto in = ParseTokenJson(R"({"input_ids": [[1, 2, 3], [4, 5, 6]], "attention_mask": [[1, 1, 0], [1, 1, 1]]})", 0);
  ASSERT_TRUE(in.ok()) << in.status();
  EXPECT_EQ(in->batch, 2);
  EXPECT_EQ(in->choices, 1);
  EXPECT_EQ(in->seq, 3);
  EXPECT_EQ(in->input_ids, (std::vector<int64_t>{1, 2, 3, 4, 5, 6}));
  EXPECT_EQ(in->attention_mask, (std::vector<int64_t>{1, 1, 0, 1, 1, 1}));
  EXPECT_EQ(in->token_type_ids, std::vector<int64_t>(6, 0));
  auto choices = ParseTokenJson(R"({"input_ids": [[[1, 2], [3, 4], [5, 6]]]})", 0);  // depth read off the ids
  ASSERT_TRUE(choices.ok()) << choices.status();
  EXPECT_EQ(choices->batch, 1);
  EXPECT_EQ(choices->choices, 3);
  EXPECT_EQ(choices->seq, 2);
}

TEST(ParseTokenJson, RefusesWhatIsNotARectangleOfIntegers) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"[1, 2]", "not a JSON object"},
      {R"({"ids": [[1]]})", "unknown input field 'ids'"},
      {R"({"attention_mask": [[1]]})", "input needs input_ids"},
      {R"({"input_ids": [[1, 2], [3]]})", "ragged"},
      {R"({"input_ids": [[1, 2.5]]})", "must hold integers"},
      {R"({"input_ids": [[1, 2]], "token_type_ids": [[0, 0, 0]]})", "must have the shape of input_ids"},
  };
  for (const auto& [json, message] : cases) {
    auto in = ParseTokenJson(json, 0);
    EXPECT_EQ(in.status().code(), absl::StatusCode::kInvalidArgument) << json;
    EXPECT_TRUE(absl::StrContains(in.status().message(), message)) << json << ": " << in.status();
  }
}

TEST(ParseRunInputs, ChecksTheTokensAgainstThePlan) {
  const v1::ShardPlan plan = SmallPlan(v1::BERT_MODEL);
  EXPECT_TRUE(ParseRunInputs(R"({"input_ids": [[1, 99]]})", plan).ok());
  const auto too_big = ParseRunInputs(R"({"input_ids": [[1, 100]]})", plan);
  EXPECT_TRUE(absl::StrContains(too_big.status().message(), "ids must be in [0, vocab_size 100)")) << too_big.status();
  const auto too_long = ParseRunInputs(R"({"input_ids": [[1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]]})", plan);
  EXPECT_TRUE(absl::StrContains(too_long.status().message(), "exceeds max_position_embeddings 16"))
      << too_long.status();
  const auto mask = ParseRunInputs(R"({"input_ids": [[1, 2]], "attention_mask": [[1, 2]]})", plan);
  EXPECT_TRUE(absl::StrContains(mask.status().message(), "it must be 0 or 1")) << mask.status();
  // A multiple-choice model reads [batch, choices, seq]: a [batch, seq] input is the wrong depth.
  const auto flat = ParseRunInputs(R"({"input_ids": [[1, 2]]})", SmallPlan(v1::BERT_FOR_MULTIPLE_CHOICE));
  EXPECT_TRUE(absl::StrContains(flat.status().message(), "[batch, choices, seq]")) << flat.status();
}

CapturedRun RunWith(const CommandLine& cl) {
  return CaptureRun([&](std::FILE* out, std::FILE* err) { return RunRunCommand(cl, out, err); });
}

// Each of these is refused before any rank process starts (exit 2, or 1 for a missing binary).
TEST(RunRunCommand, RefusesBadFlagsBeforeStartingRanks) {
  const std::string dir = ::testing::TempDir() + "/run_command_test";
  ASSERT_EQ(std::system(("mkdir -p " + dir + "/model").c_str()), 0);
  // The planner reads the checkpoint's config.json; no weights are needed to be refused.
  std::ofstream(dir + "/model/config.json") << R"({"architectures": ["BertModel"], "model_type": "bert",
      "vocab_size": 100, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
      "intermediate_size": 64, "max_position_embeddings": 16})";
  const std::string input = dir + "/input.json";
  std::ofstream(input) << R"({"input_ids": [[1, 2, 3]]})";
  const auto command = [&](std::map<std::string, std::string> values, bool local = true) {
    CommandLine cl;
    cl.positional = {"run"};
    cl.values = {{"checkpoint", dir + "/model"}, {"input", input}, {"output", dir + "/out.safetensors"}};
    for (const auto& [k, v] : values) cl.values[k] = v;
    if (local) cl.switches.insert("local");
    return cl;
  };
  const struct {
    CommandLine cl;
    int exit_code;
    const char* message;
  } cases[] = {
      {command({}, /*local=*/false), 2, "run needs --local"},
      {command({{"backend", "mpi"}}), 2, "--backend 'mpi' is not one of gloo, nccl"},
      {command({{"micro-batches", "0"}}), 2, "--micro-batches needs a positive integer"},
      {command({{"micro-batches", "2"}}), 2, "--micro-batches 2 exceeds the batch size 1"},
      {command({{"iterations", "5000"}}), 2, "--iterations needs an integer in 1..1000"},
      {command({{"tp-transport", "shm"}}), 2, "--tp-transport shm is not one of"},
      {command({{"gemm", "fast"}}), 2, "fast"},
      {command({{"input", "/nonexistent/input.json"}}), 2, "cannot read input file"},
      {command({{"rank-binary", "/nonexistent/shard-rank"}}), 1, "rank binary /nonexistent/shard-rank not found"},
  };
  for (const auto& c : cases) {
    const CapturedRun r = RunWith(c.cl);
    EXPECT_EQ(r.exit_code, c.exit_code) << c.message << ": " << r.err;
    EXPECT_TRUE(absl::StrContains(r.err, c.message)) << r.err;
    EXPECT_TRUE(r.out.empty()) << r.out;
  }
  CommandLine missing = command({});
  missing.values.erase("output");
  EXPECT_TRUE(absl::StrContains(RunWith(missing).err, "run needs --output"));
}

TEST(RunFlags, AreTheRequestFlagsAndRunsOwn) {
  std::set<std::string> names;
  for (const Flag& f : RunFlags()) names.insert(f.name);
  for (const char* expected : {"variant", "tp", "checkpoint", "local", "input", "output", "gemm", "rank-binary"}) {
    EXPECT_TRUE(names.count(expected)) << expected;
  }
  for (const char* absent : {"server", "token-file", "tls-ca", "batch", "request"}) {
    EXPECT_FALSE(names.count(absent)) << absent;  // run talks to no coordinator
  }
}

}  // namespace
}  // namespace bertshard::client
