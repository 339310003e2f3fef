#include "server/smaller_shapes.h"

#include <algorithm>

#include "google/protobuf/util/message_differencer.h"
#include "gtest/gtest.h"
#include "planner/planner.h"

namespace bertshard::server {
namespace {

// A small BertForMaskedLM of 4 layers and 4 heads, asked for as tp x pp.
v1::PlanRequest Request(int tp, int pp) {
  v1::PlanRequest r;
  r.set_variant(v1::BERT_FOR_MASKED_LM);
  r.mutable_config()->set_vocab_size(100);
  r.mutable_config()->set_hidden_size(64);
  r.mutable_config()->set_num_attention_heads(4);
  r.mutable_config()->set_intermediate_size(128);
  r.mutable_config()->set_num_hidden_layers(4);
  r.mutable_parallel()->set_tp_size(tp);
  r.mutable_parallel()->set_pp_size(pp);
  return r;
}

v1::ShardPlan PlanOf(const v1::PlanRequest& request) {
  absl::StatusOr<v1::ShardPlan> plan = planner::Plan(request);
  EXPECT_TRUE(plan.ok()) << plan.status();
  return plan.ok() ? *plan : v1::ShardPlan();
}

TEST(SmallerShapes, TheSameTpOverFewerStagesComesFirstAndIsPlannedAsTheJobWouldBe) {
  const v1::PlanRequest job = Request(2, 2);
  const std::optional<SmallerShape> s = LargestSmallerShape(job, PlanOf(job), /*workers=*/3);
  ASSERT_TRUE(s.has_value());
  EXPECT_EQ(s->request.parallel().tp_size(), 2);
  EXPECT_EQ(s->request.parallel().pp_size(), 1);
  EXPECT_EQ(s->plan.world_size(), 2);
  // The plan is the one the planner makes for that request: the tensor tables say what each rank holds.
  std::string differences;
  google::protobuf::util::MessageDifferencer differ;
  differ.ReportDifferencesToString(&differences);
  EXPECT_TRUE(differ.Compare(s->plan, PlanOf(Request(2, 1)))) << differences;
}

TEST(SmallerShapes, ASmallerTpWhenNoStageCanGo) {
  const v1::PlanRequest job = Request(4, 1);
  const std::optional<SmallerShape> on_three = LargestSmallerShape(job, PlanOf(job), 3);
  ASSERT_TRUE(on_three.has_value());
  EXPECT_EQ(on_three->request.parallel().tp_size(), 2);  // 3 does not divide the heads
  EXPECT_EQ(on_three->request.parallel().pp_size(), 1);
  const std::optional<SmallerShape> on_one = LargestSmallerShape(job, PlanOf(job), 1);
  ASSERT_TRUE(on_one.has_value());
  EXPECT_EQ(on_one->plan.world_size(), 1);
}

TEST(SmallerShapes, TheLargestWorldAmongSmallerTps) {
  // TP 2 x PP 3 on 5 workers: TP 2 x PP 2 (4 workers); a TP 1 x PP 4 job on 3: TP 1 x PP 3.
  const v1::PlanRequest job = Request(2, 3);
  const std::optional<SmallerShape> s = LargestSmallerShape(job, PlanOf(job), 5);
  ASSERT_TRUE(s.has_value());
  EXPECT_EQ(s->request.parallel().tp_size(), 2);
  EXPECT_EQ(s->request.parallel().pp_size(), 2);
  const v1::PlanRequest tp1 = Request(1, 4);
  const std::optional<SmallerShape> pp = LargestSmallerShape(tp1, PlanOf(tp1), 3);
  ASSERT_TRUE(pp.has_value());
  EXPECT_EQ(pp->request.parallel().pp_size(), 3);
}

TEST(SmallerShapes, OneStageDropsThePipelineStyleAndTpOneDropsSequenceParallelism) {
  v1::PlanRequest job = Request(2, 2);
  job.mutable_parallel()->set_pp_style(v1::INTERLEAVED);
  job.mutable_parallel()->set_num_model_chunks(2);
  job.mutable_parallel()->set_sp_mode(v1::SPLIT_GATHER);
  const std::optional<SmallerShape> s = LargestSmallerShape(job, PlanOf(job), 1);
  ASSERT_TRUE(s.has_value());
  EXPECT_EQ(s->plan.world_size(), 1);
  EXPECT_EQ(s->request.parallel().pp_style(), v1::PIPELINE_STYLE_UNSPECIFIED);
  EXPECT_EQ(s->request.parallel().num_model_chunks(), 0);
  EXPECT_EQ(s->request.parallel().sp_mode(), v1::SP_NONE);
  // On 2 workers, the same TP on one stage keeps SP.
  const std::optional<SmallerShape> two = LargestSmallerShape(job, PlanOf(job), 2);
  ASSERT_TRUE(two.has_value());
  EXPECT_EQ(two->request.parallel().tp_size(), 2);
  EXPECT_EQ(two->request.parallel().sp_mode(), v1::SPLIT_GATHER);
}

TEST(SmallerShapes, TheCheckpointStaysInTheRequestButNoFileIsRead) {
  v1::PlanRequest job = Request(2, 1);
  const v1::ShardPlan plan = PlanOf(job);
  job.set_checkpoint("/nowhere/model");  // planning it would fail: the planner must not read it
  const std::optional<SmallerShape> s = LargestSmallerShape(job, plan, 1);
  ASSERT_TRUE(s.has_value());
  EXPECT_EQ(s->request.checkpoint(), "/nowhere/model");
  EXPECT_EQ(ShapeText(s->request), "TP 1 x PP 1, FP32, /nowhere/model");
}

TEST(SmallerShapes, OneNamedShapeAsTheLargestWouldPlanIt) {
  const v1::PlanRequest job = Request(2, 2);
  const v1::ShardPlan plan = PlanOf(job);
  const std::optional<SmallerShape> s = SmallerShapeOf(job, plan, 2, 1);
  ASSERT_TRUE(s.has_value());
  EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(s->plan, LargestSmallerShape(job, plan, 3)->plan));
  EXPECT_FALSE(SmallerShapeOf(job, plan, 2, 2).has_value());  // not smaller
  EXPECT_FALSE(SmallerShapeOf(job, plan, 4, 1).has_value());  // a larger TP
  EXPECT_FALSE(SmallerShapeOf(job, plan, 0, 1).has_value());
}

TEST(SmallerShapes, NoneFitsNoWorkersOrAOneWorkerJob) {
  const v1::PlanRequest job = Request(2, 2);
  EXPECT_FALSE(LargestSmallerShape(job, PlanOf(job), 0).has_value());
  const v1::PlanRequest one = Request(1, 1);
  EXPECT_FALSE(LargestSmallerShape(one, PlanOf(one), 1).has_value());
}

TEST(KeptWorkers, EachKeepsItsRankOfTheSameShapeAndItsTpSliceOfFewerStages) {
  const v1::ShardPlan full = PlanOf(Request(2, 2));
  // Ranks 0, 2, 3 kept (rank 1 lost), placed again in the same shape: each its own rank back.
  EXPECT_EQ(AssignKeptWorkers(full, {0, 2, 3}, full), (std::vector<int>{0, -1, 1, 2}));
  // TP 2 x PP 1 on them: ranks 0 and 1 of the single stage hold TP slices 0 and 1 of every layer;
  // the kept rank 0 (stage 0, slice 0) and rank 3 (stage 1, slice 1) share the most with them.
  const v1::ShardPlan one_stage = PlanOf(Request(2, 1));
  EXPECT_EQ(AssignKeptWorkers(full, {0, 2, 3}, one_stage), (std::vector<int>{0, 2}));
  // Growing back from TP 2 x PP 1: each takes a rank of its own TP slice; idle workers the others.
  const std::vector<int> grown = AssignKeptWorkers(one_stage, {0, 1}, full);
  ASSERT_EQ(grown.size(), 4u);
  EXPECT_EQ(std::count(grown.begin(), grown.end(), -1), 2);
  for (int rank = 0; rank < 4; ++rank) {
    if (grown[rank] >= 0) EXPECT_EQ(grown[rank], rank % 2) << "rank " << rank;  // rank = stage x 2 + slice
  }
  // A kept worker that shares nothing still takes a rank before an idle one.
  EXPECT_EQ(AssignKeptWorkers(full, {3}, PlanOf(Request(1, 1))), (std::vector<int>{0}));
}

}  // namespace
}  // namespace bertshard::server
