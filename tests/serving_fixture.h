// File: tests/serving_fixture.h
// -----------------------------------------------------------------------------
// What the serving tests share: random-weight checkpoints built or copied at test time (a
// 99-token vocabulary for tests/testdata/model's checkpoints, which have none), references
// computed here from raw outputs (sentence-transformers pooling, softmax, top-k), and ServingTest,
// the suite fixture whose tests share one cluster (tests/cluster_fixture.h's LocalCluster: a
// coordinator and five workers) serving four jobs:
//   - embed_job_: TP 2 BertModel with the bert-base-uncased vocabulary and sentence-transformers
//     files (CLS pooling + Normalize, max_seq_length 12);
//   - mlm_job_, cls_job_, qa_job_: TP 1 masked LM, sequence classifier (labels negative, neutral,
//     positive) and question answering, with the small vocabulary.
// The five workers are all busy with them, so one more job waits PENDING.
//
// Example:
//   TEST_F(ServingTest, Something) { v1::InferResponse r = InferText(mlm_job_, {"the [MASK]"}); }
//
// Failure model: a suite whose cluster or jobs did not come up fails every test with why (and the
// processes' logs) in SetUp; the helpers report RPC errors as test failures.
//
// Thread safety: the helpers may be called from several test threads at once; SetUpTestSuite and
// TearDownTestSuite run on gtest's main thread.
#ifndef BERTSHARD_TESTS_SERVING_FIXTURE_H_
#define BERTSHARD_TESTS_SERVING_FIXTURE_H_

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <numeric>
#include <string>
#include <vector>

#include "bertshard/v1/coordinator.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/cluster_fixture.h"
#include "tests/test_process.h"

