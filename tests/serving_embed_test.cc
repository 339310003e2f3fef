// Embed end to end through the gRPC service (tests/serving_fixture.h's ServingTest: one cluster of
// five workers serving four jobs): Embed on the TP 2 BertModel job with the bert-base-uncased
// vocabulary and sentence-transformers files (CLS pooling + Normalize, max_seq_length 12) against
// pooling computed here from Infer's last_hidden_state, for text, pairs and tokens, and truncation
// only when asked; bad Embed and Infer requests and their exact codes and messages (unknown jobs,
// a PENDING job, enum values this build does not know, empty segments).
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "bertshard/v1/coordinator.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/serving_fixture.h"
#include "tests/test_process.h"

namespace bertshard {
namespace {

using testing::Context;
using testing::Counts;
using testing::FindOutput;
using testing::kBertCls;
using testing::kBertSep;
using testing::kEmbedMaxLength;
using testing::kTolerance;
using testing::MaxDiff;
using testing::Pool;
using testing::ReferencePool;
using testing::ServingTest;
using testing::Shape;
using testing::SmallId;
using testing::SubmitTp;
using testing::Words;

TEST_F(ServingTest, EmbedPoolsTheHiddenStatesOfInferAsAskedOrAsTheCheckpointSays) {
  const std::vector<std::string> texts = {"The quick brown fox jumps over the lazy dog.", "Hello, world!",
                                          "embeddings"};
  const v1::InferResponse infer = InferText(embed_job_, texts);
  const v1::NamedTensor* hidden = FindOutput(infer, "last_hidden_state");
  ASSERT_NE(hidden, nullptr) << infer.DebugString();
  EXPECT_EQ(Shape(*hidden), (std::vector<int64_t>{3, 12, 32}));  // [CLS] the quick ... dog . [SEP]: 12
  EXPECT_EQ(infer.predictions_size(), 0);                        // BertModel: no head
  // "hello" is 7592 in bert-base-uncased: the checkpoint's vocab.txt did the tokenising.
  ASSERT_GE(infer.tokens().input_ids_size(), 14);
  EXPECT_EQ(infer.tokens().input_ids(12), kBertCls);
  EXPECT_EQ(infer.tokens().input_ids(13), 7592);
  const std::vector<int32_t> counts = Counts(infer.tokens());
  EXPECT_EQ(counts, (std::vector<int32_t>{12, 6, 6}));  // hello , world ! / em ##bed ##ding ##s

  struct Case {
    v1::Pooling pooling;
    v1::Normalize normalize;
    Pool reference;
    bool normalized;
    v1::Pooling applied;
  };
  const Case cases[] = {
      // Unset: the checkpoint's 1_Pooling (CLS) and Normalize module.
      {v1::POOLING_UNSPECIFIED, v1::NORMALIZE_UNSPECIFIED, Pool::kCls, true, v1::POOLING_CLS},
      {v1::POOLING_UNSPECIFIED, v1::NORMALIZE_OFF, Pool::kCls, false, v1::POOLING_CLS},
      {v1::POOLING_MEAN, v1::NORMALIZE_UNSPECIFIED, Pool::kMean, true, v1::POOLING_MEAN},
      {v1::POOLING_MEAN, v1::NORMALIZE_OFF, Pool::kMean, false, v1::POOLING_MEAN},
      {v1::POOLING_CLS, v1::NORMALIZE_ON, Pool::kCls, true, v1::POOLING_CLS},
      {v1::POOLING_MAX, v1::NORMALIZE_OFF, Pool::kMax, false, v1::POOLING_MAX},
      {v1::POOLING_MAX, v1::NORMALIZE_ON, Pool::kMax, true, v1::POOLING_MAX},
      {v1::POOLING_MEAN_SQRT_LEN, v1::NORMALIZE_OFF, Pool::kMeanSqrtLen, false, v1::POOLING_MEAN_SQRT_LEN},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(v1::Pooling_Name(c.pooling) + " / " + v1::Normalize_Name(c.normalize));
    v1::EmbedResponse embed;
    const grpc::Status s = Embed(EmbedText(texts, c.pooling, c.normalize), &embed);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(embed.pooling(), c.applied);
    EXPECT_EQ(embed.normalized(), c.normalized);
    EXPECT_EQ(embed.max_length(), kEmbedMaxLength);  // sentence_bert_config.json, not max_position_embeddings 64
    EXPECT_EQ(std::vector<int32_t>(embed.token_counts().begin(), embed.token_counts().end()), counts);
    EXPECT_EQ(std::vector<bool>(embed.truncated().begin(), embed.truncated().end()), std::vector<bool>(3, false));
    ASSERT_EQ(embed.embeddings_size(), 3);
    EXPECT_EQ(embed.embeddings(0).values_size(), 32);
    EXPECT_LE(MaxDiff(embed, ReferencePool(*hidden, infer.tokens(), c.reference, c.normalized)), kTolerance);
    if (c.normalized) {
      for (const auto& e : embed.embeddings()) {
        double norm = 0;
        for (float x : e.values()) norm += static_cast<double>(x) * x;
        EXPECT_NEAR(std::sqrt(norm), 1.0, 1e-5);
      }
    }
    EXPECT_EQ(embed.batch().requests(), 1);
    EXPECT_EQ(embed.batch().rows(), 3);
    EXPECT_EQ(embed.batch().padded_tokens(), 3 * 12);
  }
}

TEST_F(ServingTest, EmbedTextPairsAndTokenRows) {
  // Pairs: segment B gets token type 1, exactly as Infer tokenises them.
  const v1::InferResponse infer = InferText(embed_job_, {"where is the cat?", "hi"}, {"on the mat.", "there"});
  const v1::NamedTensor* hidden = FindOutput(infer, "last_hidden_state");
  ASSERT_NE(hidden, nullptr);
  v1::EmbedRequest pairs = EmbedText({"where is the cat?", "hi"}, v1::POOLING_MEAN, v1::NORMALIZE_OFF);
  pairs.mutable_text()->add_text_pairs("on the mat.");
  pairs.mutable_text()->add_text_pairs("there");
  v1::EmbedResponse embed;
  grpc::Status s = Embed(pairs, &embed);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(std::vector<int32_t>(embed.token_counts().begin(), embed.token_counts().end()),
            (std::vector<int32_t>{12, 5}));  // [CLS] where is the cat ? [SEP] on the mat . [SEP]
  EXPECT_LE(MaxDiff(embed, ReferencePool(*hidden, infer.tokens(), Pool::kMean, false)), kTolerance);

  // Token rows with padding and a second segment.
  v1::TokenInputs tokens;
  tokens.set_rows(2);
  tokens.set_seq(7);
  for (int64_t id : {kBertCls, int64_t{1996}, int64_t{4937}, int64_t{2938}, kBertSep, int64_t{2182}, kBertSep, kBertCls,
                     int64_t{7592}, kBertSep, int64_t{0}, int64_t{0}, int64_t{0}, int64_t{0}}) {
    tokens.add_input_ids(id);
  }
  for (int64_t m : {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0}) tokens.add_attention_mask(m);
  for (int64_t t : {0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0}) tokens.add_token_type_ids(t);
  v1::InferRequest infer_tokens;
  infer_tokens.set_job_id(embed_job_);
  *infer_tokens.mutable_tokens() = tokens;
  const v1::InferResponse by_tokens = Infer(infer_tokens);
  const v1::NamedTensor* token_hidden = FindOutput(by_tokens, "last_hidden_state");
  ASSERT_NE(token_hidden, nullptr);
  for (v1::Pooling pooling : {v1::POOLING_UNSPECIFIED, v1::POOLING_MEAN, v1::POOLING_MAX}) {
    SCOPED_TRACE(v1::Pooling_Name(pooling));
    v1::EmbedRequest request;
    request.set_job_id(embed_job_);
    *request.mutable_tokens() = tokens;
    request.set_pooling(pooling);
    s = Embed(request, &embed);
    ASSERT_TRUE(s.ok()) << s.error_message();
    const Pool reference = pooling == v1::POOLING_MEAN  ? Pool::kMean
                           : pooling == v1::POOLING_MAX ? Pool::kMax
                                                        : Pool::kCls;
    EXPECT_LE(MaxDiff(embed, ReferencePool(*token_hidden, tokens, reference, true)), kTolerance);
    EXPECT_EQ(std::vector<int32_t>(embed.token_counts().begin(), embed.token_counts().end()),
              (std::vector<int32_t>{7, 3}));
    EXPECT_EQ(embed.truncated_size(), 0);  // token input is never cut
    EXPECT_TRUE(embed.normalized());
  }

  // A token row over max_seq_length (12) is refused even though max_position_embeddings is 64;
  // one that is long only in padding is not.
  v1::EmbedRequest long_row;
  long_row.set_job_id(embed_job_);
  long_row.mutable_tokens()->set_rows(1);
  long_row.mutable_tokens()->set_seq(14);
  for (int i = 0; i < 14; ++i) long_row.mutable_tokens()->add_input_ids(1000 + i);
  s = Embed(long_row, &embed);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_NE(s.error_message().find("14 tokens"), std::string::npos) << s.error_message();
  EXPECT_NE(s.error_message().find("max_seq_length"), std::string::npos) << s.error_message();
  for (int i = 0; i < 14; ++i) long_row.mutable_tokens()->add_attention_mask(i < 12 ? 1 : 0);
  s = Embed(long_row, &embed);
  EXPECT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(std::vector<int32_t>(embed.token_counts().begin(), embed.token_counts().end()), std::vector<int32_t>{12});
}

TEST_F(ServingTest, EmbedTruncatesOnlyWhenAsked) {
  const std::string long_text =
      "one two three four five six seven eight nine ten eleven twelve";  // 14 with [CLS]/[SEP]
  v1::EmbedResponse embed;
  grpc::Status s = Embed(EmbedText({"short", long_text}), &embed);
  ASSERT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_NE(s.error_message().find("text 1"), std::string::npos) << s.error_message();
  EXPECT_NE(s.error_message().find("14 tokens"), std::string::npos) << s.error_message();
  EXPECT_NE(s.error_message().find("at most 12"), std::string::npos) << s.error_message();
  EXPECT_NE(s.error_message().find("truncation"), std::string::npos) << s.error_message();

  v1::EmbedRequest truncating = EmbedText({"short", long_text}, v1::POOLING_MEAN, v1::NORMALIZE_OFF);
  truncating.set_truncate(true);
  s = Embed(truncating, &embed);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(std::vector<bool>(embed.truncated().begin(), embed.truncated().end()), (std::vector<bool>{false, true}));
  EXPECT_EQ(std::vector<int32_t>(embed.token_counts().begin(), embed.token_counts().end()),
            (std::vector<int32_t>{3, kEmbedMaxLength}));
  EXPECT_EQ(embed.batch().padded_tokens(), 2 * kEmbedMaxLength);

  // The cut keeps [CLS], the first ten words and [SEP]: the same vector as those tokens give.
  const v1::InferResponse whole = InferText(embed_job_, {long_text});  // Infer's limit is 64
  ASSERT_EQ(whole.tokens().seq(), 14);
  v1::InferRequest cut;
  cut.set_job_id(embed_job_);
  cut.mutable_tokens()->set_rows(1);
  cut.mutable_tokens()->set_seq(kEmbedMaxLength);
  for (int i = 0; i < kEmbedMaxLength - 1; ++i) cut.mutable_tokens()->add_input_ids(whole.tokens().input_ids(i));
  cut.mutable_tokens()->add_input_ids(kBertSep);
  const v1::InferResponse cut_out = Infer(cut);
  const v1::NamedTensor* hidden = FindOutput(cut_out, "last_hidden_state");
  ASSERT_NE(hidden, nullptr);
  const auto want = ReferencePool(*hidden, cut_out.tokens(), Pool::kMean, false);
  ASSERT_EQ(embed.embeddings_size(), 2);
  double diff = 0;
  for (int d = 0; d < 32; ++d)
    diff = std::max(diff, std::fabs(embed.embeddings(1).values(d) - want[0][static_cast<size_t>(d)]));
  EXPECT_LE(diff, kTolerance);
}

TEST_F(ServingTest, BadRequestsGetExactCodesAndClearMessages) {
  v1::EmbedResponse embed;
  auto expect = [](const grpc::Status& s, grpc::StatusCode code, std::vector<std::string> fragments) {
    EXPECT_EQ(s.error_code(), code) << s.error_message();
    for (const auto& f : fragments)
      EXPECT_NE(s.error_message().find(f), std::string::npos) << "'" << f << "' not in: " << s.error_message();
  };
  expect(Embed(EmbedText({"fine", ""}), &embed), grpc::StatusCode::INVALID_ARGUMENT, {"text 1", "empty"});
  expect(Embed(EmbedText({" \t\n "}), &embed), grpc::StatusCode::INVALID_ARGUMENT, {"text 0", "empty"});
  v1::EmbedRequest no_text = EmbedText({});
  no_text.mutable_text();
  expect(Embed(no_text, &embed), grpc::StatusCode::INVALID_ARGUMENT, {"at least one text"});
  v1::EmbedRequest no_input;
  no_input.set_job_id(embed_job_);
  expect(Embed(no_input, &embed), grpc::StatusCode::INVALID_ARGUMENT, {"tokens or text"});
  v1::EmbedRequest pairs = EmbedText({"a", "b"});
  pairs.mutable_text()->add_text_pairs("only one");
  expect(Embed(pairs, &embed), grpc::StatusCode::INVALID_ARGUMENT, {"text_pairs", "2 texts, 1 pairs"});
  // Enum values this build does not know (proto3 enums are open: a newer client may send them).
  expect(Embed(EmbedText({"a"}, static_cast<v1::Pooling>(42)), &embed), grpc::StatusCode::INVALID_ARGUMENT,
         {"unknown pooling 42"});
  expect(Embed(EmbedText({"a"}, v1::POOLING_MEAN, static_cast<v1::Normalize>(7)), &embed),
         grpc::StatusCode::INVALID_ARGUMENT, {"normalize 7"});
  v1::EmbedRequest bad_id;
  bad_id.set_job_id(embed_job_);
  bad_id.mutable_tokens()->set_rows(1);
  bad_id.mutable_tokens()->set_seq(3);
  for (int64_t id : {kBertCls, int64_t{30522}, kBertSep}) bad_id.mutable_tokens()->add_input_ids(id);  // == vocab_size
  expect(Embed(bad_id, &embed), grpc::StatusCode::INVALID_ARGUMENT, {"30522"});

  // A head's job has no hidden states to pool.
  v1::EmbedRequest on_mlm = EmbedText({"the cat"});
  on_mlm.set_job_id(mlm_job_);
  expect(Embed(on_mlm, &embed), grpc::StatusCode::FAILED_PRECONDITION, {"BertForMaskedLM", "BertModel"});

  // Unknown jobs: NOT_FOUND from both RPCs.
  v1::EmbedRequest unknown = EmbedText({"a"});
  unknown.set_job_id("job-that-does-not-exist");
  expect(Embed(unknown, &embed), grpc::StatusCode::NOT_FOUND, {"job-that-does-not-exist"});
  v1::InferRequest infer_unknown;
  infer_unknown.set_job_id("job-that-does-not-exist");
  infer_unknown.mutable_text()->add_texts("the cat");
  v1::InferResponse infer;
  expect(stub().Infer(Context().get(), infer_unknown, &infer), grpc::StatusCode::NOT_FOUND,
         {"job-that-does-not-exist"});

  // Infer's own checks.
  v1::InferRequest negative_k;
  negative_k.set_job_id(mlm_job_);
  negative_k.mutable_text()->add_texts("the [MASK]");
  negative_k.set_top_k(-1);
  expect(stub().Infer(Context().get(), negative_k, &infer), grpc::StatusCode::INVALID_ARGUMENT, {"top_k"});
  v1::InferRequest too_long;  // the masked LM takes 16 positions
  too_long.set_job_id(mlm_job_);
  too_long.mutable_text()->add_texts(Words(0, 20));
  expect(stub().Infer(Context().get(), too_long, &infer), grpc::StatusCode::INVALID_ARGUMENT,
         {"22 tokens", "at most 16", "truncation"});
  too_long.set_truncate(true);
  infer = Infer(too_long);
  ASSERT_EQ(infer.truncated_size(), 1);
  EXPECT_TRUE(infer.truncated(0));
  EXPECT_EQ(infer.tokens().seq(), 16);
  EXPECT_EQ(infer.tokens().input_ids(15), SmallId("[SEP]"));
  // A pair is cut longest first: 10 + 10 words in 13 places are 6 + 7.
  v1::InferRequest long_pair;
  long_pair.set_job_id(mlm_job_);
  long_pair.mutable_text()->add_texts(Words(0, 10));
  long_pair.mutable_text()->add_text_pairs(Words(40, 10));
  long_pair.set_truncate(true);
  infer = Infer(long_pair);
  ASSERT_EQ(infer.tokens().seq(), 16);
  std::vector<int64_t> want_ids = {SmallId("[CLS]")};
  for (int i = 0; i < 6; ++i) want_ids.push_back(SmallId(Words(i, 1)));
  want_ids.push_back(SmallId("[SEP]"));
  for (int i = 0; i < 7; ++i) want_ids.push_back(SmallId(Words(40 + i, 1)));
  want_ids.push_back(SmallId("[SEP]"));
  EXPECT_EQ(std::vector<int64_t>(infer.tokens().input_ids().begin(), infer.tokens().input_ids().end()), want_ids);
  EXPECT_EQ(std::vector<int64_t>(infer.tokens().token_type_ids().begin(), infer.tokens().token_type_ids().end()),
            (std::vector<int64_t>{0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1}));
  EXPECT_EQ(std::vector<bool>(infer.truncated().begin(), infer.truncated().end()), std::vector<bool>{true});
  v1::InferRequest empty_infer;
  empty_infer.set_job_id(mlm_job_);
  empty_infer.mutable_text()->add_texts("");
  expect(stub().Infer(Context().get(), empty_infer, &infer), grpc::StatusCode::INVALID_ARGUMENT, {"empty"});

  // A job that is not READY: every worker is busy, so a new one waits PENDING; then cancelled.
  std::string error;
  const std::string pending = SubmitTp(*cluster_, mlm_dir_, 1, &error);
  ASSERT_TRUE(error.empty()) << error;
  EXPECT_EQ(cluster_->GetJob(pending).state(), v1::PENDING);
  v1::InferRequest on_pending = infer_unknown;
  on_pending.set_job_id(pending);
  expect(stub().Infer(Context().get(), on_pending, &infer), grpc::StatusCode::FAILED_PRECONDITION,
         {pending, "PENDING", "READY"});
  v1::EmbedRequest embed_pending = EmbedText({"a"});
  embed_pending.set_job_id(pending);
  expect(Embed(embed_pending, &embed), grpc::StatusCode::FAILED_PRECONDITION, {"PENDING"});
  v1::GetJobRequest cancel;
  cancel.set_job_id(pending);
  v1::Job cancelled;
  ASSERT_TRUE(stub().CancelJob(Context().get(), cancel, &cancelled).ok());
  expect(stub().Infer(Context().get(), on_pending, &infer), grpc::StatusCode::FAILED_PRECONDITION, {"CANCELLED"});

  // None of it hurt the jobs.
  for (const std::string& job : {embed_job_, mlm_job_}) EXPECT_EQ(cluster_->GetJob(job).state(), v1::READY);
  EXPECT_TRUE(Embed(EmbedText({"still serving"}), &embed).ok());
}

// "A text that is empty after cleaning ... is refused" (server/input_preparation.cc): a literally empty
// first segment of a pair is, and a first segment of whitespace alone must be too, or it runs as
// [CLS] [SEP] pair [SEP].
TEST_F(ServingTest, PairWhoseFirstSegmentIsOnlyWhitespaceIsRefusedLikeAnEmptyOne) {
  for (const std::string& first : {std::string(""), std::string("   "), std::string("\t\n")}) {
    SCOPED_TRACE("first segment '" + first + "'");
    v1::EmbedRequest request = EmbedText({first});
    request.mutable_text()->add_text_pairs("the cat sat");
    v1::EmbedResponse embed;
    const grpc::Status s = Embed(request, &embed);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << (s.ok() ? "accepted, token_counts " + std::to_string(embed.token_counts(0)) : s.error_message());
    EXPECT_NE(s.error_message().find("text 0 is empty"), std::string::npos) << s.error_message();
  }
}

}  // namespace
}  // namespace bertshard
