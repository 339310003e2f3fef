#include "worker/forward_outputs.h"

#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "serving/heads.h"
#include "serving/pooling.h"

namespace bertshard::worker {
namespace {

// Tokens [rows, seq]: row r has `lengths[r]` attended positions, then padding; `mask_at` puts
// [MASK] (id 4) at that position of every row.
v1::TokenInputs Tokens(const std::vector<int>& lengths, int64_t seq, int mask_at = -1) {
  v1::TokenInputs t;
  t.set_rows(static_cast<int64_t>(lengths.size()));
  t.set_seq(seq);
  t.set_choices(1);
  for (int length : lengths) {
    for (int64_t p = 0; p < seq; ++p) {
      t.add_input_ids(p == mask_at ? 4 : 10 + p);
      t.add_attention_mask(p < length ? 1 : 0);
      t.add_token_type_ids(0);
    }
  }
  return t;
}

// A tensor whose values vary with every index (and are never round).
v1::NamedTensor Tensor(const std::string& name, const std::vector<int64_t>& shape, float scale) {
  v1::NamedTensor t;
  t.set_name(name);
  int64_t n = 1;
  for (int64_t d : shape) {
    t.add_shape(d);
    n *= d;
  }
  for (int64_t i = 0; i < n; ++i) t.add_values(std::sin(scale * static_cast<float>(i + 1)) * 3.0f);
  return t;
}

absl::Span<const float> Values(const v1::NamedTensor& t) {
  return {t.values().data(), static_cast<size_t>(t.values_size())};
}

TEST(ApplyForwardWant, PoolsEachRowAsServingPoolAndDropsTheHiddenStates) {
  const v1::TokenInputs tokens = Tokens({3, 2}, 4);
  v1::ForwardResponse response;
  *response.add_outputs() = Tensor("last_hidden_state", {2, 4, 5}, 0.37f);
  const v1::NamedTensor hidden = response.outputs(0);
  v1::ForwardWant want;
  want.mutable_embeddings()->set_pooling("mean");
  want.mutable_embeddings()->set_normalize(true);
  ASSERT_TRUE(ApplyForwardWant(tokens, want, &response).ok());
  auto expected =
      serving::Pool(Values(hidden), 2, 4, 5, {tokens.attention_mask().data(), 8}, serving::Pooling::kMean, true);
  ASSERT_TRUE(expected.ok());
  ASSERT_EQ(response.rows_size(), 2);
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(response.rows(r).embedding_size(), 5);
    for (int d = 0; d < 5; ++d) EXPECT_EQ(response.rows(r).embedding(d), (*expected)[r][d]);  // bit for bit
  }
  EXPECT_EQ(response.outputs_size(), 0);
}

TEST(ApplyForwardWant, APaddedRowPoolsAsTheRowAlone) {
  // Batching pads a row to the batch's longest seq; its vector must not change.
  for (const char* pooling : {"mean", "cls", "max", "mean_sqrt_len"}) {
    v1::ForwardWant want;
    want.mutable_embeddings()->set_pooling(pooling);
    const v1::TokenInputs alone = Tokens({3}, 3);
    const v1::TokenInputs padded = Tokens({3}, 6);
    v1::NamedTensor full = Tensor("last_hidden_state", {1, 6, 4}, 0.11f);
    v1::NamedTensor cut = full;
    cut.set_shape(1, 3);
    cut.mutable_values()->Truncate(12);
    v1::ForwardResponse a, b;
    *a.add_outputs() = cut;
    *b.add_outputs() = full;
    ASSERT_TRUE(ApplyForwardWant(alone, want, &a).ok());
    ASSERT_TRUE(ApplyForwardWant(padded, want, &b).ok());
    ASSERT_EQ(a.rows_size(), 1);
    ASSERT_EQ(b.rows_size(), 1);
    for (int d = 0; d < 4; ++d) EXPECT_EQ(a.rows(0).embedding(d), b.rows(0).embedding(d)) << pooling;
  }
}

TEST(ApplyForwardWant, MaskedLmTopKAsServingAndOnlyTheNamedOutputs) {
  const v1::TokenInputs tokens = Tokens({4, 3}, 4, /*mask_at=*/1);
  v1::ForwardResponse response;
  *response.add_outputs() = Tensor("prediction_logits", {2, 4, 9}, 0.73f);
  *response.add_outputs() = Tensor("seq_relationship_logits", {2, 2}, 0.5f);
  const v1::NamedTensor logits = response.outputs(0);
  v1::ForwardWant want;
  want.add_outputs("seq_relationship_logits");
  want.mutable_masked_lm()->set_output("prediction_logits");
  want.mutable_masked_lm()->set_mask_token_id(4);
  want.mutable_masked_lm()->set_top_k(3);
  want.mutable_masked_lm()->set_vocab_limit(8);
  ASSERT_TRUE(ApplyForwardWant(tokens, want, &response).ok());
  serving::FillMaskOptions options;
  options.top_k = 3;
  options.vocab_limit = 8;
  const serving::TokenRows rows{2, 4, 1, {tokens.input_ids().data(), 8}, {tokens.attention_mask().data(), 8}, {}};
  auto expected = serving::MaskedLmTopK(Values(logits), 9, rows, 4, options);
  ASSERT_TRUE(expected.ok());
  ASSERT_EQ(response.rows_size(), 2);
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(response.rows(r).masks_size(), 1);
    const v1::MaskTop& top = response.rows(r).masks(0);
    EXPECT_EQ(top.position(), 1);
    ASSERT_EQ(top.ids_size(), 3);
    for (int j = 0; j < 3; ++j) {
      EXPECT_EQ(top.ids(j), (*expected)[r][0].top[j].id);
      EXPECT_EQ(top.scores(j), (*expected)[r][0].top[j].score);
    }
  }
  ASSERT_EQ(response.outputs_size(), 1);
  EXPECT_EQ(response.outputs(0).name(), "seq_relationship_logits");
}