namespace bertshard::testing {

namespace fs = std::filesystem;

inline constexpr char kModels[] = "tests/testdata/model/";
inline constexpr char kBertVocab[] = "tests/testdata/vocab/bert-base-uncased-vocab.txt";
inline constexpr float kTolerance = 1e-5f;
// The bert-base-uncased ids of the tokens the tokenizer adds.
inline constexpr int64_t kBertCls = 101, kBertSep = 102;
// The embedding checkpoint's sentence_bert_config.json max_seq_length.
inline constexpr int kEmbedMaxLength = 12;

// A 99-token vocabulary for the 99-token checkpoints of tests/testdata/model (which have none):
// the five special tokens at BERT's usual small-vocabulary ids ([MASK] = 4), then plain words.
inline const std::vector<std::string>& SmallVocab() {
  static const auto* vocab = [] {
    auto* v = new std::vector<std::string>{"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"};
    for (const char* w :
         {"the",   "a",     "cat",   "dog",   "sat",  "on",    "mat",   "ran",   "to",    "park",  "is",
          "was",   "big",   "small", "red",   "blue", "green", "house", "tree",  "bird",  "sky",   "sun",
          "moon",  "star",  "water", "fire",  "man",  "woman", "child", "book",  "read",  "write", "city",
          "river", "road",  "car",   "train", "fast", "slow",  "happy", "sad",   "good",  "bad",   "day",
          "night", "where", "what",  "who",   "when", "why",   "how",   "in",    "of",    "and",   "with",
          "at",    "by",    "from",  "it",    "he",   "she",   "they",  "we",    "you",   "eat",   "food",
          "apple", "bread", "milk",  "cold",  "hot",  "new",   "old",   "long",  "short", "high",  "low",
          "one",   "two",   "three", "four",  "five", "six",   "seven", "eight", "nine",  "ten"}) {
      v->push_back(w);
    }
    for (int i = static_cast<int>(v->size()); i < 99; ++i) v->push_back("w" + std::to_string(i));
    v->resize(99);
    return v;
  }();
  return *vocab;
}

inline int64_t SmallId(const std::string& word) {
  const auto& v = SmallVocab();
  return std::find(v.begin(), v.end(), word) - v.begin();
}

// `n` words of the small vocabulary, starting at word `from` (wrapping).
inline std::string Words(int from, int n) {
  std::string s;
  for (int i = 0; i < n; ++i) s += (i ? " " : "") + SmallVocab()[static_cast<size_t>(5 + (from + i) % 80)];
  return s;
}

// A copy of tests/testdata/model/`name` in `dir` with SmallVocab() as its vocab.txt; `edit`
// may change config.json. Returns the absolute directory.
inline std::string CopyWithSmallVocab(const std::string& name, const std::string& dir,
                                      const std::function<void(nlohmann::json*)>& edit = nullptr) {
  fs::create_directories(dir);
  fs::copy_file(kModels + name + "/model.safetensors", dir + "/model.safetensors",
                fs::copy_options::overwrite_existing);
  nlohmann::json config = nlohmann::json::parse(ReadAll(kModels + name + "/config.json"));
  if (edit) edit(&config);
  std::ofstream(dir + "/config.json") << config.dump(2) << "\n";
  std::ofstream vocab(dir + "/vocab.txt");
  for (const std::string& t : SmallVocab()) vocab << t << "\n";
  return fs::absolute(dir).string();
}

// A LocalCluster for a serving suite, as the serving tests have always run one: collectives may
// take 20 s (a slow batch on one thread), readopt_grace and drain_timeout are the coordinator's
// defaults, and answers up to 64 MiB (hidden states of big batches) come through.
inline LocalCluster* NewServingCluster(const std::string& name, std::vector<std::string> flags) {
  auto* cluster = new LocalCluster(name, std::move(flags));
  cluster->collective_timeout_s_ = "20";
  cluster->readopt_grace_ = "";
  cluster->drain_timeout_ = "";
  cluster->max_receive_message_bytes_ = 64 << 20;
  return cluster;
}

// SubmitJob of `checkpoint` with TP `tp`; the job id, or "" with *error extended on failure.
inline std::string SubmitTp(LocalCluster& cluster, const std::string& checkpoint, int tp, std::string* error) {
  v1::SubmitJobRequest submit;
  submit.mutable_request()->set_checkpoint(checkpoint);
  submit.mutable_request()->mutable_parallel()->set_tp_size(tp);
  v1::Job job;
  const grpc::Status s = cluster.stub().SubmitJob(Context().get(), submit, &job);
  if (!s.ok()) *error += "SubmitJob(" + checkpoint + "): " + s.error_message() + "\n";
  return job.id();
}

enum class Pool { kMean, kCls, kMax, kMeanSqrtLen };

// sentence-transformers' pooling (then Normalize), in double, from hidden states
// [rows, seq, dim] and the attention mask of the tokens that produced them.
inline std::vector<std::vector<double>> ReferencePool(const v1::NamedTensor& hidden, const v1::TokenInputs& tokens,
                                                      Pool pool, bool normalize) {
  const int64_t rows = hidden.shape(0), seq = hidden.shape(1), dim = hidden.shape(2);
  EXPECT_EQ(seq, tokens.seq());
  std::vector<std::vector<double>> out(static_cast<size_t>(rows), std::vector<double>(static_cast<size_t>(dim)));
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<double>& v = out[static_cast<size_t>(r)];
    auto h = [&](int64_t t, int64_t d) {
      return static_cast<double>(hidden.values(static_cast<int>((r * seq + t) * dim + d)));
    };
    auto mask = [&](int64_t t) { return tokens.attention_mask(static_cast<int>(r * seq + t)) != 0; };
    double count = 0;
    for (int64_t t = 0; t < seq; ++t) count += mask(t) ? 1 : 0;
    for (int64_t d = 0; d < dim; ++d) {
      double x = 0;
      switch (pool) {
        case Pool::kCls:
          x = h(0, d);
          break;
        case Pool::kMax:
          x = -1e300;
          for (int64_t t = 0; t < seq; ++t) x = std::max(x, mask(t) ? h(t, d) : -1e9);
          break;
        case Pool::kMean:
        case Pool::kMeanSqrtLen:
          for (int64_t t = 0; t < seq; ++t) x += mask(t) ? h(t, d) : 0.0;
          x /= pool == Pool::kMean ? count : std::sqrt(count);
          break;
      }
      v[static_cast<size_t>(d)] = x;
    }
    if (normalize) {
      double norm = 0;
      for (double x : v) norm += x * x;
      norm = std::sqrt(norm);
      for (double& x : v) x /= norm;
    }
  }
  return out;
}

