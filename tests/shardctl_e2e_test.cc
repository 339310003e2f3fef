// shardctl end to end: the built binaries run as a user runs them (table, json, dot, batch,
// errors, a checkpoint directory, and a real coordinator process on loopback).
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/test_process.h"

namespace bertshard {
namespace {

using nlohmann::json;

using testing::ReadAll;
using testing::Spawn;
using testing::TempDir;
using testing::WaitExit;
using Result = testing::Captured;

void WriteFile(const std::string& path, const std::string& text) { std::ofstream(path) << text; }

Result Shardctl(std::vector<std::string> args) {
  args.insert(args.begin(), "client/shardctl");
  return testing::Run(args);
}

TEST(ShardctlPlan, TableSummarisesStagesAndRanks) {
  Result r = Shardctl({"plan", "--variant", "BertForMaskedLM", "--tp", "2", "--pp", "2", "--local"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(absl::StrContains(r.out, "tp 2 x pp 2 (ONE_F_ONE_B, 1 chunk) = 4 ranks")) << r.out;
  EXPECT_TRUE(absl::StrContains(r.out, "bert.embeddings, bert.encoder.layer.0-5")) << r.out;
  EXPECT_TRUE(absl::StrContains(r.out, "bert.encoder.layer.6-11, cls")) << r.out;
  EXPECT_TRUE(absl::StrContains(r.out,
                                "tied across stages: stage 0 bert.embeddings.word_embeddings.weight <-> stage 1 "
                                "cls.predictions.decoder.weight"))
      << r.out;
}

TEST(ShardctlPlan, JsonUsesContractNamesAndNumbers) {
  Result r = Shardctl(
      {"plan", "--variant", "BertForMaskedLM", "--tp", "2", "--pp", "2", "--sp-mode", "ring", "--output", "json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  json plan = json::parse(r.out);
  EXPECT_EQ(plan["shard_config"]["sp_mode"], "SPLIT_GATHER");
  EXPECT_EQ(plan["shard_config"]["pp_style"], "ONE_F_ONE_B");
  EXPECT_EQ(plan["warnings"][0],
            "For Bert, sequence parallelism is currently not support mode ring, will set to be split_gather");
  EXPECT_EQ(plan["layers_per_stage"], json({6, 6}));
  EXPECT_EQ(plan["module_policy"][0]["target_class"], "BertLayer");
  EXPECT_EQ(plan["module_policy"][0]["attribute_replacements"][0]["value"], 384);
  const json& rank0 = plan["ranks"][0];
  EXPECT_TRUE(rank0["param_bytes"].is_number());
  const json& query = rank0["tensors"][5];
  EXPECT_EQ(query["name"], "bert.encoder.layer.0.attention.self.query.weight");
  EXPECT_EQ(query["local_shape"], json({384, 768}));
  EXPECT_EQ(plan["shared_params"][0]["members"][1]["param"], "cls.predictions.decoder.weight");
}

TEST(ShardctlPlan, DotDrawsStagesRanksAndTiedLinks) {
  Result r = Shardctl({"plan", "--variant", "BertForPreTraining", "--tp", "2", "--pp", "2", "--output", "dot"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(absl::StartsWith(r.out, "digraph bertshard_plan {"));
  EXPECT_TRUE(absl::StrContains(r.out, "subgraph cluster_stage1"));
  EXPECT_TRUE(absl::StrContains(r.out, "rank0 -> rank2;"));
  EXPECT_TRUE(absl::StrContains(r.out, "rank1 -> rank3 [style=dashed"));
}

TEST(ShardctlPlan, RequestFileWithFlagOverride) {
  const std::string path = TempDir() + "/request.json";
  WriteFile(path, R"({"variant": "BertForQuestionAnswering", "config": {"num_hidden_layers": 4},
                      "parallel": {"tp_size": 2, "pp_size": 2}})");
  Result r = Shardctl({"plan", path, "--pp", "4", "--output", "json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  json plan = json::parse(r.out);
  EXPECT_EQ(plan["layers_per_stage"], json({1, 1, 1, 1}));
  EXPECT_EQ(plan["stages"][3]["held_modules"], json({"bert.encoder.layer.3", "qa_outputs"}));
}

TEST(ShardctlPlan, CheckpointConfigFillsVariantAndConfig) {
  const std::string dir = TempDir() + "/ckpt";
  ASSERT_EQ(system(("mkdir -p " + dir).c_str()), 0);
  WriteFile(dir + "/config.json", R"({"architectures": ["BertForSequenceClassification"],
      "hidden_size": 128, "num_attention_heads": 4, "intermediate_size": 256, "num_hidden_layers": 2,
      "vocab_size": 1000, "id2label": {"0": "a", "1": "b", "2": "c"}, "model_type": "bert"})");
  Result r = Shardctl({"plan", "--checkpoint", dir, "--tp", "4", "--output", "json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  json plan = json::parse(r.out);
  EXPECT_EQ(plan["variant"], "BERT_FOR_SEQUENCE_CLASSIFICATION");
  EXPECT_EQ(plan["config"]["num_labels"], 3);
  EXPECT_EQ(plan["module_policy"].back()["target_class"], "BertForSequenceClassification");
  Result missing = Shardctl({"plan", "--checkpoint", dir + "/nope"});
  EXPECT_EQ(missing.exit_code, 2);
  EXPECT_TRUE(absl::StrContains(missing.err, "config.json")) << missing.err;
}

TEST(ShardctlPlan, BatchPrintsOneLinePerRequest) {
  const std::string path = TempDir() + "/batch.jsonl";
  std::string lines = R"({"variant": "BERT_MODEL", "parallel": {"tp_size": 4}})"
                      "\n"
                      R"({"variant": "BertModel", "parallel": {"tp_size": 5}})"
                      "\n"
                      "\n"
                      R"(not json)"
                      "\n"
                      R"({"variant": "BertForMaskedLM", "parallel": {"pp_size": 2, "pp_style": "zbv"}})"
                      "\n";
  for (int i = 0; i < 2000; ++i)
    lines += R"({"variant": "BertForPreTraining", "parallel": {"tp_size": 2, "pp_size": 2}})"
             "\n";
  WriteFile(path, lines);
  Result r = Shardctl({"plan", "--batch", path, "--output", "json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::vector<std::string> out = absl::StrSplit(r.out, '\n', absl::SkipEmpty());
  ASSERT_EQ(out.size(), 2004u);
  EXPECT_EQ(json::parse(out[0])["shard_config"]["tensor_parallel_size"], 4);
  json error = json::parse(out[1]);
  EXPECT_EQ(error["error"]["code"], "INVALID_ARGUMENT");
  EXPECT_TRUE(
      absl::StrContains(error["error"]["message"].get<std::string>(), "valid tp_size values: 1, 2, 3, 4, 6, 12"));
  EXPECT_EQ(json::parse(out[2])["error"]["code"], "INVALID_ARGUMENT");
  json zbv = json::parse(out[3]);  // ZBV defaults to its 2 chunks; the V ends on stage 0
  EXPECT_EQ(zbv["stages"][0]["is_last"], true);
  EXPECT_EQ(zbv["stages"][0]["held_modules"].back(), "cls");
  EXPECT_EQ(json::parse(out[2003])["ranks"].size(), 4u);

  Result table = Shardctl({"plan", "--batch", path});
  EXPECT_EQ(table.exit_code, 2);
  EXPECT_TRUE(absl::StrContains(table.err, "--output json")) << table.err;
}

TEST(ShardctlPlan, InvalidInputExitsTwoWithMessage) {
  struct Case {
    std::vector<std::string> args;
    const char* message;
  };
  const std::vector<Case> cases = {
      {{"plan", "--variant", "BertModel", "--tp", "5"},
       "INVALID_ARGUMENT: tp_size 5 does not divide num_attention_heads 12; valid tp_size values: 1, 2, 3, 4, 6, 12"},
      {{"plan", "--variant", "GPT2"}, "unknown model variant 'GPT2'"},
      {{"plan", "--tp", "2"}, "variant is required"},
      {{"plan", "--variant", "BertModel", "--tpp", "2"}, "unknown flag --tpp"},
      {{"plan", "--variant", "BertModel", "--output", "yaml"}, "--output 'yaml'"},
      {{"plan", "/nonexistent/request.json"}, "cannot read request file"},
      {{"plan", "--variant", "BertModel", "--sp-mode", "ring_attn", "--tp", "2"}, "ring_attn"},
      {{"frobnicate"}, "unknown command 'frobnicate'"},
  };
  for (const Case& c : cases) {
    Result r = Shardctl(c.args);
    EXPECT_EQ(r.exit_code, 2) << c.args[1];
    EXPECT_TRUE(absl::StrContains(r.err, c.message)) << r.err;
    EXPECT_TRUE(r.out.empty());
  }
}

TEST(ShardctlPlan, TalksToACoordinatorProcessAndItDrainsOnSigterm) {
  const std::string base = TempDir() + "/coordinator";
  pid_t coordinator = Spawn({"server/bertshard-coordinator", "--listen=127.0.0.1:0"}, base + ".out", base + ".err");
  int port = 0;
  for (int i = 0; i < 200 && port == 0; ++i) {  // wait for "listening on port N"
    const std::string out = ReadAll(base + ".out");
    if (size_t at = out.find("port "); at != std::string::npos && out.find('\n', at) != std::string::npos) {
      port = std::atoi(out.c_str() + at + 5);
    } else {
      usleep(50 * 1000);
    }
  }
  ASSERT_GT(port, 0) << ReadAll(base + ".err");
  const std::string address = "127.0.0.1:" + std::to_string(port);
  Result ok = Shardctl({"plan", "--server", address, "--variant", "BertModel", "--tp", "2", "--output", "json"});
  EXPECT_EQ(ok.exit_code, 0) << ok.err;
  EXPECT_EQ(json::parse(ok.out)["ranks"].size(), 2u);
  Result bad = Shardctl({"plan", "--server", address, "--variant", "BertModel", "--tp", "7"});
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_TRUE(absl::StrContains(bad.err, "INVALID_ARGUMENT: tp_size 7")) << bad.err;

  kill(coordinator, SIGTERM);
  EXPECT_EQ(WaitExit(coordinator), 0) << ReadAll(base + ".err");
  Result gone = Shardctl({"plan", "--server", address, "--variant", "BertModel", "--timeout", "2"});
  EXPECT_EQ(gone.exit_code, 1);
  EXPECT_TRUE(absl::StrContains(gone.err, "coordinator at " + address)) << gone.err;
}

}  // namespace
}  // namespace bertshard