TEST(ApplyForwardWant, AnswerSpansAsServing) {
  v1::TokenInputs tokens = Tokens({6, 5}, 6);
  for (int i = 0; i < 12; ++i) tokens.set_token_type_ids(i, i % 6 >= 2 ? 1 : 0);
  v1::ForwardResponse response;
  *response.add_outputs() = Tensor("start_logits", {2, 6}, 0.9f);
  *response.add_outputs() = Tensor("end_logits", {2, 6}, 1.3f);
  const v1::NamedTensor start = response.outputs(0), end = response.outputs(1);
  v1::ForwardWant want;
  want.set_all_outputs(true);
  want.mutable_answer_spans()->set_cls_token_id(10);
  want.mutable_answer_spans()->add_special_ids(10);
  ASSERT_TRUE(ApplyForwardWant(tokens, want, &response).ok());
  serving::QaOptions options;
  options.cls_token_id = 10;
  options.special_ids = {10};
  const serving::TokenRows rows{2,
                                6,
                                1,
                                {tokens.input_ids().data(), 12},
                                {tokens.attention_mask().data(), 12},
                                {tokens.token_type_ids().data(), 12}};
  auto expected = serving::QuestionAnswerSpans(Values(start), Values(end), rows, options);
  ASSERT_TRUE(expected.ok());
  ASSERT_EQ(response.rows_size(), 2);
  for (int r = 0; r < 2; ++r) {
    EXPECT_GE(response.rows(r).span().start(), 2);
    EXPECT_EQ(response.rows(r).span().start(), (*expected)[r].start);
    EXPECT_EQ(response.rows(r).span().end(), (*expected)[r].end);
    EXPECT_EQ(response.rows(r).span().score(), (*expected)[r].score);
  }
  EXPECT_EQ(response.outputs_size(), 2);  // all_outputs keeps them
}

TEST(ApplyForwardWant, MissingOutputIsInternal) {
  v1::ForwardResponse response;
  *response.add_outputs() = Tensor("logits", {1, 2}, 1.0f);
  v1::ForwardWant want;
  want.mutable_embeddings()->set_pooling("cls");
  EXPECT_EQ(ApplyForwardWant(Tokens({2}, 2), want, &response).code(), absl::StatusCode::kInternal);
}

TEST(CheckForwardWant, RefusesWhatCannotBeHonoured) {
  EXPECT_TRUE(CheckForwardWant(v1::ForwardWant()).ok());
  v1::ForwardWant pooling;
  pooling.mutable_embeddings()->set_pooling("weighted");
  EXPECT_EQ(CheckForwardWant(pooling).code(), absl::StatusCode::kInvalidArgument);
  v1::ForwardWant top_k;
  top_k.mutable_masked_lm()->set_output("logits");
  EXPECT_EQ(CheckForwardWant(top_k).code(), absl::StatusCode::kInvalidArgument);  // top_k 0
  top_k.mutable_masked_lm()->set_top_k(1);
  EXPECT_TRUE(CheckForwardWant(top_k).ok());
  top_k.mutable_masked_lm()->set_vocab_limit(-1);
  EXPECT_EQ(CheckForwardWant(top_k).code(), absl::StatusCode::kInvalidArgument);
  v1::ForwardWant unnamed;
  unnamed.mutable_masked_lm()->set_top_k(1);
  EXPECT_EQ(CheckForwardWant(unnamed).code(), absl::StatusCode::kInvalidArgument);
}

