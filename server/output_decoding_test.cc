#include "server/output_decoding.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "server/serving_test_util.h"

namespace bertshard::server {
namespace {

std::vector<std::string> Outputs(const v1::ForwardWant& want) { return {want.outputs().begin(), want.outputs().end()}; }

// One row [CLS] the [MASK] play [SEP].
v1::TokenInputs MaskedRow() {
  v1::TokenInputs t;
  t.set_rows(1);
  t.set_seq(5);
  for (int64_t id : {kCls, kThe, kMask, kPlay, kSep}) {
    t.add_input_ids(id);
    t.add_attention_mask(1);
    t.add_token_type_ids(0);
  }
  return t;
}

TEST(InferWant, AsksForTheOutputsUnlessPredictionsOnlyAndForWhatPredictReads) {
  const auto assets = SmallAssets();
  v1::ForwardWant mlm = InferWant(SmallPlan(v1::BERT_FOR_MASKED_LM), *assets, 0, false);
  EXPECT_TRUE(mlm.all_outputs());
  EXPECT_EQ(mlm.masked_lm().output(), "logits");
  EXPECT_EQ(mlm.masked_lm().mask_token_id(), kMask);
  EXPECT_EQ(mlm.masked_lm().top_k(), 5);
  EXPECT_EQ(mlm.masked_lm().vocab_limit(), 18);
  EXPECT_FALSE(InferWant(SmallPlan(v1::BERT_FOR_MASKED_LM), *assets, 3, true).all_outputs());
  EXPECT_EQ(InferWant(SmallPlan(v1::BERT_FOR_MASKED_LM), *assets, 3, true).masked_lm().top_k(), 3);

  v1::ForwardWant pretraining = InferWant(SmallPlan(v1::BERT_FOR_PRE_TRAINING), *assets, 0, true);
  EXPECT_EQ(pretraining.masked_lm().output(), "prediction_logits");
  EXPECT_EQ(Outputs(pretraining), (std::vector<std::string>{"seq_relationship_logits"}));

  v1::ForwardWant classify = InferWant(SmallPlan(v1::BERT_FOR_SEQUENCE_CLASSIFICATION), *assets, 0, true);
  EXPECT_EQ(Outputs(classify), (std::vector<std::string>{"logits"}));
  EXPECT_FALSE(classify.has_masked_lm());

  v1::ForwardWant qa = InferWant(SmallPlan(v1::BERT_FOR_QUESTION_ANSWERING), *assets, 0, true);
  EXPECT_EQ(qa.answer_spans().cls_token_id(), kCls);
  EXPECT_EQ(std::vector<int64_t>(qa.answer_spans().special_ids().begin(), qa.answer_spans().special_ids().end()),
            (std::vector<int64_t>{kCls, kSep, kPad}));

  v1::ForwardWant encoder = InferWant(SmallPlan(v1::BERT_MODEL), *assets, 0, false);
  EXPECT_TRUE(encoder.all_outputs());
  EXPECT_FALSE(encoder.has_embeddings() || encoder.has_masked_lm() || encoder.has_answer_spans());
}

TEST(Predict, MaskedLmFromTheWorkersTopKWithTokenTexts) {
  v1::ForwardRow row;
  v1::MaskTop* top = row.add_masks();
  top->set_position(2);
  top->add_ids(kPlay);
  top->add_ids(kThe);
  top->add_scores(0.625);
  top->add_scores(0.25);
  google::protobuf::RepeatedPtrField<v1::NamedTensor> no_outputs;
  auto p = Predict(SmallPlan(v1::BERT_FOR_MASKED_LM), *SmallAssets(), MaskedRow(), no_outputs, {row});
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_EQ(p->size(), 1u);
  ASSERT_EQ((*p)[0].masks_size(), 1);
  const v1::MaskPrediction& m = (*p)[0].masks(0);
  EXPECT_EQ(m.position(), 2);
  ASSERT_EQ(m.top_size(), 2);
  EXPECT_EQ(m.top(0).id(), kPlay);
  EXPECT_EQ(m.top(0).token(), "play");
  EXPECT_EQ(m.top(0).score(), 0.625f);
  EXPECT_EQ(m.top(1).token(), "the");
  // Rows that are not the batch's are no answer.
  EXPECT_EQ(Predict(SmallPlan(v1::BERT_FOR_MASKED_LM), *SmallAssets(), MaskedRow(), no_outputs, {}).status().code(),
            absl::StatusCode::kInternal);
}

TEST(Predict, AnswerSpanFromTheWorkersWithItsText) {
  v1::ForwardRow row;
  row.mutable_span()->set_start(1);
  row.mutable_span()->set_end(3);
  row.mutable_span()->set_score(0.5);
  google::protobuf::RepeatedPtrField<v1::NamedTensor> no_outputs;
  auto p = Predict(SmallPlan(v1::BERT_FOR_QUESTION_ANSWERING), *SmallAssets(), MaskedRow(), no_outputs, {row});
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_EQ(p->size(), 1u);
  EXPECT_EQ((*p)[0].answer().start(), 1);
  EXPECT_EQ((*p)[0].answer().end(), 3);
  EXPECT_EQ((*p)[0].answer().score(), 0.5f);
  // Positions 1..3 of the row, decoded by the checkpoint's tokenizer.
  EXPECT_EQ((*p)[0].answer().text(), SmallAssets()->tokenizer->Decode({kThe, kMask, kPlay}));
  row.mutable_span()->set_end(5);  // past the row
  EXPECT_EQ(Predict(SmallPlan(v1::BERT_FOR_QUESTION_ANSWERING), *SmallAssets(), MaskedRow(), no_outputs, {row})
                .status()
                .code(),
            absl::StatusCode::kInternal);
}

TEST(Predict, ClassificationFromTheLogits) {
  google::protobuf::RepeatedPtrField<v1::NamedTensor> outputs;
  v1::NamedTensor* logits = outputs.Add();
  logits->set_name("logits");
  logits->add_shape(1);
  logits->add_shape(2);
  logits->add_values(0.0f);
  logits->add_values(1.0f);
  auto p = Predict(SmallPlan(v1::BERT_FOR_SEQUENCE_CLASSIFICATION), *SmallAssets(), MaskedRow(), outputs, {});
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_EQ((*p)[0].labels_size(), 2);
  EXPECT_EQ((*p)[0].labels(0).label(), "LABEL_1");
  EXPECT_NEAR((*p)[0].labels(0).score(), 0.7310586, 1e-6);
  EXPECT_EQ(
      Predict(SmallPlan(v1::BERT_FOR_SEQUENCE_CLASSIFICATION), *SmallAssets(), MaskedRow(), {}, {}).status().code(),
      absl::StatusCode::kInternal);
}

TEST(SetEmbeddings, TheWorkersVectorsOnePerRow) {
  std::vector<v1::ForwardRow> rows(2);
  rows[0].add_embedding(0.25f);
  rows[1].add_embedding(-1.5f);
  v1::EmbedResponse response;
  ASSERT_TRUE(SetEmbeddings({serving::Pooling::kCls, true}, 2, rows, &response).ok());
  ASSERT_EQ(response.embeddings_size(), 2);
  EXPECT_EQ(response.embeddings(1).values(0), -1.5f);
  EXPECT_EQ(response.pooling(), v1::POOLING_CLS);
  EXPECT_TRUE(response.normalized());
  v1::EmbedResponse short_response;
  EXPECT_EQ(SetEmbeddings({}, 3, rows, &short_response).code(), absl::StatusCode::kInternal);
}

TEST(EmbedWant, ThePooledVectorsOnly) {
  v1::ForwardWant want = EmbedWant({serving::Pooling::kMeanSqrtLen, true});
  EXPECT_FALSE(want.all_outputs());
  EXPECT_EQ(want.outputs_size(), 0);
  EXPECT_EQ(want.embeddings().pooling(), "mean_sqrt_len");
  EXPECT_TRUE(want.embeddings().normalize());
}

TEST(ResolveEmbeddingMode, TheRequestOverridesTheCheckpoint) {
  serving::EmbeddingConfig config;
  config.pooling = serving::Pooling::kCls;
  config.normalize = true;
  v1::EmbedRequest request;
  auto same = ResolveEmbeddingMode(request, config);
  ASSERT_TRUE(same.ok());
  EXPECT_EQ(same->pooling, serving::Pooling::kCls);
  EXPECT_TRUE(same->normalize);
  request.set_pooling(v1::POOLING_MAX);
  request.set_normalize(v1::NORMALIZE_OFF);
  auto overridden = ResolveEmbeddingMode(request, config);
  ASSERT_TRUE(overridden.ok());
  EXPECT_EQ(overridden->pooling, serving::Pooling::kMax);
  EXPECT_FALSE(overridden->normalize);
  request.set_pooling(static_cast<v1::Pooling>(42));
  EXPECT_EQ(ResolveEmbeddingMode(request, config).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(TruncateEmbeddings, CutsEachVectorAndNormalisesItAgainWhenNormalised) {
  v1::EmbedResponse response;
  for (const std::vector<float>& v : {std::vector<float>{0.6f, 0.8f, 0.0f}, std::vector<float>{0.0f, 0.0f, 1.0f}}) {
    auto* values = response.add_embeddings()->mutable_values();
    for (const float x : v) values->Add(x);
  }
  response.set_normalized(true);
  v1::EmbedResponse cut = response;
  ASSERT_TRUE(TruncateEmbeddings(1, &cut).ok());
  EXPECT_EQ(cut.embeddings(0).values_size(), 1);
  EXPECT_FLOAT_EQ(cut.embeddings(0).values(0), 1.0f);  // 0.6 alone, normalised
  EXPECT_EQ(cut.embeddings(1).values(0), 0.0f);        // zero stays zero
  response.set_normalized(false);
  cut = response;
  ASSERT_TRUE(TruncateEmbeddings(2, &cut).ok());
  EXPECT_FLOAT_EQ(cut.embeddings(0).values(0), 0.6f);
  EXPECT_FLOAT_EQ(cut.embeddings(0).values(1), 0.8f);
  cut = response;
  ASSERT_TRUE(TruncateEmbeddings(0, &cut).ok());
  EXPECT_EQ(cut.embeddings(0).values_size(), 3);
  EXPECT_EQ(TruncateEmbeddings(4, &cut).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CheckDimensions(-1, 8).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(CheckDimensions(8, 8).ok());
}

// Two rows of a 3-token batch, as a rank of the last stage sends them for a sparse want.
v1::TokenInputs TwoRows() {
  v1::TokenInputs t;
  t.set_rows(2);
  t.set_seq(3);
  for (int i = 0; i < 2; ++i) {
    for (int64_t id : {kCls, kPlay, kSep}) {
      t.add_input_ids(id);
      t.add_attention_mask(1);
      t.add_token_type_ids(0);
    }
  }
  return t;
}

v1::ForwardWant SparseWant() {
  v1::ForwardWant want;
  want.mutable_sparse();
  return want;
}

// A ForwardRow with sparse entries (id, weight).
v1::ForwardRow SparseRow(const std::vector<std::pair<int32_t, float>>& entries) {
  v1::ForwardRow row;
  for (const auto& [id, weight] : entries) {
    row.add_sparse_indices(id);
    row.add_sparse_values(weight);
  }
  return row;
}

v1::ForwardResponse SparseResponse(const std::vector<v1::ForwardRow>& rows) {
  v1::ForwardResponse response;
  for (const v1::ForwardRow& row : rows) *response.add_rows() = row;
  return response;
}

std::vector<int32_t> Ids(const v1::ForwardRow& row) {
  return {row.sparse_indices().begin(), row.sparse_indices().end()};
}

std::vector<float> Weights(const v1::ForwardRow& row) {
  return {row.sparse_values().begin(), row.sparse_values().end()};
}

TEST(CheckForwardResponse, AcceptsSparseRowsThatFitTheVocabulary) {
  // SmallPlan's vocabulary is ids 0 .. 17; an empty row (a slice with no non-zero weight) fits too.
  const v1::ShardPlan plan = SmallPlan(v1::BERT_FOR_MASKED_LM);
  const v1::ForwardResponse good = SparseResponse({SparseRow({{0, 0.5f}, {5, 1e-6f}, {17, 3.0f}}), SparseRow({})});
  EXPECT_TRUE(CheckForwardResponse(plan, TwoRows(), SparseWant(), good).ok());
}

TEST(CheckForwardResponse, RefusesSparseRowsThatDoNotFit) {
  // The coordinator serves the ids as they come: a worker's wrong answer must stop here.
  const v1::ShardPlan plan = SmallPlan(v1::BERT_FOR_MASKED_LM);
  const v1::ForwardRow fine = SparseRow({{1, 1.0f}});
  const std::vector<std::pair<std::string, v1::ForwardRow>> bad = {
      {"ids not ascending", SparseRow({{5, 1.0f}, {3, 1.0f}})},
      {"a repeated id", SparseRow({{5, 1.0f}, {5, 1.0f}})},
      {"an id past the vocabulary", SparseRow({{18, 1.0f}})},
      {"a negative id", SparseRow({{-1, 1.0f}})},
      {"a zero weight", SparseRow({{2, 0.0f}})},
      {"a negative weight", SparseRow({{2, -0.5f}})},
      {"a NaN weight", SparseRow({{2, std::nanf("")}})},
      {"an infinite weight", SparseRow({{2, std::numeric_limits<float>::infinity()}})},
  };
  for (const auto& [what, row] : bad) {
    EXPECT_EQ(CheckForwardResponse(plan, TwoRows(), SparseWant(), SparseResponse({fine, row})).code(),
              absl::StatusCode::kInternal)
        << what;
  }
  v1::ForwardRow uneven = SparseRow({{1, 1.0f}, {2, 1.0f}});
  uneven.mutable_sparse_values()->RemoveLast();
  EXPECT_EQ(CheckForwardResponse(plan, TwoRows(), SparseWant(), SparseResponse({fine, uneven})).code(),
            absl::StatusCode::kInternal);
  v1::ForwardRow no_ids;
  no_ids.add_sparse_values(1.0f);
  EXPECT_EQ(CheckForwardResponse(plan, TwoRows(), SparseWant(), SparseResponse({fine, no_ids})).code(),
            absl::StatusCode::kInternal);
  // One row per input row.
  EXPECT_EQ(CheckForwardResponse(plan, TwoRows(), SparseWant(), SparseResponse({fine})).code(),
            absl::StatusCode::kInternal);
}

TEST(CheckForwardResponse, RefusesSparseEntriesTheWantDoesNotAskFor) {
  const v1::ShardPlan plan = SmallPlan(v1::BERT_FOR_MASKED_LM);
  v1::ForwardWant masked_lm;
  masked_lm.mutable_masked_lm()->set_output("logits");
  masked_lm.mutable_masked_lm()->set_top_k(1);
  const v1::ForwardResponse sparse = SparseResponse({SparseRow({{1, 1.0f}}), SparseRow({})});
  EXPECT_EQ(CheckForwardResponse(plan, TwoRows(), masked_lm, sparse).code(), absl::StatusCode::kInternal);
  // And rows at all when nothing per row was asked for.
  EXPECT_EQ(CheckForwardResponse(plan, TwoRows(), v1::ForwardWant(), sparse).code(), absl::StatusCode::kInternal);
  // Rows without sparse entries still pass a masked LM want.
  EXPECT_TRUE(CheckForwardResponse(plan, TwoRows(), masked_lm, SparseResponse({SparseRow({}), SparseRow({})})).ok());
}

TEST(JoinSparseRows, JoinsTwoRanksRowsInRankOrder) {
  // Rank 0 holds ids 0 .. 8, rank 1 ids 9 .. 17.
  std::vector<v1::ForwardRow> rows;
  v1::ForwardResponse rank0 = SparseResponse({SparseRow({{1, 0.5f}, {4, 1.5f}}), SparseRow({})});
  v1::ForwardResponse rank1 = SparseResponse({SparseRow({{9, 2.0f}}), SparseRow({{12, 0.25f}, {17, 0.75f}})});
  ASSERT_TRUE(JoinSparseRows(&rank0, &rows).ok());
  ASSERT_TRUE(JoinSparseRows(&rank1, &rows).ok());
  ASSERT_EQ(rows.size(), 2u);
  EXPECT_EQ(Ids(rows[0]), (std::vector<int32_t>{1, 4, 9}));
  EXPECT_EQ(Weights(rows[0]), (std::vector<float>{0.5f, 1.5f, 2.0f}));
  EXPECT_EQ(Ids(rows[1]), (std::vector<int32_t>{12, 17}));
  EXPECT_EQ(Weights(rows[1]), (std::vector<float>{0.25f, 0.75f}));
}

TEST(JoinSparseRows, MovesTheFirstRanksRowsIntoAnEmptyVector) {
  std::vector<v1::ForwardRow> rows;
  v1::ForwardResponse rank0 = SparseResponse({SparseRow({{3, 1.0f}}), SparseRow({{7, 2.0f}})});
  ASSERT_TRUE(JoinSparseRows(&rank0, &rows).ok());
  ASSERT_EQ(rows.size(), 2u);
  EXPECT_EQ(Ids(rows[0]), (std::vector<int32_t>{3}));
  EXPECT_EQ(Ids(rows[1]), (std::vector<int32_t>{7}));
  EXPECT_EQ(Weights(rows[1]), (std::vector<float>{2.0f}));
}

TEST(JoinSparseRows, AResponseWithoutRowsAddsNothing) {
  // A rank of another pipeline stage answers with no rows, before or after the last stage's ranks.
  std::vector<v1::ForwardRow> rows;
  v1::ForwardResponse other_stage;
  ASSERT_TRUE(JoinSparseRows(&other_stage, &rows).ok());
  EXPECT_TRUE(rows.empty());
  v1::ForwardResponse rank0 = SparseResponse({SparseRow({{3, 1.0f}})});
  ASSERT_TRUE(JoinSparseRows(&rank0, &rows).ok());
  ASSERT_TRUE(JoinSparseRows(&other_stage, &rows).ok());
  ASSERT_EQ(rows.size(), 1u);
  EXPECT_EQ(Ids(rows[0]), (std::vector<int32_t>{3}));
}

TEST(JoinSparseRows, RefusesOverlappingSlicesAndDifferentRowCounts) {
  std::vector<v1::ForwardRow> rows;
  v1::ForwardResponse rank0 = SparseResponse({SparseRow({{1, 1.0f}, {9, 1.0f}}), SparseRow({})});
  ASSERT_TRUE(JoinSparseRows(&rank0, &rows).ok());
  // Out of rank order (or overlapping slices), the joined ids would not ascend.
  v1::ForwardResponse overlapping = SparseResponse({SparseRow({{9, 1.0f}}), SparseRow({})});
  EXPECT_EQ(JoinSparseRows(&overlapping, &rows).code(), absl::StatusCode::kInternal);
  v1::ForwardResponse earlier = SparseResponse({SparseRow({{4, 1.0f}}), SparseRow({})});
  EXPECT_EQ(JoinSparseRows(&earlier, &rows).code(), absl::StatusCode::kInternal);
  v1::ForwardResponse one_row = SparseResponse({SparseRow({{12, 1.0f}})});
  EXPECT_EQ(JoinSparseRows(&one_row, &rows).code(), absl::StatusCode::kInternal);
  v1::ForwardResponse three_rows = SparseResponse({SparseRow({}), SparseRow({}), SparseRow({})});
  EXPECT_EQ(JoinSparseRows(&three_rows, &rows).code(), absl::StatusCode::kInternal);
}

TEST(SetSparseEmbeddings, FillsIndicesAndValuesOnePerRow) {
  std::vector<v1::ForwardRow> rows = {SparseRow({{2, 0.5f}, {11, 1.25f}}), SparseRow({})};
  v1::EmbedResponse response;
  ASSERT_TRUE(SetSparseEmbeddings(2, &rows, &response).ok());
  ASSERT_EQ(response.embeddings_size(), 2);
  EXPECT_EQ(std::vector<int32_t>(response.embeddings(0).indices().begin(), response.embeddings(0).indices().end()),
            (std::vector<int32_t>{2, 11}));
  EXPECT_EQ(std::vector<float>(response.embeddings(0).values().begin(), response.embeddings(0).values().end()),
            (std::vector<float>{0.5f, 1.25f}));
  EXPECT_EQ(response.embeddings(1).indices_size(), 0);
  EXPECT_EQ(response.embeddings(1).values_size(), 0);
  v1::EmbedResponse wrong;
  std::vector<v1::ForwardRow> one_row = {SparseRow({{2, 0.5f}})};
  EXPECT_EQ(SetSparseEmbeddings(2, &one_row, &wrong).code(), absl::StatusCode::kInternal);
}

}  // namespace
}  // namespace bertshard::server
