#include "server/input_preparation.h"

#include <cstdio>
#include <string>
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

// Issue 21: 100 texts of 1 MiB with truncate cost 6.4 s of tokenising before the batch refused
// them. A text is tokenised only as far as max_length needs now, so this costs a few tokens per
// text and a UTF-8 check of the rest (the bound is loose: before, it took 50 s here).
TEST(PrepareInput, LongTextsWithTruncateAreTokenisedOnlyAsFarAsTheLimitNeeds) {
  const v1::ShardPlan plan = SmallPlan(v1::BERT_FOR_MASKED_LM);
  std::string long_text;
  while (long_text.size() < (1 << 20)) long_text += "the playing a unable ";
  v1::TextInput text;
  for (int i = 0; i < 100; ++i) text.add_texts(long_text);
  const absl::Time start = absl::Now();
  auto cut = PrepareInput(nullptr, &text, plan, *SmallAssets(), 16, true, {.max_tokens = 16384});
  const absl::Duration took = absl::Now() - start;
  ASSERT_TRUE(cut.ok()) << cut.status();
  EXPECT_EQ(cut->tokens.rows(), 100);
  EXPECT_EQ(cut->tokens.seq(), 16);
  EXPECT_EQ(cut->truncated, std::vector<bool>(100, true));
  // What HF gives: the first 14 pieces between [CLS] and [SEP].
  EXPECT_EQ(std::vector<int64_t>(cut->tokens.input_ids().begin(), cut->tokens.input_ids().begin() + 16),
            (std::vector<int64_t>{kCls, kThe, kPlay, 8, 6, 10, 11, kThe, kPlay, 8, 6, 10, 11, kThe, kPlay, kSep}));
  EXPECT_LT(took, absl::Seconds(10));
  std::printf("100 x 1 MiB texts with truncate: %.3f s\n", absl::ToDoubleSeconds(took));
  // Without truncate, refused just as fast, saying it is over the limit.
  const absl::Time refusing = absl::Now();
  auto refused = PrepareInput(nullptr, &text, plan, *SmallAssets(), 16, false, {.max_tokens = 16384});
  EXPECT_LT(absl::Now() - refusing, absl::Seconds(10));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("is at least 68 tokens"), std::string::npos) << refused.status();
}

TEST(PrepareInput, RequestsOverTheBoundsAreRefusedFromTheirCounts) {
  const v1::ShardPlan plan = SmallPlan(v1::BERT_FOR_MASKED_LM);
  const InputBounds bounds{.max_tokens = 30, .max_text_bytes = 20};
  // 11 texts take 33 tokens at least.
  v1::TextInput many;
  for (int i = 0; i < 11; ++i) many.add_texts("a");
  auto too_many = PrepareInput(nullptr, &many, plan, *SmallAssets(), 16, true, bounds);
  EXPECT_EQ(too_many.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(too_many.status().message().find("--max_batch_tokens"), std::string::npos) << too_many.status();
  v1::TextInput big = Texts({"the the the", "the the the"});
  big.add_text_pairs("a a a a a");
  big.add_text_pairs("a");
  auto too_big = PrepareInput(nullptr, &big, plan, *SmallAssets(), 16, true, bounds);
  EXPECT_EQ(too_big.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(too_big.status().message().find("are 32 bytes together, more than 20 (--max_request_text_bytes)"),
            std::string::npos)
      << too_big.status();
  // 4 x 8 token rows: 32 > 30, refused before the ids are read (they are out of range here).
  v1::TokenInputs rows;
  rows.set_rows(4);
  rows.set_seq(8);
  rows.mutable_input_ids()->Resize(32, 1000);
  auto too_long = PrepareInput(&rows, nullptr, plan, *SmallAssets(), 16, false, bounds);
  EXPECT_EQ(too_long.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(too_long.status().message().find("rows x seq = 4 x 8"), std::string::npos) << too_long.status();
  // Counts that overflow when multiplied are refused, not multiplied; so are arrays that do not fit
  // the counts, with the plan check's words.
  rows.set_rows(int64_t{1} << 40);
  rows.set_seq(int64_t{1} << 40);
  auto overflowing = PrepareInput(&rows, nullptr, plan, *SmallAssets(), 16, false, {});
  EXPECT_EQ(overflowing.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(overflowing.status().message().find("inputs need rows x seq values"), std::string::npos)
      << overflowing.status();
  // Within the bounds, as before.
  v1::TextInput fits = Texts({"the a", "play"});
  EXPECT_TRUE(PrepareInput(nullptr, &fits, plan, *SmallAssets(), 16, true, bounds).ok());
}

}  // namespace
}  // namespace bertshard::server
