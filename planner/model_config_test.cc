#include "planner/model_config.h"

#include <sys/stat.h>

#include <filesystem>
#include <fstream>

#include "absl/strings/match.h"
#include "gtest/gtest.h"

namespace bertshard::planner {
namespace {

// The config.json HF writes for bert-base-uncased (fields as published).
constexpr char kBertBaseConfig[] = R"({
  "architectures": ["BertForMaskedLM"], "attention_probs_dropout_prob": 0.1,
  "gradient_checkpointing": false, "hidden_act": "gelu", "hidden_dropout_prob": 0.1,
  "hidden_size": 768, "initializer_range": 0.02, "intermediate_size": 3072,
  "layer_norm_eps": 1e-12, "max_position_embeddings": 512, "model_type": "bert",
  "num_attention_heads": 12, "num_hidden_layers": 12, "pad_token_id": 0,
  "position_embedding_type": "absolute", "transformers_version": "4.6.0.dev0",
  "type_vocab_size": 2, "use_cache": true, "vocab_size": 30522})";

TEST(HfConfig, ParsesBertBaseConfigJson) {
  auto hf = ParseHfConfigJson(kBertBaseConfig);
  ASSERT_TRUE(hf.ok()) << hf.status();
  EXPECT_EQ(hf->variant, v1::BERT_FOR_MASKED_LM);
  EXPECT_EQ(hf->config.hidden_size(), 768);
  EXPECT_EQ(hf->config.layer_norm_eps(), 1e-12);
  EXPECT_FALSE(hf->config.has_tie_word_embeddings());  // HF default applies later
  EXPECT_TRUE(WithHfDefaults(hf->config).tie_word_embeddings());
}

TEST(HfConfig, RejectsWrongTypesAndUnknownArchitectures) {
  EXPECT_FALSE(ParseHfConfigJson(R"({"hidden_size": 76.5})").ok());
  EXPECT_FALSE(ParseHfConfigJson(R"({"hidden_size": "768"})").ok());
  EXPECT_FALSE(ParseHfConfigJson(R"({"tie_word_embeddings": 1})").ok());
  EXPECT_FALSE(ParseHfConfigJson("[]").ok());
  // A file that is not JSON at all: the error says so and quotes none of it (issue 10: a
  // config.json linked to /etc/passwd handed its first bytes to the client).
  const auto passwd = ParseHfConfigJson("root:x:0:0:root:/root:/bin/bash\ndaemon:x:1:1::/usr/sbin:/usr/sbin/nologin\n");
  ASSERT_EQ(passwd.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(passwd.status().message(), "config.json is not a valid JSON object");
  EXPECT_FALSE(ParseHfConfigJson(R"({"position_embedding_type": "relative_key"})").ok());
  auto gpt = ParseHfConfigJson(R"({"architectures": ["GPT2LMHeadModel"]})");
  EXPECT_EQ(gpt.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(gpt.status().message(), "GPT2LMHeadModel")) << gpt.status();
}

TEST(HfConfig, CheckpointFillsOnlyUnsetFields) {
  const std::string dir = std::string(std::getenv("TEST_TMPDIR"));
  std::ofstream(dir + "/config.json") << kBertBaseConfig;
  v1::PlanRequest request;
  request.set_checkpoint(dir);
  request.mutable_config()->set_num_hidden_layers(4);
  ASSERT_TRUE(ResolveCheckpoint(&request).ok());
  EXPECT_EQ(request.variant(), v1::BERT_FOR_MASKED_LM);
  EXPECT_EQ(request.config().num_hidden_layers(), 4);  // explicit request field wins
  EXPECT_EQ(request.config().hidden_size(), 768);

  v1::PlanRequest missing;
  missing.set_checkpoint(dir + "/absent");
  absl::Status s = ResolveCheckpoint(&missing);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(s.message(), "absent/config.json")) << s;
}

// A config.json that is a FIFO or a device is refused at once (the read-only Plan RPC reads it):
// it used to park the reading thread until a writer came, or read /dev/zero until memory ran out.
TEST(HfConfig, ACheckpointConfigThatIsNotARegularFileIsRefused) {
  const std::string dir = std::string(std::getenv("TEST_TMPDIR")) + "/fifo_checkpoint";
  std::filesystem::create_directories(dir);
  ASSERT_EQ(mkfifo((dir + "/config.json").c_str(), 0600), 0);
  v1::PlanRequest request;
  request.set_checkpoint(dir);
  const absl::Status s = ResolveCheckpoint(&request);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "not a regular file")) << s;
}

TEST(VariantNames, AcceptsEnumAndHfNames) {
  EXPECT_EQ(*ParseVariant("BertForMultipleChoice"), v1::BERT_FOR_MULTIPLE_CHOICE);
  EXPECT_EQ(*ParseVariant("BERT_LM_HEAD_MODEL"), v1::BERT_LM_HEAD_MODEL);
  EXPECT_FALSE(ParseVariant("bertmodel").ok());
  EXPECT_EQ(HfClassName(v1::BERT_FOR_PRE_TRAINING), "BertForPreTraining");
}

}  // namespace
}  // namespace bertshard::planner
