// The heads' predictions end to end through the gRPC service (tests/serving_fixture.h's
// ServingTest: one cluster of five workers serving four jobs): fill-mask top-k, classifier labels
// and the question-answering span against softmax / top-k / span search computed here from the raw
// logits; and shardctl embed / infer / jobs printing the same embeddings and predictions.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "bertshard/v1/coordinator.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/serving_fixture.h"
#include "tests/test_process.h"

namespace bertshard {
namespace {

using testing::Cli;
using testing::FindOutput;
using testing::kEmbedMaxLength;
using testing::kTolerance;
using testing::Ranked;
using testing::ServingTest;
using testing::Shape;
using testing::Shardctl;
using testing::SmallId;
using testing::SmallVocab;
using testing::Softmax;
using testing::TempDir;

TEST_F(ServingTest, MaskedLmPredictionsAreTheTopKOfTheLogits) {
  for (int top_k : {0, 4}) {
    SCOPED_TRACE("top_k " + std::to_string(top_k));
    const int k = top_k == 0 ? 5 : top_k;
    const v1::InferResponse r =
        InferText(mlm_job_, {"the cat [MASK] on the [MASK]", "a dog ran to the [MASK] park"}, {}, top_k);
    const v1::NamedTensor* logits = FindOutput(r, "logits");
    ASSERT_NE(logits, nullptr);
    ASSERT_EQ(Shape(*logits), (std::vector<int64_t>{2, r.tokens().seq(), 99}));
    ASSERT_EQ(r.predictions_size(), 2);
    const int64_t seq = r.tokens().seq();
    for (int64_t row = 0; row < 2; ++row) {
      std::vector<int64_t> masks;
      for (int64_t t = 0; t < seq; ++t) {
        if (r.tokens().input_ids(static_cast<int>(row * seq + t)) == SmallId("[MASK]")) masks.push_back(t);
      }
      const v1::Prediction& p = r.predictions(static_cast<int>(row));
      ASSERT_EQ(p.masks_size(), static_cast<int>(masks.size()));
      EXPECT_EQ(masks.size(), row == 0 ? 2u : 1u);
      for (size_t m = 0; m < masks.size(); ++m) {
        const v1::MaskPrediction& got = p.masks(static_cast<int>(m));
        EXPECT_EQ(got.position(), masks[m]);
        const std::vector<double> probs = Softmax(logits->values().data() + (row * seq + masks[m]) * 99, 99);
        const std::vector<int64_t> ranked = Ranked(probs);
        ASSERT_EQ(got.top_size(), k);
        for (int j = 0; j < k; ++j) {
          EXPECT_EQ(got.top(j).id(), ranked[static_cast<size_t>(j)]) << "row " << row << " mask " << m << " rank " << j;
          EXPECT_EQ(got.top(j).token(), SmallVocab()[static_cast<size_t>(got.top(j).id())]);
          EXPECT_NEAR(got.top(j).score(), probs[static_cast<size_t>(got.top(j).id())], kTolerance);
        }
      }
      EXPECT_EQ(p.labels_size(), 0);
      EXPECT_FALSE(p.has_answer());
    }
  }
}

TEST_F(ServingTest, MaskedLmTopKBeyondTheVocabularyGivesEveryToken) {
  const v1::InferResponse r = InferText(mlm_job_, {"the [MASK]"}, {}, 1000);
  ASSERT_EQ(r.predictions_size(), 1);
  ASSERT_EQ(r.predictions(0).masks_size(), 1);
  const v1::MaskPrediction& m = r.predictions(0).masks(0);
  EXPECT_EQ(m.top_size(), 99);
  std::set<int64_t> ids;
  double sum = 0;
  for (const auto& t : m.top()) {
    ids.insert(t.id());
    sum += t.score();
  }
  EXPECT_EQ(ids.size(), 99u);
  EXPECT_NEAR(sum, 1.0, 1e-4);
}

TEST_F(ServingTest, ClassifierLabelsAreTheSoftmaxOfTheLogitsSortedWithConfigNames) {
  const std::vector<std::string> names = {"negative", "neutral", "positive"};
  const v1::InferResponse r = InferText(cls_job_, {"the cat sat on the mat", "a big red dog", "why"});
  const v1::NamedTensor* logits = FindOutput(r, "logits");
  ASSERT_NE(logits, nullptr);
  ASSERT_EQ(Shape(*logits), (std::vector<int64_t>{3, 3}));
  ASSERT_EQ(r.predictions_size(), 3);
  for (int row = 0; row < 3; ++row) {
    const std::vector<double> probs = Softmax(logits->values().data() + row * 3, 3);
    const std::vector<int64_t> ranked = Ranked(probs);
    const v1::Prediction& p = r.predictions(row);
    ASSERT_EQ(p.labels_size(), 3);
    double sum = 0;
    for (int j = 0; j < 3; ++j) {
      const v1::LabelScore& l = p.labels(j);
      EXPECT_EQ(l.id(), ranked[static_cast<size_t>(j)]) << "row " << row;
      EXPECT_EQ(l.label(), names[static_cast<size_t>(l.id())]);
      EXPECT_NEAR(l.score(), probs[static_cast<size_t>(l.id())], kTolerance);
      if (j > 0) {
        EXPECT_GE(p.labels(j - 1).score(), l.score());
      }
      sum += l.score();
    }
    EXPECT_NEAR(sum, 1.0, 1e-5);
  }
}

TEST_F(ServingTest, QuestionAnsweringSpanIsTheBestOneInTheContext) {
  const v1::InferResponse r = InferText(qa_job_, {"where is the cat", "who ran"},
                                        {"the cat sat on the mat in the house", "a dog ran to the park"});
  const v1::NamedTensor* start = FindOutput(r, "start_logits");
  const v1::NamedTensor* end = FindOutput(r, "end_logits");
  ASSERT_NE(start, nullptr);
  ASSERT_NE(end, nullptr);
  const int64_t seq = r.tokens().seq();
  ASSERT_EQ(Shape(*start), (std::vector<int64_t>{2, seq}));
  ASSERT_EQ(r.predictions_size(), 2);
  for (int64_t row = 0; row < 2; ++row) {
    auto at = [&](const google::protobuf::RepeatedField<int64_t>& f, int64_t t) {
      return f.Get(static_cast<int>(row * seq + t));
    };
    const v1::Prediction& p = r.predictions(static_cast<int>(row));
    ASSERT_TRUE(p.has_answer()) << "row " << row;
    const v1::AnswerSpan& a = p.answer();
    // Consistent: start <= end, within 15 tokens, both in the context (type 1, real, not [SEP]).
    EXPECT_LE(a.start(), a.end());
    EXPECT_LT(a.end() - a.start(), 15);
    for (int64_t t : {a.start(), a.end()}) {
      ASSERT_GE(t, 0);
      ASSERT_LT(t, seq);
      EXPECT_EQ(at(r.tokens().token_type_ids(), t), 1) << "position " << t;
      EXPECT_EQ(at(r.tokens().attention_mask(), t), 1) << "position " << t;
      EXPECT_NE(at(r.tokens().input_ids(), t), SmallId("[SEP]")) << "position " << t;
    }
    // The best such span by p(start) x p(end), as transformers' pipeline: other positions at
    // -10000 before the softmax ([CLS] stays in it), position 0 then zeroed.
    std::vector<bool> candidate(static_cast<size_t>(seq)), in_softmax(static_cast<size_t>(seq));
    std::vector<float> s(static_cast<size_t>(seq)), e(static_cast<size_t>(seq));
    for (int64_t t = 0; t < seq; ++t) {
      const int64_t id = at(r.tokens().input_ids(), t);
      const bool real = at(r.tokens().attention_mask(), t) == 1;
      candidate[t] = real && at(r.tokens().token_type_ids(), t) == 1 && id != SmallId("[SEP]") &&
                     id != SmallId("[PAD]") && id != SmallId("[CLS]");
      in_softmax[t] = candidate[t] || (real && id == SmallId("[CLS]"));
      s[t] = in_softmax[t] ? start->values(static_cast<int>(row * seq + t)) : -10000.0f;
      e[t] = in_softmax[t] ? end->values(static_cast<int>(row * seq + t)) : -10000.0f;
    }
    std::vector<double> ps = Softmax(s.data(), seq), pe = Softmax(e.data(), seq);
    ps[0] = pe[0] = 0;
    int64_t best_s = -1, best_e = -1;
    double best = -1;
    for (int64_t i = 1; i < seq; ++i) {
      for (int64_t j = i; j < std::min(seq, i + 15); ++j) {
        if (candidate[i] && candidate[j] && ps[i] * pe[j] > best) {
          best = ps[i] * pe[j];
          best_s = i;
          best_e = j;
        }
      }
    }
    EXPECT_EQ(a.start(), best_s) << "row " << row;
    EXPECT_EQ(a.end(), best_e) << "row " << row;
    EXPECT_NEAR(a.score(), best, kTolerance);
    std::string text;
    for (int64_t t = a.start(); t <= a.end(); ++t) {
      text += (t > a.start() ? " " : "") + SmallVocab()[static_cast<size_t>(at(r.tokens().input_ids(), t))];
    }
    EXPECT_EQ(a.text(), text);
  }
}

TEST_F(ServingTest, PredictionsOnlyAreTheSamePredictionsWithoutTheOutputs) {
  // The workers compute top-k and spans either way; predictions_only only leaves the outputs there.
  for (const std::string& job : {mlm_job_, cls_job_, qa_job_}) {
    SCOPED_TRACE(job);
    v1::InferRequest request;
    request.set_job_id(job);
    request.mutable_text()->add_texts("the cat [MASK] on the mat");
    request.mutable_text()->add_text_pairs("a dog ran to the park");
    const v1::InferResponse full = Infer(request);
    request.set_predictions_only(true);
    const v1::InferResponse only = Infer(request);
    EXPECT_GT(full.outputs_size(), 0);
    EXPECT_EQ(only.outputs_size(), 0);
    ASSERT_EQ(only.predictions_size(), full.predictions_size());
    for (int i = 0; i < full.predictions_size(); ++i) {
      EXPECT_EQ(only.predictions(i).SerializeAsString(), full.predictions(i).SerializeAsString()) << "row " << i;
    }
    EXPECT_GT(only.batch().response_bytes(), 0);
    if (job == cls_job_) {
      EXPECT_LE(only.batch().response_bytes(), full.batch().response_bytes());  // logits are its only output
    } else {
      EXPECT_LT(only.batch().response_bytes(), full.batch().response_bytes());
    }
  }
  // Embed: the vectors only, never the hidden states Infer returns.
  const v1::InferResponse infer = InferText(embed_job_, {"the cat sat on the mat"});
  v1::EmbedResponse embed;
  ASSERT_TRUE(Embed(EmbedText({"the cat sat on the mat"}), &embed).ok());
  const v1::NamedTensor* hidden = FindOutput(infer, "last_hidden_state");
  ASSERT_NE(hidden, nullptr);
  EXPECT_LT(embed.batch().response_bytes(), hidden->values_size() * static_cast<int64_t>(sizeof(float)) / 2);
}

TEST_F(ServingTest, ShardctlEmbedInferAndJobs) {
  const std::string server = cluster_->server();
  const std::string a = "the cat sat on the mat", b = "a dog ran in the park";
  v1::EmbedResponse rpc;
  ASSERT_TRUE(Embed(EmbedText({a, b}), &rpc).ok());
  ASSERT_EQ(rpc.embeddings_size(), 2);
  double dot = 0, n0 = 0, n1 = 0;
  for (int d = 0; d < 32; ++d) {
    const double x = rpc.embeddings(0).values(d), y = rpc.embeddings(1).values(d);
    dot += x * y;
    n0 += x * x;
    n1 += y * y;
  }
  const double cosine = dot / std::sqrt(n0 * n1);

  Cli table = Shardctl({"embed", embed_job_, server, a, b});
  ASSERT_EQ(table.exit_code, 0) << table.all();
  EXPECT_NE(table.out.find("2 embeddings of 32 dimensions (pooling cls, normalized, max length 12)"), std::string::npos)
      << table.out;
  EXPECT_NE(table.out.find("cosine similarity"), std::string::npos) << table.out;
  char row0[64], row1[64];
  std::snprintf(row0, sizeof row0, "%-5s %6.3f %6.3f\n", "[0]", 1.0, cosine);
  std::snprintf(row1, sizeof row1, "%-5s %6.3f %6.3f\n", "[1]", cosine, 1.0);
  EXPECT_NE(table.out.find(row0), std::string::npos) << row0 << " not in\n" << table.out;
  EXPECT_NE(table.out.find(row1), std::string::npos) << row1 << " not in\n" << table.out;

  Cli json =
      Shardctl({"embed", embed_job_, server, "--format", "json", "--pooling", "mean", "--normalize", "false", a, b});
  ASSERT_EQ(json.exit_code, 0) << json.all();
  nlohmann::json j = nlohmann::json::parse(json.out, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << json.out;
  ASSERT_EQ(j["embeddings"].size(), 2u) << json.out;
  EXPECT_EQ(j["embeddings"][0]["values"].size(), 32u);
  EXPECT_EQ(j["pooling"], "POOLING_MEAN");
  EXPECT_EQ(j["normalized"], false);
  EXPECT_EQ(j["max_length"], kEmbedMaxLength);
  EXPECT_EQ(j["token_counts"], nlohmann::json::array({8, 8}));
  v1::EmbedResponse mean;
  ASSERT_TRUE(Embed(EmbedText({a, b}, v1::POOLING_MEAN, v1::NORMALIZE_OFF), &mean).ok());
  double diff = 0;
  for (int r = 0; r < 2; ++r) {
    for (int d = 0; d < 32; ++d) {
      diff = std::max(diff, std::fabs(j["embeddings"][r]["values"][d].get<double>() - mean.embeddings(r).values(d)));
    }
  }
  EXPECT_LE(diff, kTolerance);

  const std::string lines = TempDir() + "/embed_lines.txt";
  std::ofstream(lines) << a << "\n\n" << b << "\n";  // blank lines are skipped
  Cli file = Shardctl({"embed", embed_job_, server, "--file", lines, "--format", "json"});
  ASSERT_EQ(file.exit_code, 0) << file.all();
  nlohmann::json from_file = nlohmann::json::parse(file.out, nullptr, false);
  ASSERT_FALSE(from_file.is_discarded()) << file.out;
  EXPECT_EQ(from_file["embeddings"].size(), 2u);
  EXPECT_EQ(from_file["pooling"], "POOLING_CLS");
  EXPECT_EQ(from_file["normalized"], true);
  EXPECT_EQ(Shardctl({"embed", embed_job_, server, "--format", "yaml", a}).exit_code, 2);
  EXPECT_EQ(Shardctl({"embed", embed_job_, server}).exit_code, 2);  // nothing to embed

  Cli bogus = Shardctl({"embed", embed_job_, server, "--pooling", "bogus", a});
  EXPECT_EQ(bogus.exit_code, 2) << bogus.all();
  EXPECT_NE(bogus.err.find("unknown --pooling 'bogus' (valid: mean, cls, max, mean_sqrt_len)"), std::string::npos)
      << bogus.all();
  const std::string long_text = "one two three four five six seven eight nine ten eleven twelve";
  Cli too_long = Shardctl({"embed", embed_job_, server, long_text});
  EXPECT_EQ(too_long.exit_code, 2) << too_long.all();
  EXPECT_NE(too_long.err.find("truncation"), std::string::npos) << too_long.all();
  Cli truncated = Shardctl({"embed", embed_job_, server, "--truncate", long_text});
  EXPECT_EQ(truncated.exit_code, 0) << truncated.all();
  EXPECT_NE(truncated.out.find(" 12 tokens (truncated)"), std::string::npos) << truncated.out;
  EXPECT_EQ(Shardctl({"embed", "no-such-job", server, a}).exit_code, 3);

  Cli fill = Shardctl({"infer", mlm_job_, server, "--text", "the cat [MASK] on the mat", "--top-k", "3"});
  ASSERT_EQ(fill.exit_code, 0) << fill.all();
  const v1::InferResponse want = InferText(mlm_job_, {"the cat [MASK] on the mat"}, {}, 3);
  ASSERT_EQ(want.predictions_size(), 1);
  ASSERT_EQ(want.predictions(0).masks_size(), 1);
  std::string line = "[MASK] at 3:";
  for (const auto& t : want.predictions(0).masks(0).top()) {
    char entry[96];
    std::snprintf(entry, sizeof entry, "  %s (%.4f)", t.token().c_str(), t.score());
    line += entry;
  }
  EXPECT_NE(fill.out.find(line + "\n"), std::string::npos) << line << " not in\n" << fill.out;
  EXPECT_EQ(Shardctl({"infer", mlm_job_, server, "--text", "x", "--top-k", "0"}).exit_code, 2);

  Cli qa = Shardctl({"infer", qa_job_, server, "--text", "where is the cat", "--text-pair", "the cat sat on the mat"});
  ASSERT_EQ(qa.exit_code, 0) << qa.all();
  const v1::InferResponse qa_want = InferText(qa_job_, {"where is the cat"}, {"the cat sat on the mat"});
  ASSERT_EQ(qa_want.predictions_size(), 1);
  const v1::AnswerSpan& span = qa_want.predictions(0).answer();
  char answer[256];
  std::snprintf(answer, sizeof answer, "answer: \"%s\" (tokens %lld..%lld, score %.4f)", span.text().c_str(),
                static_cast<long long>(span.start()), static_cast<long long>(span.end()), span.score());
  EXPECT_NE(qa.out.find(answer), std::string::npos) << answer << " not in\n" << qa.out;

  Cli jobs = Shardctl({"jobs", server});
  ASSERT_EQ(jobs.exit_code, 0) << jobs.all();
  for (const std::string cls :
       {"BertModel", "BertForMaskedLM", "BertForSequenceClassification", "BertForQuestionAnswering"}) {
    EXPECT_NE(jobs.out.find(" " + cls + " "), std::string::npos) << cls << " not in\n" << jobs.out;
  }
  EXPECT_EQ(jobs.out.find("(from checkpoint)"), std::string::npos) << jobs.out;
}

}  // namespace
}  // namespace bertshard
