// Dynamic batching end to end through the gRPC service: a coordinator with
// --max_batch_delay_ms=200 --max_batch_tokens=4096 and four workers (tests/cluster_fixture.h's
// LocalCluster, shared by the suite). Concurrent Infer and Embed calls merge and each equals the
// same request run alone; a request over --max_batch_tokens is refused; Embed mean-pools without
// sentence-transformers files and refuses a pipeline it cannot run; a request whose deadline
// passes while it waits behind a slow batch, or while its own batch runs, ends with
// DEADLINE_EXCEEDED, and the job keeps serving correctly.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "bertshard/v1/coordinator.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/metrics_scrape.h"
#include "tests/serving_fixture.h"
#include "tests/test_process.h"

namespace bertshard {
namespace {

using testing::Cli;
using testing::Context;
using testing::CopyWithSmallVocab;
using testing::FindOutput;
using testing::kTolerance;
using testing::LocalCluster;
using testing::MaxDiff;
using testing::NewServingCluster;
using testing::Pool;
using testing::ReadAll;
using testing::ReferencePool;
using testing::ScrapeMetrics;
using testing::Shape;
using testing::Shardctl;
using testing::SubmitTp;
using testing::TempDir;
using testing::Words;
using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;

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
    cluster_ = NewServingCluster("batching",
                                 {"--max_batch_delay_ms=200", "--max_batch_tokens=" + std::to_string(kMaxBatchTokens),
                                  "--metrics_listen=127.0.0.1:0"});
    *error_ = cluster_->Start(4);
    if (!error_->empty()) return;
    small_job_ = SubmitTp(*cluster_, small_dir_, 2, error_);
    slow_job_ = SubmitTp(*cluster_, slow_dir_, 1, error_);
    dense_job_ = SubmitTp(*cluster_, dense_dir_, 1, error_);
    if (!error_->empty()) return;
    for (const std::string& job : {small_job_, slow_job_, dense_job_}) *error_ += cluster_->WaitReady(job);
  }

  static void TearDownTestSuite() {
    delete cluster_;
    cluster_ = nullptr;
  }

  void SetUp() override { ASSERT_TRUE(error_ != nullptr && error_->empty()) << (error_ ? *error_ : ""); }

  static v1::Coordinator::Stub& stub() { return cluster_->stub(); }

  // Merged forwards the coordinator has dispatched so far (its batch-size histogram's count, which
  // its batch queue adds to just before a forward runs); -1 if its metrics cannot be read.
  static int64_t BatchesDispatched() {
    const std::string log = ReadAll(cluster_->data_dir_ + ".log");
    const size_t port_at = log.find("metrics listening on port ");
    if (port_at == std::string::npos) return -1;
    const std::string metrics = ScrapeMetrics(std::atoi(log.c_str() + port_at + 26));
    const std::string name = "\nbertshard_coordinator_batch_tokens_count ";
    const size_t at = metrics.find(name);
    return at == std::string::npos ? -1 : std::atoll(metrics.c_str() + at + name.size());
  }

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
      if (c.micro_batches > 1) {
        EXPECT_EQ(c.infer_merged.batch().requests(), 1);
      }
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
  const int64_t dispatched_before = BatchesDispatched();
  ASSERT_GE(dispatched_before, 0) << "the coordinator's metrics cannot be read";
  const Clock::time_point big_start = Clock::now();
  std::thread slow([&] {
    big_status = stub().Embed(Context(std::chrono::seconds(120)).get(), big, &big_response);
    big_done = Clock::now();
  });
  // The slow batch waits its 200 ms for company, then runs; the short request comes after that,
  // once the coordinator has dispatched it.
  bool running = false;
  for (int i = 0; i < 3000 && !running; ++i) {
    running = BatchesDispatched() > dispatched_before;
    if (!running) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_TRUE(running) << "the slow batch was not dispatched within ~30 s";
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
