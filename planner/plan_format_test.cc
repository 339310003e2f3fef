#include "planner/plan_format.h"

#include "absl/strings/match.h"
#include "common/proto_json.h"
#include "gtest/gtest.h"
#include "planner/planner.h"

namespace bertshard::planner {
namespace {

v1::ShardPlan ZbvPlan() {
  v1::PlanRequest r;
  r.set_variant(v1::BERT_FOR_MASKED_LM);
  r.mutable_parallel()->set_tp_size(2);
  r.mutable_parallel()->set_pp_size(3);
  r.mutable_parallel()->set_pp_style(v1::ZBV);
  return *Plan(r);
}

TEST(PlanTable, CompressesLayerRunsAndListsRanks) {
  const std::string table = FormatPlanTable(ZbvPlan());
  EXPECT_TRUE(absl::StrContains(table,
                                "0      yes    yes   [0,2) [10,12)      bert.embeddings, "
                                "bert.encoder.layer.0-1, bert.encoder.layer.10-11, cls"))
      << table;
  EXPECT_TRUE(absl::StrContains(table, "5      2      1")) << table;
}

TEST(PlanDot, FollowsTheVBothWays) {
  const std::string dot = FormatPlanDot(ZbvPlan());
  EXPECT_TRUE(absl::StrContains(dot, "rank0 -> rank2;"));
  EXPECT_TRUE(absl::StrContains(dot, "rank2 -> rank4;"));
  EXPECT_TRUE(absl::StrContains(dot, "rank4 -> rank2;"));
  EXPECT_TRUE(absl::StrContains(dot, "rank3 -> rank1;"));
  EXPECT_FALSE(absl::StrContains(dot, "rank4 -> rank4"));
  EXPECT_FALSE(absl::StrContains(dot, "style=dashed"));  // no cross-stage tie under ZBV
}

TEST(PlanJson, FastWriterMatchesGenericWriter) {
  v1::ShardPlan plan = ZbvPlan();
  plan.mutable_ranks(0)->mutable_tensors(0)->set_name("odd \"name\"");
  std::string fast;
  AppendPlanJson(plan, 0, &fast);
  EXPECT_EQ(fast, common::ProtoToJson(plan, {.indent = 0}));
  std::string pretty;
  AppendPlanJson(plan, 2, &pretty);
  EXPECT_EQ(pretty, common::ProtoToJson(plan));
}

TEST(PlanErrorJson, EscapesTheMessage) {
  EXPECT_EQ(FormatErrorJson(absl::InvalidArgumentError("bad \"tp\"\n")),
            R"({"error":{"code":"INVALID_ARGUMENT","message":"bad \"tp\"\n"}})");
}

TEST(HumanBytes, PicksAUnit) {
  EXPECT_EQ(HumanBytes(512), "512 B");
  EXPECT_EQ(HumanBytes(1536), "1.5 KiB");
  EXPECT_EQ(HumanBytes(int64_t{3} << 30), "3.0 GiB");
}

}  // namespace
}  // namespace bertshard::planner