TEST(CheckForwardWant, SparseIsAskedAlone) {
  // A sparse forward returns no logits or hidden states, so nothing else can be honoured beside it.
  v1::ForwardWant alone;
  alone.mutable_sparse();
  EXPECT_TRUE(CheckForwardWant(alone).ok());
  std::vector<v1::ForwardWant> mixed(5, alone);
  mixed[0].set_all_outputs(true);
  mixed[1].add_outputs("logits");
  mixed[2].mutable_embeddings()->set_pooling("mean");
  mixed[3].mutable_masked_lm()->set_output("logits");
  mixed[3].mutable_masked_lm()->set_top_k(1);
  mixed[4].mutable_answer_spans()->set_cls_token_id(-1);
  for (size_t i = 0; i < mixed.size(); ++i) {
    EXPECT_EQ(CheckForwardWant(mixed[i]).code(), absl::StatusCode::kInvalidArgument) << i;
  }
}

// The (ids, weights) of a ForwardRow's sparse entries.
std::vector<std::pair<int32_t, float>> Entries(const v1::ForwardRow& row) {
  EXPECT_EQ(row.sparse_indices_size(), row.sparse_values_size());
  std::vector<std::pair<int32_t, float>> entries;
  for (int i = 0; i < row.sparse_indices_size() && i < row.sparse_values_size(); ++i) {
    entries.emplace_back(row.sparse_indices(i), row.sparse_values(i));
  }
  return entries;
}

TEST(AddSparseRows, KeepsOnlyTheNonZeroWeightsWithTheirVocabularyIdsAscending) {
  // This rank holds ids 100 .. 103; ids are the vocabulary's, not the slice's.
  const std::vector<float> weights = {0.0f, 1.5f,  0.0f, 0.25f,  //
                                      2.0f, 0.0f,  0.0f, 0.0f,   //
                                      0.5f, 0.75f, 1.0f, 1.25f};
  v1::ForwardResponse response;
  ASSERT_TRUE(AddSparseRows(weights, 3, 4, 100, &response).ok());
  ASSERT_EQ(response.rows_size(), 3);
  using Entry = std::pair<int32_t, float>;
  EXPECT_EQ(Entries(response.rows(0)), (std::vector<Entry>{{101, 1.5f}, {103, 0.25f}}));
  EXPECT_EQ(Entries(response.rows(1)), (std::vector<Entry>{{100, 2.0f}}));
  EXPECT_EQ(Entries(response.rows(2)), (std::vector<Entry>{{100, 0.5f}, {101, 0.75f}, {102, 1.0f}, {103, 1.25f}}));
  EXPECT_EQ(response.outputs_size(), 0);
}

TEST(AddSparseRows, AnAllZeroRowIsAnEmptyRow) {
  // The row is still sent, so that rows stay aligned with the inputs when joined across ranks.
  const std::vector<float> weights = {0.0f, 0.0f, 0.0f, 3.0f, 0.0f, 0.0f};
  v1::ForwardResponse response;
  ASSERT_TRUE(AddSparseRows(weights, 2, 3, 0, &response).ok());
  ASSERT_EQ(response.rows_size(), 2);
  EXPECT_EQ(response.rows(0).sparse_indices_size(), 0);
  EXPECT_EQ(response.rows(0).sparse_values_size(), 0);
  EXPECT_EQ(Entries(response.rows(1)), (std::vector<std::pair<int32_t, float>>{{0, 3.0f}}));
}

TEST(AddSparseRows, ASizeThatIsNotRowsTimesWidthIsInternal) {
  const std::vector<float> weights(5, 1.0f);
  v1::ForwardResponse response;
  EXPECT_EQ(AddSparseRows(weights, 2, 3, 0, &response).code(), absl::StatusCode::kInternal);
  EXPECT_EQ(AddSparseRows(weights, 1, 3, 0, &response).code(), absl::StatusCode::kInternal);
  EXPECT_EQ(AddSparseRows(weights, -1, -5, 0, &response).code(), absl::StatusCode::kInternal);
  EXPECT_EQ(response.rows_size(), 0);
}

TEST(AddSparseRows, WidthZeroGivesEmptyRows) {
  // A rank whose vocabulary slice holds only padding has no ids of its own, but still one row per
  // input row.
  v1::ForwardResponse response;
  ASSERT_TRUE(AddSparseRows({}, 2, 0, 30522, &response).ok());
  ASSERT_EQ(response.rows_size(), 2);
  for (int r = 0; r < 2; ++r) EXPECT_EQ(response.rows(r).sparse_indices_size(), 0);
}

}  // namespace
}  // namespace bertshard::worker
