#include "serving/heads.h"

#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

// Expected scores were computed with transformers 4.40.2 and torch 1.13 (tools/python_env.sh hf):
// torch.softmax / torch.sigmoid / topk in float64 on the same logits, as the pipelines'
// postprocess does, and, for question answering, the pipeline's own
// transformers.pipelines.question_answering.select_starts_ends on float32 logits with the p_mask
// the pipeline builds (context tokens 0, everything else 1, [CLS] set back to 0). Printed with 12
// significant digits.

namespace bertshard::serving {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

std::vector<std::pair<std::string, double>> Flatten(const std::vector<LabelScore>& scores) {
  std::vector<std::pair<std::string, double>> out;
  for (const LabelScore& s : scores) out.emplace_back(s.label, s.score);
  return out;
}

TEST(Classify, SoftmaxSortedWithLabelNames) {
  const std::vector<float> logits = {1.0f, 2.0f, 0.5f, 0.0f, 0.0f, -1.0f};
  auto out = Classify(logits, 2, 3, {"neg", "pos", "neutral"});
  ASSERT_TRUE(out.ok()) << out.status();
  ASSERT_EQ(out->size(), 2u);
  const auto& r0 = (*out)[0];
  ASSERT_EQ(r0.size(), 3u);
  EXPECT_EQ(r0[0].id, 1);
  EXPECT_EQ(r0[0].label, "pos");
  EXPECT_NEAR(r0[0].score, 0.628531719212, 1e-12);
  EXPECT_EQ(r0[1].label, "neg");
  EXPECT_NEAR(r0[1].score, 0.231223897622, 1e-12);
  EXPECT_EQ(r0[2].label, "neutral");
  EXPECT_NEAR(r0[2].score, 0.140244383166, 1e-12);
  // A tie keeps id order, as Python's stable sort in the pipeline.
  const auto& r1 = (*out)[1];
  EXPECT_EQ(r1[0].id, 0);
  EXPECT_EQ(r1[1].id, 1);
  EXPECT_NEAR(r1[0].score, 0.422318798252, 1e-12);
  EXPECT_NEAR(r1[2].score, 0.155362403497, 1e-12);
}

TEST(Classify, Sigmoid) {
  const std::vector<float> logits = {1.0f, 2.0f, 0.5f, 0.0f, 0.0f, -1.0f};
  auto out = Classify(logits, 2, 3, IndexLabels(3), ScoreFunction::kSigmoid);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(Flatten((*out)[0]).front().first, "1");
  EXPECT_NEAR((*out)[0][0].score, 0.880797077978, 1e-12);
  EXPECT_NEAR((*out)[0][1].score, 0.73105857863, 1e-12);
  EXPECT_NEAR((*out)[0][2].score, 0.622459331202, 1e-12);
  EXPECT_NEAR((*out)[1][2].score, 0.26894142137, 1e-12);
}

TEST(Classify, NextSentenceAndMultipleChoice) {
  // NSP: index 0 is "B follows A".
  auto nsp = Classify(std::vector<float>{3.0f, -1.0f}, 1, 2, NextSentenceLabels());
  ASSERT_TRUE(nsp.ok()) << nsp.status();
  EXPECT_EQ((*nsp)[0][0].label, "IsNext");
  EXPECT_EQ((*nsp)[0][1].label, "NotNext");
  // Multiple choice: [batch 1, choices 3].
  auto mc = Classify(std::vector<float>{0.1f, 0.9f, 0.3f}, 1, 3, IndexLabels(3));
  ASSERT_TRUE(mc.ok()) << mc.status();
  EXPECT_EQ((*mc)[0][0].label, "1");
  EXPECT_EQ((*mc)[0][0].id, 1);
  double total = 0;
  for (const LabelScore& s : (*mc)[0]) total += s.score;
  EXPECT_NEAR(total, 1.0, 1e-12);
}

TEST(Classify, RejectsInconsistentShapes) {
  const std::vector<float> logits(6, 0.0f);
  EXPECT_THAT(Classify(logits, 2, 3, {"a", "b"}).status().message(), HasSubstr("3 classes but 2 label names"));
  EXPECT_THAT(Classify(logits, 3, 3, IndexLabels(3)).status().message(), HasSubstr("needs 9"));
  EXPECT_EQ(Classify(logits, -1, 3, IndexLabels(3)).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Classify({}, 0, 0, {}).status().code(), absl::StatusCode::kInvalidArgument);
  auto empty = Classify({}, 0, 3, IndexLabels(3));
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_TRUE(empty->empty());
}

TEST(ClassifyTokens, BestLabelPerRealToken) {
  // [CLS]=101 a b [SEP]=102 [PAD]=0; the last position also has attention 0.
  const std::vector<int64_t> ids = {101, 7, 8, 102, 0};
  const std::vector<int64_t> mask = {1, 1, 1, 1, 0};
  const std::vector<float> logits = {9, 9, 0.2f, 1.5f, 2.0f, -1.0f, 9, 9, 9, 9};
  TokenRows tokens;
  tokens.rows = 1;
  tokens.seq = 5;
  tokens.input_ids = ids;
  tokens.attention_mask = mask;
  auto out = ClassifyTokens(logits, tokens, 2, {"O", "B-PER"}, {101, 102, 0});
  ASSERT_TRUE(out.ok()) << out.status();
  ASSERT_EQ((*out)[0].size(), 2u);
  const TokenLabel& a = (*out)[0][0];
  EXPECT_EQ(a.position, 1);
  EXPECT_EQ(a.token_id, 7);
  EXPECT_EQ(a.label_id, 1);
  EXPECT_EQ(a.label, "B-PER");
  EXPECT_NEAR(a.score, 0.785834982541, 1e-12);
  const TokenLabel& b = (*out)[0][1];
  EXPECT_EQ(b.position, 2);
  EXPECT_EQ(b.label, "O");
  EXPECT_NEAR(b.score, 0.952574126822, 1e-12);
}

TEST(ClassifyTokens, TieTakesTheFirstLabelAndShapesAreChecked) {
  const std::vector<int64_t> ids = {5};
  TokenRows tokens;
  tokens.rows = 1;
  tokens.seq = 1;
  tokens.input_ids = ids;
  auto out = ClassifyTokens(std::vector<float>{0.3f, 0.3f}, tokens, 2, {"x", "y"}, {});
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ((*out)[0][0].label, "x");
  EXPECT_DOUBLE_EQ((*out)[0][0].score, 0.5);
  EXPECT_THAT(ClassifyTokens(std::vector<float>{0.3f}, tokens, 2, {"x", "y"}, {}).status().message(),
              HasSubstr("[1, 1, 2] needs 2"));
  const std::vector<int64_t> two_ids = {5, 6};
  tokens.input_ids = two_ids;
  EXPECT_THAT(ClassifyTokens(std::vector<float>{0.3f, 0.3f}, tokens, 2, {"x", "y"}, {}).status().message(),
              HasSubstr("input ids hold 2 values"));
}

FillMaskOptions FillOptions(int64_t top_k, int64_t vocab_limit = 0) {
  FillMaskOptions options;
  options.top_k = top_k;
  options.vocab_limit = vocab_limit;
  return options;
}

// [1 row, 4 positions, vocab 6]: [CLS]=0 [MASK]=5 2 [MASK]=5.
const std::vector<float> kMlmLogits = {
    0,    0,    0,     0,    0,    0,  //
    0.1f, 3.0f, -1.0f, 2.5f, 3.0f, 0,  // first [MASK]: ids 1 and 4 tie
    0,    0,    0,     0,    0,    0,  //
    1,    1,    1,     1,    1,    6,  // second [MASK]
};
const std::vector<int64_t> kMlmIds = {0, 5, 2, 5};

TEST(MaskedLmTopK, TopKAtEachMask) {
  TokenRows tokens;
  tokens.rows = 1;
  tokens.seq = 4;
  tokens.input_ids = kMlmIds;
  const std::vector<std::string> vocab = {"[CLS]", "paris", "a", "lyon", "rome", "[MASK]"};
  auto out = MaskedLmTopK(kMlmLogits, 6, tokens, 5, FillOptions(3), [&](int64_t id) { return vocab[id]; });
  ASSERT_TRUE(out.ok()) << out.status();
  ASSERT_EQ((*out)[0].size(), 2u);
  const MaskFill& first = (*out)[0][0];
  EXPECT_EQ(first.position, 1);
  ASSERT_EQ(first.top.size(), 3u);
  // torch: softmax(...).topk(3) -> ids [1, 4, 3], probabilities below.
  EXPECT_EQ(first.top[0].id, 1);
  EXPECT_EQ(first.top[0].token, "paris");
  EXPECT_NEAR(first.top[0].score, 0.366346449851, 1e-12);
  EXPECT_EQ(first.top[1].id, 4);
  EXPECT_NEAR(first.top[1].score, 0.366346449851, 1e-12);
  EXPECT_EQ(first.top[2].id, 3);
  EXPECT_EQ(first.top[2].token, "lyon");
  EXPECT_NEAR(first.top[2].score, 0.222200353912, 1e-12);
  const MaskFill& second = (*out)[0][1];
  EXPECT_EQ(second.position, 3);
  EXPECT_EQ(second.top[0].id, 5);
  EXPECT_NEAR(second.top[0].score, 0.967408271694, 1e-12);
  // Five ids tie next (torch's topk order among them is unspecified); ours is id order.
  EXPECT_EQ(second.top[1].id, 0);
  EXPECT_EQ(second.top[2].id, 1);
  EXPECT_NEAR(second.top[1].score, 0.00651834566115, 1e-12);
}

TEST(MaskedLmTopK, VocabLimitKeepsWholeVocabularyProbabilities) {
  TokenRows tokens;
  tokens.rows = 1;
  tokens.seq = 4;
  tokens.input_ids = kMlmIds;
  auto out = MaskedLmTopK(kMlmLogits, 6, tokens, 5, FillOptions(10, 4));
  ASSERT_TRUE(out.ok()) << out.status();
  const MaskFill& first = (*out)[0][0];
  ASSERT_EQ(first.top.size(), 4u);  // k clamps to the candidates
  EXPECT_EQ(first.top[0].id, 1);
  EXPECT_EQ(first.top[1].id, 3);
  EXPECT_NEAR(first.top[1].score, 0.222200353912, 1e-12);
  EXPECT_EQ(first.top[0].token, "");
  // Id 5 (the best) is beyond the limit.
  EXPECT_EQ((*out)[0][1].top[0].id, 0);
  EXPECT_NEAR((*out)[0][1].top[0].score, 0.00651834566115, 1e-12);
}

TEST(MaskedLmTopK, SkipsMasksWithoutAttentionAndChecksInput) {
  const std::vector<int64_t> mask = {1, 1, 1, 0};
  TokenRows tokens;
  tokens.rows = 1;
  tokens.seq = 4;
  tokens.input_ids = kMlmIds;
  tokens.attention_mask = mask;
  auto out = MaskedLmTopK(kMlmLogits, 6, tokens, 5);
  ASSERT_TRUE(out.ok()) << out.status();
  ASSERT_EQ((*out)[0].size(), 1u);
  EXPECT_EQ((*out)[0][0].top.size(), 5u);  // the default top_k
  EXPECT_EQ(MaskedLmTopK(kMlmLogits, 6, tokens, 5, FillOptions(0)).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MaskedLmTopK(kMlmLogits, 6, tokens, 5, FillOptions(1, -1)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(MaskedLmTopK(kMlmLogits, 5, tokens, 5).status().message(), HasSubstr("[1, 4, 5] needs 20"));
  const std::vector<int64_t> bad_mask = {1, 1, 3, 0};
  tokens.attention_mask = bad_mask;
  EXPECT_THAT(MaskedLmTopK(kMlmLogits, 6, tokens, 5).status().message(), HasSubstr("value 3"));
}

// [CLS] q q [SEP] c c c c [SEP] [PAD] [PAD]; question tokens and padding have the largest logits,
// which must not win, and [CLS]'s logit takes probability mass from every span.
const std::vector<float> kStart = {5.0f, 9.0f, 0.5f, 1.0f, 1.0f, 3.0f, 0.2f, 2.0f, 7.0f, 8.0f, 8.0f};
const std::vector<float> kEnd = {4.0f, 9.0f, 0.1f, 1.0f, 0.5f, 1.0f, 2.5f, 3.0f, 7.0f, 8.0f, 8.0f};
const std::vector<int64_t> kQaIds = {101, 11, 12, 102, 21, 22, 23, 24, 102, 0, 0};
const std::vector<int64_t> kQaTypes = {0, 0, 0, 0, 1, 1, 1, 1, 1, 0, 0};
const std::vector<int64_t> kQaMask = {1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0};

TokenRows QaTokens() {
  TokenRows tokens;
  tokens.rows = 1;
  tokens.seq = 11;
  tokens.input_ids = kQaIds;
  tokens.token_type_ids = kQaTypes;
  tokens.attention_mask = kQaMask;
  return tokens;
}

QaOptions BertQa(int64_t max_answer_len = 15) {
  QaOptions options;
  options.max_answer_len = max_answer_len;
  options.cls_token_id = 101;
  options.special_ids = {101, 102, 0};
  return options;
}

TEST(QuestionAnswerSpans, MatchesThePipeline) {
  auto out = QuestionAnswerSpans(kStart, kEnd, QaTokens(), BertQa());
  ASSERT_TRUE(out.ok()) << out.status();
  ASSERT_EQ(out->size(), 1u);
  EXPECT_EQ((*out)[0].start, 5);
  EXPECT_EQ((*out)[0].end, 7);
  // Pipeline scores come from float32 softmaxes.
  EXPECT_NEAR((*out)[0].score, 0.0245899725705, 1e-8);
}

TEST(QuestionAnswerSpans, MaxAnswerLenBoundsTheSpan) {
  auto two = QuestionAnswerSpans(kStart, kEnd, QaTokens(), BertQa(2));
  ASSERT_TRUE(two.ok()) << two.status();
  EXPECT_EQ((*two)[0].start, 5);
  EXPECT_EQ((*two)[0].end, 6);
  EXPECT_NEAR((*two)[0].score, 0.0149145741016, 1e-8);
  auto one = QuestionAnswerSpans(kStart, kEnd, QaTokens(), BertQa(1));
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_EQ((*one)[0].start, 7);
  EXPECT_EQ((*one)[0].end, 7);
  EXPECT_NEAR((*one)[0].score, 0.00904614571482, 1e-8);
}

TEST(QuestionAnswerSpans, WithoutClsInTheSoftmax) {
  QaOptions options = BertQa();
  options.cls_token_id = -1;  // the pipeline's p_mask with [CLS] left at 1
  auto out = QuestionAnswerSpans(kStart, kEnd, QaTokens(), options);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ((*out)[0].start, 5);
  EXPECT_EQ((*out)[0].end, 7);
  EXPECT_NEAR((*out)[0].score, 0.350544512272, 1e-7);
}

TEST(QuestionAnswerSpans, SingleSegmentRowsUseEveryNonSpecialToken) {
  // [CLS] a b c [SEP], all token type 0; p_mask 1 only for [SEP] (and [CLS] kept).
  const std::vector<float> start = {1.0f, 0.0f, 2.0f, 1.0f, 5.0f};
  const std::vector<float> end = {1.0f, 1.0f, 0.0f, 2.0f, 5.0f};
  const std::vector<int64_t> ids = {101, 7, 8, 9, 102};
  TokenRows tokens;
  tokens.rows = 1;
  tokens.seq = 5;
  tokens.input_ids = ids;
  auto out = QuestionAnswerSpans(start, end, tokens, BertQa());
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ((*out)[0].start, 2);
  EXPECT_EQ((*out)[0].end, 3);
  EXPECT_NEAR((*out)[0].score, 0.28563323617, 1e-7);
}

TEST(QuestionAnswerSpans, RowsAreIndependentAndEmptyContextHasNoSpan) {
  // Row 0 as above; row 1 has a question but its context is only [SEP] (token type 1).
  std::vector<float> start = kStart, end = kEnd;
  start.insert(start.end(), kStart.begin(), kStart.end());
  end.insert(end.end(), kEnd.begin(), kEnd.end());
  std::vector<int64_t> ids = kQaIds, types = kQaTypes, mask = kQaMask;
  const std::vector<int64_t> ids1 = {101, 11, 12, 13, 14, 15, 16, 17, 102, 102, 0};
  const std::vector<int64_t> types1 = {0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0};
  const std::vector<int64_t> mask1 = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0};
  ids.insert(ids.end(), ids1.begin(), ids1.end());
  types.insert(types.end(), types1.begin(), types1.end());
  mask.insert(mask.end(), mask1.begin(), mask1.end());
  TokenRows tokens;
  tokens.rows = 2;
  tokens.seq = 11;
  tokens.input_ids = ids;
  tokens.token_type_ids = types;
  tokens.attention_mask = mask;
  auto out = QuestionAnswerSpans(start, end, tokens, BertQa());
  ASSERT_TRUE(out.ok()) << out.status();
  ASSERT_EQ(out->size(), 2u);
  EXPECT_EQ((*out)[0].start, 5);
  EXPECT_NEAR((*out)[0].score, 0.0245899725705, 1e-8);
  EXPECT_EQ((*out)[1].start, -1);
  EXPECT_EQ((*out)[1].end, -1);
  EXPECT_EQ((*out)[1].score, 0.0);
}

TEST(QuestionAnswerSpans, RejectsInconsistentInput) {
  EXPECT_EQ(QuestionAnswerSpans(kStart, kEnd, QaTokens(), BertQa(0)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(
      QuestionAnswerSpans(absl::MakeConstSpan(kStart).subspan(1), kEnd, QaTokens(), BertQa()).status().message(),
      HasSubstr("start logits hold 10 values"));
  EXPECT_THAT(
      QuestionAnswerSpans(kStart, absl::MakeConstSpan(kEnd).subspan(2), QaTokens(), BertQa()).status().message(),
      HasSubstr("end logits hold 9 values"));
  TokenRows tokens = QaTokens();
  tokens.token_type_ids = absl::MakeConstSpan(kQaTypes).subspan(1);
  EXPECT_THAT(QuestionAnswerSpans(kStart, kEnd, tokens, BertQa()).status().message(),
              HasSubstr("token type ids hold 10 values"));
  tokens = QaTokens();
  tokens.seq = 0;
  EXPECT_EQ(QuestionAnswerSpans(kStart, kEnd, tokens, BertQa()).status().code(), absl::StatusCode::kInvalidArgument);
}

class LabelsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::path(::testing::TempDir()) / (std::string("serving_heads_") + info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void WriteConfig(const std::string& text) { std::ofstream(dir_ / "config.json") << text; }
  std::string dir() const { return dir_.string(); }
  fs::path dir_;
};

TEST_F(LabelsTest, Id2Label) {
  WriteConfig(R"({"model_type": "bert", "id2label": {"1": "POSITIVE", "0": "NEGATIVE"},
                  "label2id": {"NEGATIVE": 0, "POSITIVE": 1}})");
  auto labels = ReadLabels(dir());
  ASSERT_TRUE(labels.ok()) << labels.status();
  EXPECT_EQ(labels->names, (std::vector<std::string>{"NEGATIVE", "POSITIVE"}));
  EXPECT_FALSE(labels->multi_label);
  EXPECT_EQ(DefaultScoreFunction(*labels), ScoreFunction::kSoftmax);
}

TEST_F(LabelsTest, DefaultsAsPretrainedConfig) {
  WriteConfig(R"({"model_type": "bert"})");
  auto labels = ReadLabels(dir());
  ASSERT_TRUE(labels.ok()) << labels.status();
  EXPECT_EQ(labels->names, (std::vector<std::string>{"LABEL_0", "LABEL_1"}));
  WriteConfig(R"({"num_labels": 3, "problem_type": "multi_label_classification"})");
  labels = ReadLabels(dir());
  ASSERT_TRUE(labels.ok()) << labels.status();
  EXPECT_EQ(labels->names, (std::vector<std::string>{"LABEL_0", "LABEL_1", "LABEL_2"}));
  EXPECT_TRUE(labels->multi_label);
  EXPECT_EQ(DefaultScoreFunction(*labels), ScoreFunction::kSigmoid);
  WriteConfig(R"({"id2label": {"0": "score"}})");
  labels = ReadLabels(dir());
  ASSERT_TRUE(labels.ok()) << labels.status();
  EXPECT_EQ(DefaultScoreFunction(*labels), ScoreFunction::kSigmoid);  // one output: regression-style
}

TEST_F(LabelsTest, BadConfigsNameTheFile) {
  EXPECT_THAT(ReadLabels(dir()).status().message(), HasSubstr("config.json"));
  WriteConfig("{");
  EXPECT_THAT(ReadLabels(dir()).status().message(), HasSubstr("config.json is not a JSON object"));
  WriteConfig(R"({"id2label": {"zero": "A"}})");
  EXPECT_THAT(ReadLabels(dir()).status().message(), HasSubstr("key \"zero\" is not an integer"));
  WriteConfig(R"({"id2label": {"0": "A", "2": "B"}})");
  EXPECT_THAT(ReadLabels(dir()).status().message(), HasSubstr("keys must be 0..1; it has 2"));
  WriteConfig(R"({"id2label": {"0": 5}})");
  EXPECT_THAT(ReadLabels(dir()).status().message(), HasSubstr("id2label[0] is not a string"));
  for (const char* bad : {R"({"id2label": {"0": "A"}, "x": [})", R"([1, 2])"}) {
    WriteConfig(bad);
    EXPECT_EQ(ReadLabels(dir()).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

// Issue 21: config.json's labels were read by path, a FIFO parking the reader for good. Refused at
// once now, as anything but a regular file is.
TEST_F(LabelsTest, AConfigThatIsAFifoIsRefusedAtOnce) {
  ASSERT_EQ(mkfifo((dir_ / "config.json").c_str(), 0600), 0);
  const absl::Status refused = ReadLabels(dir()).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.message(), HasSubstr("config.json is not a regular file"));
}

}  // namespace
}  // namespace bertshard::serving
