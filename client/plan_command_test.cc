#include "client/plan_command.h"

#include "absl/strings/match.h"
#include "gtest/gtest.h"

namespace bertshard::client {
namespace {

TEST(PlanRequestJson, AcceptsContractAndFriendlySpellings) {
  auto contract =
      ParsePlanRequestJson(R"({"variant": "BERT_FOR_MASKED_LM", "parallel": {"tp_size": 2, "pp_style": "ZBV"}})");
  ASSERT_TRUE(contract.ok()) << contract.status();
  EXPECT_EQ(contract->variant(), v1::BERT_FOR_MASKED_LM);
  auto friendly = ParsePlanRequestJson(
      R"({"variant": "BertForMaskedLM", "parallel": {"pp_style": "zbv", "sp_mode": "split_gather"}})");
  ASSERT_TRUE(friendly.ok()) << friendly.status();
  EXPECT_EQ(friendly->variant(), v1::BERT_FOR_MASKED_LM);
  EXPECT_EQ(friendly->parallel().pp_style(), v1::ZBV);
  EXPECT_EQ(friendly->parallel().sp_mode(), v1::SPLIT_GATHER);
}

TEST(PlanRequestJson, ConfigMayBeAWholeHfConfig) {
  auto r = ParsePlanRequestJson(R"({"config": {"architectures": ["BertForTokenClassification"],
      "hidden_size": 128, "model_type": "bert", "_attn_implementation": "eager",
      "pad_token_id": null, "id2label": {"0": "O", "1": "B-PER", "2": "I-PER"}},
      "parallel": {"tp_size": 2}})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->variant(), v1::BERT_FOR_TOKEN_CLASSIFICATION);
  EXPECT_EQ(r->config().hidden_size(), 128);
  EXPECT_EQ(r->config().num_labels(), 3);
  EXPECT_FALSE(r->config().has_pad_token_id());
  EXPECT_FALSE(ParsePlanRequestJson(R"({"config": {"hidden_size": "big"}})").ok());
  EXPECT_FALSE(ParsePlanRequestJson(R"({"config": 3})").ok());
  EXPECT_FALSE(ParsePlanRequestJson(R"({"parallel": {"tp": 2}})").ok());  // typo outside config
}

TEST(PlanRequestJson, RejectsUnknownNamesWithTheValidOnes) {
  auto bad_variant = ParsePlanRequestJson(R"({"variant": "GPT2"})");
  EXPECT_EQ(bad_variant.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad_variant.status().message().find("BertForMaskedLM"), absl::string_view::npos);
  EXPECT_FALSE(ParsePlanRequestJson(R"({"parallel": {"pp_style": "gpipe"}})").ok());
  EXPECT_FALSE(ParsePlanRequestJson("[1, 2]").ok());
  EXPECT_FALSE(ParsePlanRequestJson(R"({"parallel": {"tp_size": "two"}})").ok());
}

TEST(PlanFlags, FlagsOverrideTheRequest) {
  auto cl = ParseCommandLine({"plan", "--variant", "BertModel", "--tp", "4", "--pp-style", "interleaved", "--chunks",
                              "2", "--layers-per-stage", "1, 2,3,6", "--sp-mode", "ring", "--config",
                              R"({"num_hidden_layers": 12, "hidden_act": "relu"})", "--fp8"},
                             PlanFlags());
  ASSERT_TRUE(cl.ok()) << cl.status();
  v1::PlanRequest request;
  request.set_variant(v1::BERT_FOR_MASKED_LM);
  request.mutable_parallel()->set_tp_size(2);
  ASSERT_TRUE(ApplyPlanFlags(*cl, &request).ok());
  EXPECT_EQ(request.variant(), v1::BERT_MODEL);
  EXPECT_EQ(request.parallel().tp_size(), 4);
  EXPECT_EQ(request.parallel().pp_style(), v1::INTERLEAVED);
  EXPECT_EQ(request.parallel().num_layers_per_stage_size(), 4);
  EXPECT_EQ(request.parallel().sp_mode(), v1::RING);
  EXPECT_EQ(request.config().hidden_act(), "relu");
  EXPECT_TRUE(request.parallel().fp8_communication());
}

TEST(PlanFlags, DtypeFromTheFlagOrTheRequest) {
  auto cl = ParseCommandLine({"plan", "--variant", "BertModel", "--dtype", "bfloat16"}, PlanFlags());
  ASSERT_TRUE(cl.ok()) << cl.status();
  v1::PlanRequest request;
  ASSERT_TRUE(ApplyPlanFlags(*cl, &request).ok());
  EXPECT_EQ(request.dtype(), v1::BF16);
  auto friendly = ParsePlanRequestJson(R"({"variant": "BertModel", "dtype": "fp16"})");
  ASSERT_TRUE(friendly.ok()) << friendly.status();
  EXPECT_EQ(friendly->dtype(), v1::FP16);
  auto contract = ParsePlanRequestJson(R"({"variant": "BERT_MODEL", "dtype": "BF16"})");
  ASSERT_TRUE(contract.ok()) << contract.status();
  EXPECT_EQ(contract->dtype(), v1::BF16);
  auto bad = ParsePlanRequestJson(R"({"variant": "BertModel", "dtype": "int8"})");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(bad.status().message(), "unknown dtype 'int8'")) << bad.status();
}

TEST(PlanFlags, RejectsNonIntegersAndUnknownStyles) {
  for (auto args : std::vector<std::vector<std::string>>{{"plan", "--tp", "two"},
                                                         {"plan", "--pp-style", "gpipe"},
                                                         {"plan", "--sp-mode", "ulysses"},
                                                         {"plan", "--config", "{not json"},
                                                         {"plan", "--layers-per-stage", "1,,2"},
                                                         {"plan", "--dtype", "fp8"}}) {
    auto cl = ParseCommandLine(args, PlanFlags());
    ASSERT_TRUE(cl.ok());
    v1::PlanRequest request;
    EXPECT_EQ(ApplyPlanFlags(*cl, &request).code(), absl::StatusCode::kInvalidArgument) << args[2];
  }
}

}  // namespace
}  // namespace bertshard::client