inline double MaxDiff(const v1::EmbedResponse& got, const std::vector<std::vector<double>>& want) {
  if (got.embeddings_size() != static_cast<int>(want.size())) return 1e9;
  double m = 0;
  for (size_t r = 0; r < want.size(); ++r) {
    const auto& e = got.embeddings(static_cast<int>(r));
    if (e.values_size() != static_cast<int>(want[r].size())) return 1e9;
    for (size_t d = 0; d < want[r].size(); ++d) m = std::max(m, std::fabs(e.values(static_cast<int>(d)) - want[r][d]));
  }
  return m;
}

inline double MaxDiff(const v1::EmbedResponse& a, const v1::EmbedResponse& b) {
  std::vector<std::vector<double>> want;
  for (const auto& e : b.embeddings()) want.emplace_back(e.values().begin(), e.values().end());
  return MaxDiff(a, want);
}

inline double MaxDiff(const v1::NamedTensor& a, const v1::NamedTensor& b) {
  if (a.name() != b.name() || Shape(a) != Shape(b) || a.values_size() != b.values_size()) return 1e9;
  double m = 0;
  for (int i = 0; i < a.values_size(); ++i) m = std::max(m, static_cast<double>(std::fabs(a.values(i) - b.values(i))));
  return m;
}

// Per-row token counts (attention 1).
inline std::vector<int32_t> Counts(const v1::TokenInputs& t) {
  std::vector<int32_t> counts(static_cast<size_t>(t.rows()), 0);
  for (int64_t r = 0; r < t.rows(); ++r) {
    for (int64_t i = 0; i < t.seq(); ++i)
      counts[static_cast<size_t>(r)] += t.attention_mask(static_cast<int>(r * t.seq() + i)) != 0;
  }
  return counts;
}

inline std::vector<double> Softmax(const float* logits, int64_t n) {
  const double top = *std::max_element(logits, logits + n);
  std::vector<double> p(static_cast<size_t>(n));
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += p[static_cast<size_t>(i)] = std::exp(logits[i] - top);
  for (double& x : p) x /= sum;
  return p;
}

// Ids by probability, best first, ties by id.
inline std::vector<int64_t> Ranked(const std::vector<double>& p) {
  std::vector<int64_t> ids(p.size());
  std::iota(ids.begin(), ids.end(), 0);
  std::stable_sort(ids.begin(), ids.end(),
                   [&p](int64_t a, int64_t b) { return p[static_cast<size_t>(a)] > p[static_cast<size_t>(b)]; });
  return ids;
}

// ---------------------------------------------------------------------------------------------
// One cluster for the suite: jobs load once (a job per head, each TP 1; the embedding job TP 2).

class ServingTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    error_ = new std::string;
    const std::string dir = TempDir() + "/serving";
    fs::create_directories(dir);
    // The embedding model: random BertModel weights for the bert-base-uncased vocabulary (so real
    // English tokenises; vocab_size 30522 fits every id), with sentence-transformers files that
    // choose CLS pooling, a Normalize module and max_seq_length 12.
    embed_dir_ = fs::absolute(dir + "/embedder").string();
    Cli init = Shardctl({"init-checkpoint", "--variant", "BertModel", "--seed", "5", "--out", embed_dir_, "--vocab",
                         kBertVocab, "--config",
                         R"({"hidden_size": 32, "num_attention_heads": 4, "intermediate_size": 64,
                             "num_hidden_layers": 2, "max_position_embeddings": 64})"});
    if (init.exit_code != 0) {
      *error_ = "init-checkpoint: " + init.all();
      return;
    }
    std::ofstream(embed_dir_ + "/modules.json") << R"([
  {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
  {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
  {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}
])";
    fs::create_directories(embed_dir_ + "/1_Pooling");
    std::ofstream(embed_dir_ + "/1_Pooling/config.json") << R"({
  "word_embedding_dimension": 32,
  "pooling_mode_cls_token": true,
  "pooling_mode_mean_tokens": false,
  "pooling_mode_max_tokens": false,
  "pooling_mode_mean_sqrt_len_tokens": false,
  "pooling_mode_weightedmean_tokens": false,
  "pooling_mode_lasttoken": false
})";
    std::ofstream(embed_dir_ + "/sentence_bert_config.json")
        << R"({"max_seq_length": )" << kEmbedMaxLength << R"(, "do_lower_case": false})";

    mlm_dir_ = CopyWithSmallVocab("masked_lm_untied", dir + "/mlm");
    cls_dir_ = CopyWithSmallVocab("sequence_classification_f16", dir + "/classifier", [](nlohmann::json* c) {
      (*c)["id2label"] = {{"0", "negative"}, {"1", "neutral"}, {"2", "positive"}};
      (*c)["label2id"] = {{"negative", 0}, {"neutral", 1}, {"positive", 2}};
    });
    qa_dir_ = CopyWithSmallVocab("question_answering", dir + "/qa");

    cluster_ = NewServingCluster("serving", {});
    *error_ = cluster_->Start(5);
    if (!error_->empty()) return;
    embed_job_ = SubmitTp(*cluster_, embed_dir_, 2, error_);
    mlm_job_ = SubmitTp(*cluster_, mlm_dir_, 1, error_);
    cls_job_ = SubmitTp(*cluster_, cls_dir_, 1, error_);
    qa_job_ = SubmitTp(*cluster_, qa_dir_, 1, error_);
    if (!error_->empty()) return;
    for (const std::string& job : {embed_job_, mlm_job_, cls_job_, qa_job_}) *error_ += cluster_->WaitReady(job);
  }

  static void TearDownTestSuite() {
    delete cluster_;
    cluster_ = nullptr;
  }

  void SetUp() override { ASSERT_TRUE(error_ != nullptr && error_->empty()) << (error_ ? *error_ : ""); }

  static v1::Coordinator::Stub& stub() { return cluster_->stub(); }

  static v1::InferResponse Infer(const v1::InferRequest& request) {
    v1::InferResponse response;
    const grpc::Status s = stub().Infer(Context().get(), request, &response);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return response;
  }

  static v1::InferResponse InferText(const std::string& job, const std::vector<std::string>& texts,
                                     const std::vector<std::string>& pairs = {}, int top_k = 0) {
    v1::InferRequest request;
    request.set_job_id(job);
    for (const auto& t : texts) request.mutable_text()->add_texts(t);
    for (const auto& p : pairs) request.mutable_text()->add_text_pairs(p);
    request.set_top_k(top_k);
    return Infer(request);
  }

  static grpc::Status Embed(const v1::EmbedRequest& request, v1::EmbedResponse* response) {
    return stub().Embed(Context().get(), request, response);
  }

  static v1::EmbedRequest EmbedText(const std::vector<std::string>& texts,
                                    v1::Pooling pooling = v1::POOLING_UNSPECIFIED,
                                    v1::Normalize normalize = v1::NORMALIZE_UNSPECIFIED) {
    v1::EmbedRequest request;
    request.set_job_id(embed_job_);
    for (const auto& t : texts) request.mutable_text()->add_texts(t);
    request.set_pooling(pooling);
    request.set_normalize(normalize);
    return request;
  }

  inline static std::string* error_ = nullptr;
  inline static LocalCluster* cluster_ = nullptr;
  inline static std::string embed_dir_, mlm_dir_, cls_dir_, qa_dir_;
  inline static std::string embed_job_, mlm_job_, cls_job_, qa_job_;
};

}  // namespace bertshard::testing

#endif  // BERTSHARD_TESTS_SERVING_FIXTURE_H_
