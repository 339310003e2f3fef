#include "server/input_preparation.h"

#include <vector>

#include "gtest/gtest.h"
#include "server/serving_test_util.h"

namespace bertshard::server {
namespace {

std::vector<int64_t> Ids(const v1::TokenInputs& t) { return {t.input_ids().begin(), t.input_ids().end()}; }

v1::TextInput Texts(const std::vector<std::string>& texts) {
  v1::TextInput text;
  for (const auto& t : texts) text.add_texts(t);
  return text;
}

TEST(PrepareInput, TextIsTokenisedAndPaddedToTheLongest) {
  const v1::ShardPlan plan = SmallPlan(v1::BERT_FOR_MASKED_LM);
  const v1::TextInput text = Texts({"the playing", "a"});
  auto in = PrepareInput(nullptr, &text, plan, *SmallAssets(), 16, false);
  ASSERT_TRUE(in.ok()) << in.status();
  EXPECT_EQ(in->tokens.rows(), 2);
  EXPECT_EQ(in->tokens.seq(), 5);
  EXPECT_EQ(Ids(in->tokens), (std::vector<int64_t>{kCls, kThe, kPlay, 8, kSep, kCls, 6, kSep, kPad, kPad}));
  EXPECT_EQ(std::vector<int64_t>(in->tokens.attention_mask().begin(), in->tokens.attention_mask().end()),
            (std::vector<int64_t>{1, 1, 1, 1, 1, 1, 1, 1, 0, 0}));
  EXPECT_EQ(in->token_counts, (std::vector<int32_t>{5, 3}));
  EXPECT_EQ(in->truncated, (std::vector<bool>{false, false}));
}

TEST(PrepareInput, TooLongTextIsRefusedOrCutOnRequest) {
  const v1::ShardPlan plan = SmallPlan(v1::BERT_FOR_MASKED_LM);
  const v1::TextInput text = Texts({"the the the the"});
  auto refused = PrepareInput(nullptr, &text, plan, *SmallAssets(), 4, false);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  auto cut = PrepareInput(nullptr, &text, plan, *SmallAssets(), 4, true);
  ASSERT_TRUE(cut.ok()) << cut.status();
  EXPECT_EQ(Ids(cut->tokens), (std::vector<int64_t>{kCls, kThe, kThe, kSep}));
  EXPECT_EQ(cut->truncated, (std::vector<bool>{true}));
}

TEST(PrepareInput, TokenRowsGetDefaultMaskAndTypes) {
  const v1::ShardPlan plan = SmallPlan(v1::BERT_FOR_MASKED_LM);
  v1::TokenInputs tokens;
  tokens.set_rows(1);
  tokens.set_seq(3);
  for (int64_t id : {kCls, kMask, kSep}) tokens.add_input_ids(id);
  auto in = PrepareInput(&tokens, nullptr, plan, *SmallAssets(), 16, false);
  ASSERT_TRUE(in.ok()) << in.status();
  EXPECT_EQ(in->tokens.attention_mask_size(), 3);
  EXPECT_EQ(in->tokens.attention_mask(2), 1);
  EXPECT_EQ(in->tokens.token_type_ids(2), 0);
  EXPECT_EQ(in->token_counts, (std::vector<int32_t>{3}));
  EXPECT_TRUE(in->truncated.empty());
}

TEST(PrepareInput, RefusesWhatCannotRun) {
  const v1::ShardPlan plan = SmallPlan(v1::BERT_FOR_MASKED_LM);
  const auto assets = SmallAssets();
  EXPECT_EQ(PrepareInput(nullptr, nullptr, plan, *assets, 16, false).status().code(),
            absl::StatusCode::kInvalidArgument);
  const v1::TextInput empty = Texts({" \t"});
  EXPECT_EQ(PrepareInput(nullptr, &empty, plan, *assets, 16, false).status().code(),
            absl::StatusCode::kInvalidArgument);
  v1::TokenInputs unattended;
  unattended.set_rows(1);
  unattended.set_seq(2);
  unattended.add_input_ids(kCls);
  unattended.add_input_ids(kSep);
  unattended.add_attention_mask(0);
  unattended.add_attention_mask(0);
  EXPECT_EQ(PrepareInput(&unattended, nullptr, plan, *assets, 16, false).status().code(),
            absl::StatusCode::kInvalidArgument);
  v1::TokenInputs out_of_vocab = unattended;
  out_of_vocab.set_attention_mask(0, 1);
  out_of_vocab.set_input_ids(1, 99);
  EXPECT_EQ(PrepareInput(&out_of_vocab, nullptr, plan, *assets, 16, false).status().code(),
            absl::StatusCode::kInvalidArgument);
  const v1::TextInput text = Texts({"the"});
  JobAssets no_vocab;
  no_vocab.tokenizer_status = absl::NotFoundError("no vocab.txt");
  EXPECT_EQ(PrepareInput(nullptr, &text, plan, no_vocab, 16, false).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace bertshard::server
