// Serving end to end, through the real gRPC service: a coordinator and shard-worker processes on
// loopback serving random-weight checkpoints built or copied at test time.
//   ServingTest (5 workers, default batching): Embed on a TP 2 BertModel job with the
//     bert-base-uncased vocabulary and sentence-transformers files (CLS pooling + Normalize,
//     max_seq_length 12) against pooling computed here from Infer's last_hidden_state, text, pairs
//     and tokens; bad input and its exact codes; the heads' predictions (fill-mask top-k, labels,
//     QA span) against softmax / top-k / span search computed here from the raw logits; shardctl
//     embed / infer / jobs.
//   BatchingTest (3 workers, --max_batch_delay_ms=200 --max_batch_tokens=4096): concurrent
//     Infer and Embed calls merge and each equals the same request run alone; a request over
//     --max_batch_tokens is refused; a request whose deadline passes while it waits behind a slow
//     batch ends with DEADLINE_EXCEEDED, and the job keeps serving correctly.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <numeric>
#include <set>
#include <sstream>
#include <thread>

#include "bertshard/v1/coordinator.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/test_process.h"

namespace bertshard {
namespace {

namespace fs = std::filesystem;
using testing::ReadAll;
using testing::Spawn;
using testing::TempDir;
using testing::WaitExit;
using testing::WaitForPort;
using Clock = std::chrono::steady_clock;

constexpr char kModels[] = "tests/testdata/model/";
constexpr char kBertVocab[] = "tests/testdata/vocab/bert-base-uncased-vocab.txt";
constexpr float kTolerance = 1e-5f;
// The bert-base-uncased ids of the tokens the tokenizer adds.
constexpr int64_t kBertCls = 101, kBertSep = 102;
// The embedding checkpoint's sentence_bert_config.json max_seq_length.
constexpr int kEmbedMaxLength = 12;

std::unique_ptr<grpc::ClientContext> Context(std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
  auto c = std::make_unique<grpc::ClientContext>();
  c->set_deadline(std::chrono::system_clock::now() + timeout);
  return c;
}

struct Cli {
  int exit_code;
  std::string out, err;
  std::string all() const { return out + err; }
};

Cli Shardctl(std::vector<std::string> args) {
  args.insert(args.begin(), "client/shardctl");
  testing::Captured c = testing::Run(args);
  return {c.exit_code, c.out, c.err};
}

// A 99-token vocabulary for the 99-token checkpoints of tests/testdata/model (which have none):
// the five special tokens at BERT's usual small-vocabulary ids ([MASK] = 4), then plain words.
const std::vector<std::string>& SmallVocab() {
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

int64_t SmallId(const std::string& word) {
  const auto& v = SmallVocab();
  return std::find(v.begin(), v.end(), word) - v.begin();
}

// `n` words of the small vocabulary, starting at word `from` (wrapping).
std::string Words(int from, int n) {
  std::string s;
  for (int i = 0; i < n; ++i) s += (i ? " " : "") + SmallVocab()[static_cast<size_t>(5 + (from + i) % 80)];
  return s;
}

// A copy of tests/testdata/model/`name` in `dir` with SmallVocab() as its vocab.txt; `edit`
// may change config.json. Returns the absolute directory.
std::string CopyWithSmallVocab(const std::string& name, const std::string& dir,
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

// A coordinator and `workers` shard-worker processes on loopback.
class LocalCluster {
 public:
  LocalCluster(std::string name, int workers, std::vector<std::string> flags)
      : base_(TempDir() + "/" + std::move(name)), worker_count_(workers), flags_(std::move(flags)) {}
  ~LocalCluster() { Stop(); }

  // "" on success, else what went wrong (with the logs).
  std::string Start() {
    std::ofstream(base_ + ".log", std::ios::trunc).close();
    std::vector<std::string> args = {"server/bertshard-coordinator", "--listen=127.0.0.1:0", "--data_dir=" + base_,
                                     "--heartbeat_interval=1s", "--collective_timeout_s=20"};
    args.insert(args.end(), flags_.begin(), flags_.end());
    coordinator_ = Spawn(args, base_ + ".log");
    port_ = WaitForPort(base_ + ".log");
    if (port_ <= 0) return "the coordinator did not start: " + ReadAll(base_ + ".log");
    grpc::ChannelArguments channel_args;
    channel_args.SetMaxReceiveMessageSize(64 << 20);
    stub_ = v1::Coordinator::NewStub(grpc::CreateCustomChannel("127.0.0.1:" + std::to_string(port_),
                                                               grpc::InsecureChannelCredentials(), channel_args));
    for (int i = 0; i < worker_count_; ++i) {
      workers_.push_back(Spawn({"worker/shard-worker", "--listen=127.0.0.1:0", "--threads=1",
                                "--coordinator=127.0.0.1:" + std::to_string(port_)},
                               WorkerLog(i)));
    }
    for (int i = 0; i < 400; ++i) {
      v1::ListWorkersResponse list;
      if (stub_->ListWorkers(Context().get(), v1::ListWorkersRequest(), &list).ok()) {
        int healthy = 0;
        for (const auto& w : list.workers()) healthy += w.healthy() ? 1 : 0;
        if (healthy >= worker_count_) return "";
      }
      usleep(50 * 1000);
    }
    return "the workers did not register: " + Logs();
  }

  void Stop() {
    for (pid_t w : workers_) kill(w, SIGTERM);
    for (pid_t w : workers_) WaitExit(w);
    workers_.clear();
    if (coordinator_ > 0) {
      kill(coordinator_, SIGTERM);
      WaitExit(coordinator_);
      coordinator_ = -1;
    }
  }

  std::string Logs() const {
    std::string logs = "--- coordinator:\n" + ReadAll(base_ + ".log");
    for (int i = 0; i < worker_count_; ++i) logs += "--- worker " + std::to_string(i) + ":\n" + ReadAll(WorkerLog(i));
    return logs;
  }

  v1::Coordinator::Stub& stub() { return *stub_; }
  std::string server() const { return "--server=127.0.0.1:" + std::to_string(port_); }

  // SubmitJob with TP `tp`; "" and *error set on failure.
  std::string Submit(const std::string& checkpoint, int tp, std::string* error) {
    v1::SubmitJobRequest submit;
    submit.mutable_request()->set_checkpoint(checkpoint);
    submit.mutable_request()->mutable_parallel()->set_tp_size(tp);
    v1::Job job;
    const grpc::Status s = stub_->SubmitJob(Context().get(), submit, &job);
    if (!s.ok()) *error += "SubmitJob(" + checkpoint + "): " + s.error_message() + "\n";
    return job.id();
  }

  // Waits for the job to settle; "" if READY, else why not.
  std::string WaitReady(const std::string& id) {
    v1::GetJobRequest request;
    request.set_job_id(id);
    auto context = Context(std::chrono::seconds(120));
    auto reader = stub_->WatchJob(context.get(), request);
    v1::JobEvent event, last;
    while (reader->Read(&event)) last = event;
    const grpc::Status s = reader->Finish();
    if (!s.ok()) return "WatchJob(" + id + "): " + s.error_message();
    if (last.job().state() != v1::READY) {
      return "job " + id + " is " + v1::JobState_Name(last.job().state()) + ": " + last.job().failure_cause() + "\n" +
             Logs();
    }
    return "";
  }

  v1::Job GetJob(const std::string& id) {
    v1::GetJobRequest get;
    get.set_job_id(id);
    v1::Job job;
    EXPECT_TRUE(stub_->GetJob(Context().get(), get, &job).ok());
    return job;
  }

 private:
  std::string WorkerLog(int i) const { return base_ + "-worker" + std::to_string(i) + ".log"; }

  const std::string base_;
  const int worker_count_;
  const std::vector<std::string> flags_;
  pid_t coordinator_ = -1;
  int port_ = 0;
  std::vector<pid_t> workers_;
  std::unique_ptr<v1::Coordinator::Stub> stub_;
};

const v1::NamedTensor* FindOutput(const v1::InferResponse& r, const std::string& name) {
  for (const auto& t : r.outputs()) {
    if (t.name() == name) return &t;
  }
  return nullptr;
}

std::vector<int64_t> Shape(const v1::NamedTensor& t) { return {t.shape().begin(), t.shape().end()}; }

enum class Pool { kMean, kCls, kMax, kMeanSqrtLen };

// sentence-transformers' pooling (then Normalize), in double, from hidden states
// [rows, seq, dim] and the attention mask of the tokens that produced them.
std::vector<std::vector<double>> ReferencePool(const v1::NamedTensor& hidden, const v1::TokenInputs& tokens, Pool pool,
                                               bool normalize) {
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

double MaxDiff(const v1::EmbedResponse& got, const std::vector<std::vector<double>>& want) {
  if (got.embeddings_size() != static_cast<int>(want.size())) return 1e9;
  double m = 0;
  for (size_t r = 0; r < want.size(); ++r) {
    const auto& e = got.embeddings(static_cast<int>(r));
    if (e.values_size() != static_cast<int>(want[r].size())) return 1e9;
    for (size_t d = 0; d < want[r].size(); ++d) m = std::max(m, std::fabs(e.values(static_cast<int>(d)) - want[r][d]));
  }
  return m;
}

double MaxDiff(const v1::EmbedResponse& a, const v1::EmbedResponse& b) {
  std::vector<std::vector<double>> want;
  for (const auto& e : b.embeddings()) want.emplace_back(e.values().begin(), e.values().end());
  return MaxDiff(a, want);
}

double MaxDiff(const v1::NamedTensor& a, const v1::NamedTensor& b) {
  if (a.name() != b.name() || Shape(a) != Shape(b) || a.values_size() != b.values_size()) return 1e9;
  double m = 0;
  for (int i = 0; i < a.values_size(); ++i) m = std::max(m, static_cast<double>(std::fabs(a.values(i) - b.values(i))));
  return m;
}

// Per-row token counts (attention 1).
std::vector<int32_t> Counts(const v1::TokenInputs& t) {
  std::vector<int32_t> counts(static_cast<size_t>(t.rows()), 0);
  for (int64_t r = 0; r < t.rows(); ++r) {
    for (int64_t i = 0; i < t.seq(); ++i)
      counts[static_cast<size_t>(r)] += t.attention_mask(static_cast<int>(r * t.seq() + i)) != 0;
  }
  return counts;
}

std::vector<double> Softmax(const float* logits, int64_t n) {
  const double top = *std::max_element(logits, logits + n);
  std::vector<double> p(static_cast<size_t>(n));
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += p[static_cast<size_t>(i)] = std::exp(logits[i] - top);
  for (double& x : p) x /= sum;
  return p;
}

// Ids by probability, best first, ties by id.
std::vector<int64_t> Ranked(const std::vector<double>& p) {
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

    cluster_ = new LocalCluster("serving", 5, {});
    *error_ = cluster_->Start();
    if (!error_->empty()) return;
    embed_job_ = cluster_->Submit(embed_dir_, 2, error_);
    mlm_job_ = cluster_->Submit(mlm_dir_, 1, error_);
    cls_job_ = cluster_->Submit(cls_dir_, 1, error_);
    qa_job_ = cluster_->Submit(qa_dir_, 1, error_);
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
  const std::string pending = cluster_->Submit(mlm_dir_, 1, &error);
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

// ---------------------------------------------------------------------------------------------
// Dynamic batching: the first request of a batch waits 200 ms for company, so concurrent calls
// surely merge; a batch holds at most 4096 padded tokens.

constexpr int kMaxBatchTokens = 4096;

class BatchingTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    error_ = new std::string;
    const std::string dir = TempDir() + "/batching";
    fs::create_directories(dir);
    // bert_model: BertModel, 99 tokens, 16 positions; no sentence-transformers files.
    small_dir_ = CopyWithSmallVocab("bert_model", dir + "/small");
    // Big enough that a batch of 8 x 512 tokens takes a while on one thread.
    slow_dir_ = fs::absolute(dir + "/slow").string();
    Cli init = Shardctl({"init-checkpoint", "--variant", "BertModel", "--seed", "3", "--out", slow_dir_, "--config",
                         R"({"vocab_size": 1000, "hidden_size": 256, "num_attention_heads": 4,
                             "intermediate_size": 1024, "num_hidden_layers": 8, "max_position_embeddings": 512})"});
    if (init.exit_code != 0) {
      *error_ = "init-checkpoint: " + init.all();
      return;
    }
    // A sentence-transformers model with a Dense module after the pooling: serving it without the
    // Dense layer would give wrong vectors, so Embed must refuse it.
    dense_dir_ = CopyWithSmallVocab("bert_model", dir + "/dense");
    std::ofstream(dense_dir_ + "/modules.json") << R"([
  {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
  {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
  {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}
])";
    fs::create_directories(dense_dir_ + "/1_Pooling");
    std::ofstream(dense_dir_ + "/1_Pooling/config.json")
        << R"({"word_embedding_dimension": 32, "pooling_mode_mean_tokens": true})";
    cluster_ = new LocalCluster("batching", 4,
                                {"--max_batch_delay_ms=200", "--max_batch_tokens=" + std::to_string(kMaxBatchTokens)});
    *error_ = cluster_->Start();
    if (!error_->empty()) return;
    small_job_ = cluster_->Submit(small_dir_, 2, error_);
    slow_job_ = cluster_->Submit(slow_dir_, 1, error_);
    dense_job_ = cluster_->Submit(dense_dir_, 1, error_);
    if (!error_->empty()) return;
    for (const std::string& job : {small_job_, slow_job_, dense_job_}) *error_ += cluster_->WaitReady(job);
  }

  static void TearDownTestSuite() {
    delete cluster_;
    cluster_ = nullptr;
  }

  void SetUp() override { ASSERT_TRUE(error_ != nullptr && error_->empty()) << (error_ ? *error_ : ""); }

  static v1::Coordinator::Stub& stub() { return cluster_->stub(); }

  inline static std::string* error_ = nullptr;
  inline static LocalCluster* cluster_ = nullptr;
  inline static std::string small_dir_, slow_dir_, dense_dir_, small_job_, slow_job_, dense_job_;
};

// Checks `b`, the BatchInfo of a request of `rows` rows of `seq` tokens.
void ExpectSaneBatch(const v1::BatchInfo& b, int64_t rows, int64_t seq, int max_requests) {
  EXPECT_GE(b.requests(), 1);
  EXPECT_LE(b.requests(), max_requests);
  EXPECT_GE(b.rows(), rows);
  ASSERT_GT(b.rows(), 0);
  EXPECT_EQ(b.padded_tokens() % b.rows(), 0) << b.DebugString();
  EXPECT_GE(b.padded_tokens() / b.rows(), seq) << b.DebugString();  // padded to the batch's longest
  EXPECT_LE(b.padded_tokens() / b.rows(), 16) << b.DebugString();   // max_position_embeddings
  EXPECT_LE(b.padded_tokens(), kMaxBatchTokens);
  if (b.requests() == 1) {
    EXPECT_EQ(b.rows(), rows);
    EXPECT_EQ(b.padded_tokens(), rows * seq);
  } else {
    EXPECT_GT(b.rows(), rows) << b.DebugString();
  }
  EXPECT_GE(b.queue_seconds(), 0);
  EXPECT_LT(b.queue_seconds(), 30);
}

TEST_F(BatchingTest, ConcurrentRequestsMergeAndEachGetsExactlyItsOwnRows) {
  constexpr int kCalls = 9;  // the last one micro-batched: it never merges
  struct Call {
    bool embed;
    int micro_batches = 0;
    v1::TextInput text;
    v1::InferResponse infer_alone, infer_merged;
    v1::EmbedResponse embed_alone, embed_merged;
    grpc::Status merged_status;
  };
  std::vector<Call> calls(kCalls);
  for (int i = 0; i < kCalls; ++i) {
    calls[i].embed = i % 2 == 1;
    for (int t = 0; t <= i % 3; ++t) calls[i].text.add_texts(Words(i * 7 + t * 3, 1 + (i * 5 + t * 4) % 13));
    if (i == kCalls - 1) {
      calls[i].embed = false;
      calls[i].micro_batches = 2;
    }
    if (i == 4) {  // pairs merge too
      for (int t = 0; t < calls[i].text.texts_size(); ++t) calls[i].text.add_text_pairs(Words(t, 1));
    }
  }
  auto run = [&](Call& c, v1::InferResponse* infer, v1::EmbedResponse* embed) {
    if (c.embed) {
      v1::EmbedRequest request;
      request.set_job_id(small_job_);
      *request.mutable_text() = c.text;
      request.set_pooling(v1::POOLING_MAX);  // any; MAX is the most sensitive to a padded row leaking in
      return stub().Embed(Context().get(), request, embed);
    }
    v1::InferRequest request;
    request.set_job_id(small_job_);
    *request.mutable_text() = c.text;
    request.set_micro_batches(c.micro_batches);
    return stub().Infer(Context().get(), request, infer);
  };
  // Alone: one at a time (each waits the 200 ms for company, and gets none).
  for (Call& c : calls) {
    const grpc::Status s = run(c, &c.infer_alone, &c.embed_alone);
    ASSERT_TRUE(s.ok()) << s.error_message();
    const v1::BatchInfo& b = c.embed ? c.embed_alone.batch() : c.infer_alone.batch();
    EXPECT_EQ(b.requests(), 1);
    if (c.micro_batches > 1) {
      EXPECT_LT(b.queue_seconds(), 0.15) << "a micro-batched request runs alone: it waits for no company";
    } else {
      EXPECT_GE(b.queue_seconds(), 0.15) << "a lone request should have waited --max_batch_delay_ms for company";
    }
  }
  // All at once.
  std::mutex mu;
  std::condition_variable cv;
  bool go = false;
  std::vector<std::thread> threads;
  for (Call& c : calls) {
    threads.emplace_back([&, call = &c] {
      {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [&] { return go; });
      }
      call->merged_status = run(*call, &call->infer_merged, &call->embed_merged);
    });
  }
  {
    std::lock_guard<std::mutex> lock(mu);
    go = true;
  }
  cv.notify_all();
  for (auto& t : threads) t.join();

  int merged = 0;
  int64_t total_rows = 0;
  for (const Call& c : calls) total_rows += c.text.texts_size();
  for (int i = 0; i < kCalls; ++i) {
    SCOPED_TRACE("call " + std::to_string(i) + (calls[i].embed ? " (Embed)" : " (Infer)"));
    const Call& c = calls[i];
    ASSERT_TRUE(c.merged_status.ok()) << c.merged_status.error_message();
    const int64_t rows = c.text.texts_size();
    if (c.embed) {
      EXPECT_EQ(c.embed_merged.embeddings_size(), rows);
      EXPECT_LE(MaxDiff(c.embed_merged, c.embed_alone), kTolerance);
      EXPECT_EQ(std::vector<int32_t>(c.embed_merged.token_counts().begin(), c.embed_merged.token_counts().end()),
                std::vector<int32_t>(c.embed_alone.token_counts().begin(), c.embed_alone.token_counts().end()));
      EXPECT_EQ(c.embed_merged.pooling(), v1::POOLING_MAX);
      const int32_t longest =
          *std::max_element(c.embed_alone.token_counts().begin(), c.embed_alone.token_counts().end());
      ExpectSaneBatch(c.embed_merged.batch(), rows, longest, kCalls);
      merged += c.embed_merged.batch().requests() > 1;
      if (c.embed_merged.batch().requests() == kCalls) {
        EXPECT_EQ(c.embed_merged.batch().rows(), total_rows);
      }
    } else {
      // The request's own tokens (its own padding), and outputs of its own rows and length.
      EXPECT_EQ(c.infer_merged.tokens().SerializeAsString(), c.infer_alone.tokens().SerializeAsString());
      ASSERT_EQ(c.infer_merged.outputs_size(), c.infer_alone.outputs_size());
      ASSERT_EQ(c.infer_alone.outputs_size(), 2);  // last_hidden_state, pooler_output
      for (int o = 0; o < c.infer_alone.outputs_size(); ++o) {
        EXPECT_LE(MaxDiff(c.infer_merged.outputs(o), c.infer_alone.outputs(o)), kTolerance)
            << c.infer_alone.outputs(o).name();
      }
      EXPECT_EQ(Shape(*FindOutput(c.infer_merged, "last_hidden_state")),
                (std::vector<int64_t>{rows, c.infer_alone.tokens().seq(), 32}));
      ExpectSaneBatch(c.infer_merged.batch(), rows, c.infer_alone.tokens().seq(), kCalls);
      if (c.micro_batches > 1) EXPECT_EQ(c.infer_merged.batch().requests(), 1);
      merged += c.infer_merged.batch().requests() > 1;
      if (c.infer_merged.batch().requests() == kCalls) {
        EXPECT_EQ(c.infer_merged.batch().rows(), total_rows);
      }
    }
  }
  EXPECT_GT(merged, 1) << "no request was merged with another";
}

TEST_F(BatchingTest, EmbedWithoutSentenceTransformersFilesMeanPoolsUpToThePositionTable) {
  v1::EmbedRequest request;
  request.set_job_id(small_job_);
  request.mutable_text()->add_texts("the cat sat on the mat");
  v1::EmbedResponse embed;
  const grpc::Status s = stub().Embed(Context().get(), request, &embed);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(embed.pooling(), v1::POOLING_MEAN);
  EXPECT_FALSE(embed.normalized());
  EXPECT_EQ(embed.max_length(), 16);  // max_position_embeddings
  v1::InferRequest infer;
  infer.set_job_id(small_job_);
  *infer.mutable_text() = request.text();
  v1::InferResponse out;
  ASSERT_TRUE(stub().Infer(Context().get(), infer, &out).ok());
  const v1::NamedTensor* hidden = FindOutput(out, "last_hidden_state");
  ASSERT_NE(hidden, nullptr);
  EXPECT_LE(MaxDiff(embed, ReferencePool(*hidden, out.tokens(), Pool::kMean, false)), kTolerance);
}

TEST_F(BatchingTest, EmbedRefusesACheckpointWhosePipelineItCannotRun) {
  v1::EmbedRequest request;
  request.set_job_id(dense_job_);
  request.mutable_text()->add_texts("the cat");
  v1::EmbedResponse embed;
  const grpc::Status s = stub().Embed(Context().get(), request, &embed);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << s.error_message();
  EXPECT_NE(s.error_message().find("modules.json"), std::string::npos) << s.error_message();
  EXPECT_NE(s.error_message().find("sentence_transformers.models.Dense is not supported"), std::string::npos)
      << s.error_message();
  // Infer still serves the hidden states.
  v1::InferRequest infer;
  infer.set_job_id(dense_job_);
  *infer.mutable_text() = request.text();
  v1::InferResponse out;
  const grpc::Status i = stub().Infer(Context().get(), infer, &out);
  EXPECT_TRUE(i.ok()) << i.error_message();
  EXPECT_NE(FindOutput(out, "last_hidden_state"), nullptr);
}

TEST_F(BatchingTest, RequestLargerThanMaxBatchTokensIsRefused) {
  v1::InferRequest infer;
  infer.set_job_id(small_job_);
  v1::TokenInputs* t = infer.mutable_tokens();
  t->set_rows(300);
  t->set_seq(16);
  for (int i = 0; i < 300 * 16; ++i) t->add_input_ids(5 + i % 90);
  v1::InferResponse response;
  grpc::Status s = stub().Infer(Context().get(), infer, &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_NE(s.error_message().find("--max_batch_tokens"), std::string::npos) << s.error_message();
  EXPECT_NE(s.error_message().find("4800"), std::string::npos) << s.error_message();
  EXPECT_NE(s.error_message().find("4096"), std::string::npos) << s.error_message();

  v1::EmbedRequest embed;
  embed.set_job_id(small_job_);
  for (int i = 0; i < 300; ++i) embed.mutable_text()->add_texts(Words(i, 12));  // 300 x 14
  v1::EmbedResponse embedded;
  s = stub().Embed(Context().get(), embed, &embedded);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_NE(s.error_message().find("--max_batch_tokens"), std::string::npos) << s.error_message();

  // Exactly the limit is fine: 256 rows x 16.
  t->set_rows(256);
  t->mutable_input_ids()->Truncate(256 * 16);
  s = stub().Infer(Context().get(), infer, &response);
  EXPECT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(response.batch().padded_tokens(), kMaxBatchTokens);
}

TEST_F(BatchingTest, DeadlinePassingWhileQueuedBehindASlowBatchLeavesTheJobServing) {
  auto tokens = [](int64_t rows, int64_t seq, int salt) {
    v1::TokenInputs t;
    t.set_rows(rows);
    t.set_seq(seq);
    for (int64_t i = 0; i < rows * seq; ++i) t.add_input_ids(1 + (i * 7 + salt) % 997);
    return t;
  };
  v1::EmbedRequest small;
  small.set_job_id(slow_job_);
  *small.mutable_tokens() = tokens(1, 8, 1);
  v1::EmbedResponse before;
  grpc::Status s = stub().Embed(Context().get(), small, &before);
  ASSERT_TRUE(s.ok()) << s.error_message();

  v1::EmbedRequest big;
  big.set_job_id(slow_job_);
  *big.mutable_tokens() = tokens(8, 512, 2);  // exactly --max_batch_tokens
  grpc::Status big_status;
  v1::EmbedResponse big_response;
  Clock::time_point big_done;
  const Clock::time_point big_start = Clock::now();
  std::thread slow([&] {
    big_status = stub().Embed(Context(std::chrono::seconds(120)).get(), big, &big_response);
    big_done = Clock::now();
  });
  // The slow batch waits its 200 ms for company, then runs; the short request comes after that.
  std::this_thread::sleep_for(std::chrono::milliseconds(400));
  v1::EmbedResponse ignored;
  const grpc::Status expired = stub().Embed(Context(std::chrono::milliseconds(150)).get(), small, &ignored);
  const Clock::time_point expired_at = Clock::now();
  // Queued behind the slow batch too, with time to spare: it runs after it, alone (the expired
  // request left the queue and is never sent).
  v1::EmbedResponse after;
  const grpc::Status after_status = stub().Embed(Context().get(), small, &after);
  slow.join();

  EXPECT_EQ(expired.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << expired.error_message();
  ASSERT_TRUE(big_status.ok()) << big_status.error_message();
  EXPECT_GT(big_done, expired_at) << "the slow batch ended before the deadline passed ("
                                  << std::chrono::duration<double>(big_done - big_start).count()
                                  << " s); the test proves nothing: make it slower";
  EXPECT_EQ(big_response.batch().requests(), 1);
  EXPECT_EQ(big_response.embeddings_size(), 8);
  ASSERT_TRUE(after_status.ok()) << after_status.error_message();
  EXPECT_EQ(after.batch().requests(), 1) << after.batch().DebugString();
  EXPECT_EQ(after.batch().rows(), 1);
  EXPECT_GT(after.batch().queue_seconds(), 0.05) << "it should have waited behind the slow batch";
  EXPECT_LE(MaxDiff(after, before), kTolerance);
  EXPECT_EQ(cluster_->GetJob(slow_job_).state(), v1::READY);
  // And later requests still run in step on every rank.
  for (int i = 0; i < 2; ++i) {
    v1::EmbedResponse again;
    s = stub().Embed(Context().get(), small, &again);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_LE(MaxDiff(again, before), kTolerance);
  }
  std::printf("slow batch: %.2f s wall (queued %.2f s)\n", std::chrono::duration<double>(big_done - big_start).count(),
              big_response.batch().queue_seconds());
}

// Last in the suite: when it fails, the slow job is gone.
//
// "Deadlines and cancellation hold per request" (coordinator.proto) and "`deadline` passes
// (DEADLINE_EXCEEDED; a batch already running goes on for the others)" (batch_queue.h): a caller
// whose deadline passes while its own batch runs gets DEADLINE_EXCEEDED, and the job, shared by
// every client, must not pay for it. The workers finish the forward whatever the caller does, so
// the ranks stay in step.
TEST_F(BatchingTest, DeadlinePassingWhileItsOwnBatchRunsLeavesTheJobServing) {
  v1::EmbedRequest small;
  small.set_job_id(slow_job_);
  small.mutable_tokens()->set_rows(1);
  small.mutable_tokens()->set_seq(8);
  for (int i = 0; i < 8; ++i) small.mutable_tokens()->add_input_ids(11 + i);
  v1::EmbedResponse before;
  grpc::Status s = stub().Embed(Context().get(), small, &before);
  ASSERT_TRUE(s.ok()) << s.error_message();

  v1::EmbedRequest big;
  big.set_job_id(slow_job_);
  big.mutable_tokens()->set_rows(8);
  big.mutable_tokens()->set_seq(512);
  for (int i = 0; i < 8 * 512; ++i) big.mutable_tokens()->add_input_ids(1 + (i * 13) % 997);
  // It waits 200 ms for company, then runs for a couple of seconds: the deadline passes mid-forward.
  v1::EmbedResponse ignored;
  const Clock::time_point start = Clock::now();
  const grpc::Status expired = stub().Embed(Context(std::chrono::milliseconds(600)).get(), big, &ignored);
  EXPECT_EQ(expired.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << expired.error_message();
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(2));
  // Queued behind the forward still running (or refused if the job died with the deadline).
  v1::EmbedResponse after;
  s = stub().Embed(Context().get(), small, &after);
  const v1::Job job = cluster_->GetJob(slow_job_);
  EXPECT_EQ(job.state(), v1::READY) << job.failure_cause();
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_LE(MaxDiff(after, before), kTolerance);
}

}  // namespace
}  // namespace bertshard
