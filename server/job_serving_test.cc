#include "server/job_serving.h"

#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "gtest/gtest.h"
#include "server/fake_worker.h"
#include "server/serving_test_util.h"

namespace bertshard::server {
namespace {

constexpr int kHiddenSize = 8;  // SmallPlan's
constexpr int64_t kA = 6;       // "a" in SmallAssets' vocabulary

// The cluster's side: the job's groups of ranks, one serving at a time, and each group lost. A lost
// group is replaced by the next one given (as the scheduler places the job again); with none left
// the job has ended. Forwards are numbered per group (a fresh load numbers from 0).
class Targets : public ForwardTargets {
 public:
  explicit Targets(std::vector<std::vector<RankStub>> groups) : groups_(std::move(groups)) {}
  explicit Targets(std::vector<RankStub> ranks) : Targets(std::vector<std::vector<RankStub>>{std::move(ranks)}) {}
  absl::StatusOr<ForwardTarget> NextForward(const std::string& job_id, int32_t version,
                                            absl::Time wait_until) override {
    absl::MutexLock lock(&mu_);
    versions_.push_back(version);
    wait_until_ = wait_until;
    if (recovering_) return absl::UnavailableError(absl::StrCat("job ", job_id, " has no replica serving"));
    if (static_cast<size_t>(generation_) >= groups_.size()) {
      return absl::FailedPreconditionError(absl::StrCat("job ", job_id, " no longer serves"));
    }
    ++leased_;
    ForwardTarget target{groups_[static_cast<size_t>(generation_)], next_++, abort_, 0, generation_};
    target.pipeline_stages = stages_;
    return target;
  }
  void SetPipelineStages(int stages) {
    absl::MutexLock lock(&mu_);
    stages_ = stages;
  }
  void EndForward(const std::string& /*job_id*/, int32_t replica, int64_t generation) override {
    absl::MutexLock lock(&mu_);
    // With the losses reported so far: a failed forward's replica is given back only once lost.
    ends_.push_back(absl::StrCat(replica, "/", generation, " after ", losses_.size(), " losses"));
    --leased_;
  }
  void LoseGroup(const std::string& job_id, int32_t /*replica*/, int64_t generation, const std::string& cause,
                 const std::string& unreachable_worker) override {
    absl::MutexLock lock(&mu_);
    losses_.push_back(absl::StrCat(job_id, " (group ", generation, "): ", cause,
                                   unreachable_worker.empty() ? "" : " [unreachable " + unreachable_worker + "]"));
    if (generation != generation_) return;  // late: already replaced
    ++generation_;
    next_ = 0;
    abort_ = std::make_shared<ForwardAbort>();
  }
  // No group serves and none has come back yet: NextForward answers UNAVAILABLE at once (the
  // scheduler would wait until `wait_until` first).
  void SetRecovering() {
    absl::MutexLock lock(&mu_);
    recovering_ = true;
  }
  std::vector<std::string> losses() const {
    absl::MutexLock lock(&mu_);
    return losses_;
  }
  absl::Time wait_until() const {
    absl::MutexLock lock(&mu_);
    return wait_until_;
  }
  // Forwards handed out and not yet ended (each NextForward's target must be given back).
  int leased() const {
    absl::MutexLock lock(&mu_);
    return leased_;
  }
  std::vector<std::string> ends() const {
    absl::MutexLock lock(&mu_);
    return ends_;
  }
  std::vector<int32_t> versions() const {
    absl::MutexLock lock(&mu_);
    return versions_;
  }

 private:
  const std::vector<std::vector<RankStub>> groups_;
  mutable absl::Mutex mu_;
  std::shared_ptr<ForwardAbort> abort_ ABSL_GUARDED_BY(mu_) = std::make_shared<ForwardAbort>();
  int64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t next_ ABSL_GUARDED_BY(mu_) = 0;
  bool recovering_ ABSL_GUARDED_BY(mu_) = false;
  int stages_ ABSL_GUARDED_BY(mu_) = 1;
  int leased_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<int32_t> versions_ ABSL_GUARDED_BY(mu_);  // NextForward's, in order
  std::vector<std::string> ends_ ABSL_GUARDED_BY(mu_);
  absl::Time wait_until_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  std::vector<std::string> losses_ ABSL_GUARDED_BY(mu_);
};

// The last stage of SmallPlan's model: logits, and (when the want asks) one row result per row
// whose embedding is (row, sequence, 0, ...), hidden_size (8) wide.
grpc::Status LastStage(grpc::ServerContext*, const v1::ForwardRequest& request, v1::ForwardResponse* response) {
  const int64_t rows = request.inputs().rows();
  v1::NamedTensor* logits = response->add_outputs();
  logits->set_name("logits");
  logits->add_shape(rows);
  logits->add_shape(2);
  for (int64_t i = 0; i < rows * 2; ++i) logits->add_values(static_cast<float>(i % 2));
  if (request.want().has_embeddings()) {
    for (int64_t r = 0; r < rows; ++r) {
      v1::ForwardRow* row = response->add_rows();
      row->add_embedding(static_cast<float>(r));
      row->add_embedding(static_cast<float>(request.sequence()));
      for (int i = 2; i < kHiddenSize; ++i) row->add_embedding(0.0f);
    }
  }
  if (!request.want().all_outputs() && request.want().outputs_size() == 0) response->clear_outputs();
  response->set_forward_seconds(0.5);
  return grpc::Status::OK;
}

// The ranks before it: nothing to return.
grpc::Status EarlierStage(grpc::ServerContext*, const v1::ForwardRequest&, v1::ForwardResponse* response) {
  response->set_forward_seconds(0.5);
  return grpc::Status::OK;
}

v1::TokenInputs TwoRows() {
  v1::TokenInputs t;
  t.set_rows(2);
  t.set_seq(3);
  for (int64_t id : {kCls, kThe, kSep, kCls, kPlay, kSep}) t.add_input_ids(id);
  return t;
}

// The assets of an empty checkpoint directory: the defaults.
std::shared_ptr<const JobAssets> TempDirAssets(const v1::ShardPlan& plan) {
  return LoadJobAssets(plan, *common::CheckpointDir::Open(common::ModelRoot(), testing::TempDir()).value());
}

class JobServingTest : public ::testing::Test {
 protected:
  void Serve(v1::ModelVariant variant, int32_t version = 0) {
    targets_ = std::make_unique<Targets>(std::vector<RankStub>{first_.Rank("w0"), last_.Rank("w1")});
    JobServingOptions options;
    options.forward_timeout = absl::Seconds(30);
    options.version = version;
    // The checkpoint's files are SmallAssets' here: an empty directory gives the defaults.
    serving_ = std::make_unique<JobServing>("job-1", SmallPlan(variant), TempDirAssets(SmallPlan(variant)),
                                            targets_.get(), options);
  }
  static absl::Time Soon() { return absl::Now() + absl::Seconds(30); }

  FakeWorker first_{EarlierStage};
  FakeWorker last_{LastStage};
  std::unique_ptr<Targets> targets_;
  std::unique_ptr<JobServing> serving_;
};

TEST_F(JobServingTest, EmbedAsksForThePooledVectorsOnly) {
  Serve(v1::BERT_MODEL);
  v1::EmbedRequest request;
  request.set_job_id("job-1");
  *request.mutable_tokens() = TwoRows();
  request.set_pooling(v1::POOLING_CLS);
  auto response = serving_->Embed(request, Soon(), nullptr);
  ASSERT_TRUE(response.ok()) << response.status();
  ASSERT_EQ(last_.requests().size(), 1u);
  const v1::ForwardRequest sent = last_.requests()[0];
  EXPECT_EQ(sent.want().embeddings().pooling(), "cls");
  EXPECT_FALSE(sent.want().all_outputs());
  EXPECT_EQ(sent.want().outputs_size(), 0);
  EXPECT_EQ(first_.requests()[0].want().embeddings().pooling(), "cls");  // every rank checks it
  ASSERT_EQ(response->embeddings_size(), 2);
  EXPECT_EQ(response->embeddings(1).values(0), 1.0f);
  EXPECT_EQ(response->embeddings(1).values(1), 0.0f);  // forward 0
  EXPECT_EQ(response->pooling(), v1::POOLING_CLS);
  EXPECT_EQ(response->token_counts_size(), 2);
  // What the two ranks sent back, serialised: the last stage's rows and time, the other's time.
  v1::ForwardResponse last, earlier;
  for (int r = 0; r < 2; ++r) {
    v1::ForwardRow* row = last.add_rows();
    row->add_embedding(static_cast<float>(r));
    row->add_embedding(0.0f);
    for (int i = 2; i < kHiddenSize; ++i) row->add_embedding(0.0f);
  }
  last.set_forward_seconds(0.5);
  earlier.set_forward_seconds(0.5);
  EXPECT_EQ(response->batch().response_bytes(), static_cast<int64_t>(last.ByteSizeLong() + earlier.ByteSizeLong()));
}

// A request path is for one shape of the job (a live update makes one per shape): every forward,
// a retry too, asks for that shape's replicas.
TEST_F(JobServingTest, ForwardsAskForTheReplicasOfItsOwnShape) {
  Serve(v1::BERT_MODEL, /*version=*/3);
  v1::EmbedRequest request;
  request.set_job_id("job-1");
  *request.mutable_tokens() = TwoRows();
  ASSERT_TRUE(serving_->Embed(request, Soon(), nullptr).ok());
  ASSERT_TRUE(serving_->Embed(request, Soon(), nullptr).ok());
  EXPECT_EQ(targets_->versions(), (std::vector<int32_t>{3, 3}));
}

TEST_F(JobServingTest, InferKeepsTheOutputsByDefaultAndDropsThemForPredictionsOnly) {
  Serve(v1::BERT_FOR_SEQUENCE_CLASSIFICATION);
  v1::InferRequest request;
  request.set_job_id("job-1");
  *request.mutable_tokens() = TwoRows();
  auto full = serving_->Infer(request, Soon(), nullptr);
  ASSERT_TRUE(full.ok()) << full.status();
  EXPECT_TRUE(last_.requests()[0].want().all_outputs());
  ASSERT_EQ(full->outputs_size(), 1);
  EXPECT_EQ(full->outputs(0).name(), "logits");
  ASSERT_EQ(full->predictions_size(), 2);
  EXPECT_EQ(full->predictions(0).labels(0).label(), "LABEL_1");
  EXPECT_EQ(full->forward_seconds(), 0.5);

  request.set_predictions_only(true);
  auto predictions = serving_->Infer(request, Soon(), nullptr);
  ASSERT_TRUE(predictions.ok()) << predictions.status();
  const v1::ForwardWant want = last_.requests()[1].want();
  EXPECT_FALSE(want.all_outputs());
  ASSERT_EQ(want.outputs_size(), 1);
  EXPECT_EQ(want.outputs(0), "logits");
  EXPECT_EQ(predictions->outputs_size(), 0);
  ASSERT_EQ(predictions->predictions_size(), 2);
  EXPECT_EQ(predictions->predictions(1).labels(0).label(), full->predictions(1).labels(0).label());
  EXPECT_EQ(predictions->predictions(1).labels(0).score(), full->predictions(1).labels(0).score());
  EXPECT_EQ(last_.requests()[1].sequence(), 1);
}

// A forward that fails on a rank loses the group (naming the worker) and is sent once more on the
// group that replaces it; the caller never hears of the loss.
TEST_F(JobServingTest, AFailedForwardIsSentOnceMoreOnTheGroupThatReplacesIt) {
  FakeWorker failing([](grpc::ServerContext*, const v1::ForwardRequest&, v1::ForwardResponse*) {
    return grpc::Status(grpc::StatusCode::INTERNAL, "collective timed out");
  });
  targets_ = std::make_unique<Targets>(std::vector<std::vector<RankStub>>{{first_.Rank("w0"), failing.Rank("w1")},
                                                                          {first_.Rank("w0"), last_.Rank("w2")}});
  serving_ = std::make_unique<JobServing>("job-1", SmallPlan(v1::BERT_FOR_SEQUENCE_CLASSIFICATION),
                                          TempDirAssets(SmallPlan(v1::BERT_FOR_SEQUENCE_CLASSIFICATION)),
                                          targets_.get(), JobServingOptions());
  v1::InferRequest request;
  *request.mutable_tokens() = TwoRows();
  auto response = serving_->Infer(request, Soon(), nullptr);
  ASSERT_TRUE(response.ok()) << response.status();
  ASSERT_EQ(response->predictions_size(), 2);
  const std::vector<std::string> losses = targets_->losses();
  ASSERT_EQ(losses.size(), 1u);
  EXPECT_EQ(
      losses[0].rfind("job-1 (group 0): worker w1 (rank 1) at " + failing.Rank("w1").address + ": forward 0 failed", 0),
      0u)
      << losses[0];
  EXPECT_EQ(failing.requests().size(), 1u);
  ASSERT_EQ(last_.requests().size(), 1u);
  EXPECT_EQ(last_.requests()[0].sequence(), 0);  // the new group's first forward
  EXPECT_EQ(last_.requests()[0].inputs().input_ids_size(), 6);
  // Each attempt gave its replica back, the failed one only once its loss was reported (another
  // lane must not lease it meanwhile).
  EXPECT_EQ(targets_->ends(), (std::vector<std::string>{"0/0 after 1 losses", "0/1 after 1 losses"}));
  EXPECT_EQ(targets_->leased(), 0);
}

// A request every rank refuses before any collective (INVALID_ARGUMENT from each: it took its
// number) is the request's fault, not the group's: its caller gets the refusal, the group is not
// lost (no restart spent), and the next request is served by the same group, numbered on.
TEST_F(JobServingTest, ARequestEveryRankRefusesIsAnsweredWithTheRefusalAndTheGroupServesOn) {
  bool refuse = true;
  absl::Mutex mu;
  auto refusing_then = [&](FakeWorker::ForwardFn then) {
    return [&mu, &refuse, then](grpc::ServerContext* context, const v1::ForwardRequest& request,
                                v1::ForwardResponse* response) {
      {
        absl::MutexLock lock(&mu);
        if (refuse) return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "token id 30522 is outside the vocabulary");
      }
      return then(context, request, response);
    };
  };
  FakeWorker earlier(refusing_then(EarlierStage)), last(refusing_then(LastStage));
  targets_ = std::make_unique<Targets>(
      std::vector<std::vector<RankStub>>{{earlier.Rank("w0"), last.Rank("w1")}, {first_.Rank("w2"), last_.Rank("w3")}});
  serving_ = std::make_unique<JobServing>("job-1", SmallPlan(v1::BERT_FOR_SEQUENCE_CLASSIFICATION),
                                          TempDirAssets(SmallPlan(v1::BERT_FOR_SEQUENCE_CLASSIFICATION)),
                                          targets_.get(), JobServingOptions());
  v1::InferRequest request;
  *request.mutable_tokens() = TwoRows();
  auto refused = serving_->Infer(request, Soon(), nullptr);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  EXPECT_NE(refused.status().message().find("refused forward 0: token id 30522 is outside the vocabulary"),
            std::string::npos)
      << refused.status();
  EXPECT_TRUE(targets_->losses().empty());
  {
    absl::MutexLock lock(&mu);
    refuse = false;
  }
  auto served = serving_->Infer(request, Soon(), nullptr);
  ASSERT_TRUE(served.ok()) << served.status();
  EXPECT_TRUE(targets_->losses().empty());
  ASSERT_EQ(last.requests().size(), 2u);
  EXPECT_EQ(last.requests()[1].sequence(), 1);
  EXPECT_TRUE(last_.requests().empty());  // the second group was never needed
}

// Sent once more only: when the replacement fails too, the batch's callers get UNAVAILABLE naming
// the cause, and once the job has ended the next request is refused before any rank is called.
TEST_F(JobServingTest, AForwardFailingOnTheReplacementTooIsUnavailable) {
  FakeWorker failing([](grpc::ServerContext*, const v1::ForwardRequest&, v1::ForwardResponse*) {
    return grpc::Status(grpc::StatusCode::INTERNAL, "collective timed out");
  });
  targets_ = std::make_unique<Targets>(std::vector<std::vector<RankStub>>{{first_.Rank("w0"), failing.Rank("w1")},
                                                                          {first_.Rank("w0"), failing.Rank("w1")}});
  serving_ = std::make_unique<JobServing>("job-1", SmallPlan(v1::BERT_FOR_SEQUENCE_CLASSIFICATION),
                                          TempDirAssets(SmallPlan(v1::BERT_FOR_SEQUENCE_CLASSIFICATION)),
                                          targets_.get(), JobServingOptions());
  v1::InferRequest request;
  *request.mutable_tokens() = TwoRows();
  auto response = serving_->Infer(request, Soon(), nullptr);
  EXPECT_EQ(response.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(response.status().message().find("collective timed out"), std::string::npos) << response.status();
  const std::vector<std::string> losses = targets_->losses();
  ASSERT_EQ(losses.size(), 2u);
  EXPECT_EQ(losses[1].rfind("job-1 (group 1): worker w1 (rank 1)", 0), 0u) << losses[1];
  // Both groups are gone: the next request is refused before any rank is called. The failing rank
  // answered both forwards; the healthy rank's copies may have been cancelled before they arrived
  // (the fan-out cancels the rest on a failure).
  auto later = serving_->Infer(request, Soon(), nullptr);
  EXPECT_EQ(later.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(failing.requests().size(), 2u);
  EXPECT_LE(first_.requests().size(), 2u);
}

// While no group serves, a batch waits for one until shortly before its callers' deadline, so that
// they hear UNAVAILABLE and why, not a bare DEADLINE_EXCEEDED.
TEST_F(JobServingTest, WithNoGroupServingABatchWaitsUntilShortlyBeforeItsDeadline) {
  Serve(v1::BERT_FOR_SEQUENCE_CLASSIFICATION);
  targets_->SetRecovering();
  v1::InferRequest request;
  *request.mutable_tokens() = TwoRows();
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  auto response = serving_->Infer(request, deadline, nullptr);
  EXPECT_EQ(response.status().code(), absl::StatusCode::kUnavailable) << response.status();
  EXPECT_NE(response.status().message().find("has no replica serving"), std::string::npos) << response.status();
  const absl::Time waited_until = targets_->wait_until();
  EXPECT_LT(waited_until, deadline);                            // the margin: a tenth of 5 s
  EXPECT_GT(waited_until, deadline - absl::Milliseconds(600));  // but no more than that
  EXPECT_TRUE(last_.requests().empty());
}

// A batch that asked for no micro-batches fills the pipeline of the replica it got
// (DefaultMicroBatches: 4 per extra stage, a row each at most); one that asked keeps its count.
TEST_F(JobServingTest, ABatchFillsTheReplicasPipelineUnlessItAskedForMicroBatches) {
  EXPECT_EQ(DefaultMicroBatches(16, 24, 1), 1);
  EXPECT_EQ(DefaultMicroBatches(16, 24, 2), 4);  // 4 / (4 + 1): 80% of a 2-stage pipeline busy
  EXPECT_EQ(DefaultMicroBatches(32, 24, 3), 8);
  EXPECT_EQ(DefaultMicroBatches(4, 24, 2), 1);  // 3 rows of 24 tokens at least per micro-batch
  EXPECT_EQ(DefaultMicroBatches(8, 24, 2), 2);
  EXPECT_EQ(DefaultMicroBatches(2, 64, 2), 2);  // long rows: one each
  EXPECT_EQ(DefaultMicroBatches(1, 512, 4), 1);
  Serve(v1::BERT_FOR_SEQUENCE_CLASSIFICATION);
  v1::InferRequest infer;
  *infer.mutable_tokens() = TwoRows();
  // Eight rows of 16 tokens (the plan's longest): two micro-batches of 64 tokens on a pipeline.
  v1::TokenInputs& rows = *infer.mutable_tokens();
  rows.set_rows(8);
  rows.set_seq(16);
  rows.clear_input_ids();
  for (int r = 0; r < 8; ++r) {
    for (int k = 0; k < 16; ++k) rows.add_input_ids(k == 0 ? kCls : k == 15 ? kSep : kThe);
  }
  ASSERT_TRUE(serving_->Infer(infer, Soon(), nullptr).ok());  // no pipeline: 1
  targets_->SetPipelineStages(2);
  ASSERT_TRUE(serving_->Infer(infer, Soon(), nullptr).ok());
  infer.set_micro_batches(1);
  ASSERT_TRUE(serving_->Infer(infer, Soon(), nullptr).ok());
  ASSERT_EQ(last_.requests().size(), 3u);
  EXPECT_EQ(last_.requests()[0].micro_batches(), 1);
  EXPECT_EQ(last_.requests()[1].micro_batches(), 2);
  EXPECT_EQ(last_.requests()[2].micro_batches(), 2);
  EXPECT_EQ(first_.requests()[2].micro_batches(), 2);  // every rank runs the same schedule
}

TEST_F(JobServingTest, BadRequestsAreRefusedBeforeAnyForward) {
  Serve(v1::BERT_FOR_SEQUENCE_CLASSIFICATION);
  v1::EmbedRequest embed;
  *embed.mutable_tokens() = TwoRows();
  EXPECT_EQ(serving_->Embed(embed, Soon(), nullptr).status().code(), absl::StatusCode::kFailedPrecondition);
  v1::InferRequest infer;
  *infer.mutable_tokens() = TwoRows();
  infer.set_top_k(-1);
  EXPECT_EQ(serving_->Infer(infer, Soon(), nullptr).status().code(), absl::StatusCode::kInvalidArgument);
  infer.set_top_k(0);
  infer.set_micro_batches(3);
  EXPECT_EQ(serving_->Infer(infer, Soon(), nullptr).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(last_.requests().empty());
  serving_->Close("job job-1 is CANCELLED");
  infer.set_micro_batches(0);
  auto closed = serving_->Infer(infer, Soon(), nullptr);
  EXPECT_EQ(closed.status(), absl::UnavailableError("job job-1 is CANCELLED"));
}

// Peak resident memory (VmHWM) in bytes, after resetting it to the current RSS where the kernel
// allows (clear_refs 5); 0 if /proc is not readable.
int64_t PeakRss(bool reset) {
  if (reset) std::ofstream("/proc/self/clear_refs") << "5";
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmHWM:", 0) == 0) return std::stoll(line.substr(6)) * 1024;
  }
  return 0;
}

// Issue 21: an Infer of 2,000,000 x 16 token ids (96 MB on the wire) was copied, given a mask and
// token types, and scanned (2.3 GB, 14.6 s) before its size was refused. Its counts alone refuse
// it now: nothing is copied.
TEST_F(JobServingTest, AHugeTokenRequestIsRefusedFromItsCountsBeforeAnyCopy) {
  Serve(v1::BERT_FOR_SEQUENCE_CLASSIFICATION);
  v1::InferRequest request;
  request.set_job_id("job-1");
  v1::TokenInputs* tokens = request.mutable_tokens();
  tokens->set_rows(2'000'000);
  tokens->set_seq(16);
  tokens->mutable_input_ids()->Resize(2'000'000 * 16, kThe);  // valid ids: a scan would read them all
  const int64_t before = PeakRss(true);
  const absl::Time start = absl::Now();
  auto response = serving_->Infer(request, Soon(), nullptr);
  const absl::Duration took = absl::Now() - start;
  const int64_t growth = PeakRss(false) - before;
  std::printf("2,000,000 x 16 ids refused in %.3f s, peak RSS growth %.1f MiB\n", absl::ToDoubleSeconds(took),
              static_cast<double>(growth) / (1 << 20));
  EXPECT_EQ(response.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(response.status().message().find("--max_batch_tokens"), std::string::npos) << response.status();
  // Each copy of the ids is 256 MB, and the mask and token types as much again.
  EXPECT_LT(growth, 100 << 20) << "peak RSS grew by " << growth / (1 << 20) << " MiB";
  EXPECT_LT(took, absl::Seconds(2));
  EXPECT_TRUE(last_.requests().empty());
}

// A last stage that answers like LastStage and then spoils the answer with `spoil`.
FakeWorker::ForwardFn Spoiled(std::function<void(v1::ForwardResponse*)> spoil) {
  return [spoil](grpc::ServerContext* context, const v1::ForwardRequest& request, v1::ForwardResponse* response) {
    grpc::Status status = LastStage(context, request, response);
    spoil(response);
    return status;
  };
}

// Issue 21: a worker that answered NaN or wrong-shaped outputs was served to the client.
TEST_F(JobServingTest, AWorkersNonFiniteOrMisshapenAnswerIsAnErrorNamingItNeverServed) {
  struct Case {
    const char* what;
    std::function<void(v1::ForwardResponse*)> spoil;
    bool embed;
  };
  const std::vector<Case> cases = {
      {"NaN logits", [](v1::ForwardResponse* r) { r->mutable_outputs(0)->set_values(1, std::nanf("")); }, false},
      {"infinite logits",
       [](v1::ForwardResponse* r) { r->mutable_outputs(0)->set_values(0, std::numeric_limits<float>::infinity()); },
       false},
      {"logits for 3 rows of 2",
       [](v1::ForwardResponse* r) {
         v1::NamedTensor* logits = r->mutable_outputs(0);
         logits->set_shape(0, 3);
         logits->add_values(0);
         logits->add_values(1);
       },
       false},
      {"fewer values than the shape",
       [](v1::ForwardResponse* r) { r->mutable_outputs(0)->mutable_values()->RemoveLast(); }, false},
      {"a NaN embedding", [](v1::ForwardResponse* r) { r->mutable_rows(1)->set_embedding(3, std::nanf("")); }, true},
      {"a 7-wide embedding", [](v1::ForwardResponse* r) { r->mutable_rows(0)->mutable_embedding()->RemoveLast(); },
       true},
      {"one embedding for two rows", [](v1::ForwardResponse* r) { r->mutable_rows()->RemoveLast(); }, true},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    FakeWorker bad(Spoiled(c.spoil));
    targets_ = std::make_unique<Targets>(std::vector<RankStub>{first_.Rank("w0"), bad.Rank("w1")});
    serving_ = std::make_unique<JobServing>(
        "job-1", SmallPlan(c.embed ? v1::BERT_MODEL : v1::BERT_FOR_SEQUENCE_CLASSIFICATION),
        TempDirAssets(SmallPlan(c.embed ? v1::BERT_MODEL : v1::BERT_FOR_SEQUENCE_CLASSIFICATION)), targets_.get(),
        JobServingOptions());
    absl::Status status;
    if (c.embed) {
      v1::EmbedRequest request;
      *request.mutable_tokens() = TwoRows();
      status = serving_->Embed(request, Soon(), nullptr).status();
    } else {
      v1::InferRequest request;
      *request.mutable_tokens() = TwoRows();
      status = serving_->Infer(request, Soon(), nullptr).status();
    }
    EXPECT_EQ(status.code(), absl::StatusCode::kInternal) << status;
    EXPECT_NE(status.message().find("worker w1 (rank 1) at " + bad.Address()), std::string::npos) << status;
    EXPECT_TRUE(targets_->losses().empty());  // the ranks are in step: the group goes on
    serving_.reset();                         // before `bad` goes
  }
}

TEST_F(JobServingTest, EmbedCutsToDimensionsAndNormalisesTheCutAgain) {
  Serve(v1::BERT_MODEL);
  v1::EmbedRequest request;
  request.set_job_id("job-1");
  *request.mutable_tokens() = TwoRows();
  ASSERT_TRUE(serving_->Embed(request, Soon(), nullptr).ok());  // forward 0
  // Forward 1: row 1 comes back (1, 1, 0, ...); cut to 2 and normalised: (1, 1) / sqrt(2).
  request.set_normalize(v1::NORMALIZE_ON);
  request.set_dimensions(2);
  auto cut = serving_->Embed(request, Soon(), nullptr);
  ASSERT_TRUE(cut.ok()) << cut.status();
  ASSERT_EQ(cut->embeddings(1).values_size(), 2);
  EXPECT_FLOAT_EQ(cut->embeddings(1).values(0), 1 / std::sqrt(2.0f));
  EXPECT_FLOAT_EQ(cut->embeddings(1).values(1), 1 / std::sqrt(2.0f));
  EXPECT_EQ(cut->embeddings(0).values(0), 0.0f);  // an all-zero cut stays zero, not NaN
  EXPECT_EQ(cut->batch().forward_seconds(), 0.5);
  EXPECT_GE(cut->batch().tokenization_seconds(), 0.0);
  // Forward 2, unnormalised: the cut as it came, (1, 2).
  request.set_normalize(v1::NORMALIZE_OFF);
  auto raw = serving_->Embed(request, Soon(), nullptr);
  ASSERT_TRUE(raw.ok()) << raw.status();
  EXPECT_EQ(std::vector<float>(raw->embeddings(1).values().begin(), raw->embeddings(1).values().end()),
            (std::vector<float>{1, 2}));
  // Past the hidden size (8), or below 0: refused before a forward.
  for (const int dimensions : {9, -1}) {
    request.set_dimensions(dimensions);
    const absl::Status refused = serving_->Embed(request, Soon(), nullptr).status();
    EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;
    EXPECT_NE(refused.message().find("dimensions must be in 1..8"), std::string::npos) << refused;
  }
  EXPECT_EQ(last_.requests().size(), 3u);
}

// Prompts (config_sentence_transformers.json): the named prompt's text goes before each text, the
// default one when the request names none; an unknown name, a name on token rows, and a model that
// pools without the prompt's tokens are refused before any forward.
TEST(JobServingPrompts, ThePromptGoesBeforeEachTextTheDefaultOneWhenNoneIsNamed) {
  FakeWorker first(EarlierStage);
  FakeWorker last(LastStage);
  Targets targets(std::vector<RankStub>{first.Rank("w0"), last.Rank("w1")});
  std::shared_ptr<JobAssets> assets = SmallAssets();
  serving::EmbeddingConfig config;
  config.prompts = {{"query", "the "}, {"doc", "a "}, {"none", ""}};
  config.default_prompt_name = "query";
  assets->embedding = config;
  JobServing serving("job-1", SmallPlan(v1::BERT_MODEL), assets, &targets, JobServingOptions());
  const absl::Time soon = absl::Now() + absl::Seconds(30);
  // The ids of the one row sent in forward `n`, padding dropped.
  auto row_ids = [&](size_t n) {
    std::vector<int64_t> ids;
    const v1::ForwardRequest sent = last.requests().at(n);
    for (int64_t id : sent.inputs().input_ids()) {
      if (id != kPad) ids.push_back(id);
    }
    return ids;
  };
  v1::EmbedRequest request;
  request.set_job_id("job-1");
  request.mutable_text()->add_texts("play");
  for (const auto& [name, want] : std::vector<std::pair<std::string, std::vector<int64_t>>>{
           {"", {kCls, kThe, kPlay, kSep}},  // the default prompt, "the "
           {"doc", {kCls, kA, kPlay, kSep}},
           {"none", {kCls, kPlay, kSep}}}) {
    SCOPED_TRACE(name);
    request.set_prompt_name(name);
    const size_t n = last.requests().size();
    absl::StatusOr<v1::EmbedResponse> embedded = serving.Embed(request, soon, nullptr);
    ASSERT_TRUE(embedded.ok()) << embedded.status();
    EXPECT_EQ(row_ids(n), want);
    EXPECT_EQ(embedded->token_counts(0), static_cast<int32_t>(want.size()));
  }
  const size_t forwards = last.requests().size();
  request.set_prompt_name("passage");
  const absl::Status unknown = serving.Embed(request, soon, nullptr).status();
  EXPECT_EQ(unknown.code(), absl::StatusCode::kInvalidArgument) << unknown;
  EXPECT_NE(unknown.message().find("doc, none, query"), std::string::npos) << unknown;
  v1::EmbedRequest pairs = request;  // the default prompt applies, and pairs take none (as TEI)
  pairs.set_prompt_name("");
  pairs.mutable_text()->add_text_pairs("a");
  const absl::Status paired = serving.Embed(pairs, soon, nullptr).status();
  EXPECT_EQ(paired.code(), absl::StatusCode::kInvalidArgument) << paired;
  EXPECT_NE(paired.message().find("the model's default, query"), std::string::npos) << paired;
  v1::EmbedRequest ids;
  ids.set_job_id("job-1");
  *ids.mutable_tokens() = TwoRows();
  ids.set_prompt_name("query");
  EXPECT_EQ(serving.Embed(ids, soon, nullptr).status().code(), absl::StatusCode::kInvalidArgument);
  config.include_prompt = false;
  assets->embedding = config;
  JobServing excluding("job-1", SmallPlan(v1::BERT_MODEL), assets, &targets, JobServingOptions());
  request.set_prompt_name("");
  EXPECT_EQ(excluding.Embed(request, soon, nullptr).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(last.requests().size(), forwards);
  ids.clear_prompt_name();  // token rows take no default prompt
  EXPECT_TRUE(excluding.Embed(ids, soon, nullptr).ok());
}

// Rerank (a cross-encoder: one label): the (query, text) pairs run as the rows of one forward and
// come back ranked by their logits' sigmoids (or the logits), best first, with each pair's tokens.
TEST(JobServingRerank, RanksThePairsOfOneForwardByTheirLogitsBestFirst) {
  const std::vector<float> row_logits = {0.5f, 2.0f, -1.0f};
  FakeWorker first(EarlierStage);
  FakeWorker last([&](grpc::ServerContext*, const v1::ForwardRequest& request, v1::ForwardResponse* response) {
    v1::NamedTensor* logits = response->add_outputs();
    logits->set_name("logits");
    logits->add_shape(request.inputs().rows());
    logits->add_shape(1);
    for (int64_t r = 0; r < request.inputs().rows(); ++r) logits->add_values(row_logits[static_cast<size_t>(r % 3)]);
    return grpc::Status::OK;
  });
  Targets targets(std::vector<RankStub>{first.Rank("w0"), last.Rank("w1")});
  std::shared_ptr<JobAssets> assets = SmallAssets();
  serving::Labels one;
  one.names = {"LABEL_0"};
  assets->labels = one;
  JobServing serving("job-1", SmallPlan(v1::BERT_FOR_SEQUENCE_CLASSIFICATION, 1), assets, &targets,
                     JobServingOptions());
  v1::RerankRequest request;
  request.set_job_id("job-1");
  request.set_query("the");
  for (const char* text : {"play", "a x y", "unable"}) request.add_texts(text);
  const absl::Time soon = absl::Now() + absl::Seconds(30);
  absl::StatusOr<v1::RerankResponse> ranked = serving.Rerank(request, soon, nullptr);
  ASSERT_TRUE(ranked.ok()) << ranked.status();
  ASSERT_EQ(last.requests().size(), 1u);
  EXPECT_EQ(last.requests()[0].inputs().rows(), 3);
  ASSERT_EQ(ranked->results_size(), 3);
  EXPECT_EQ(ranked->results(0).index(), 1);
  EXPECT_EQ(ranked->results(1).index(), 0);
  EXPECT_EQ(ranked->results(2).index(), 2);
  EXPECT_FLOAT_EQ(ranked->results(0).score(), static_cast<float>(1.0 / (1.0 + std::exp(-2.0))));
  EXPECT_FLOAT_EQ(ranked->results(2).score(), static_cast<float>(1.0 / (1.0 + std::exp(1.0))));
  // [CLS] the [SEP] play [SEP]; [CLS] the [SEP] a x y [SEP]; [CLS] the [SEP] un ##able [SEP]
  EXPECT_EQ(std::vector<int32_t>(ranked->token_counts().begin(), ranked->token_counts().end()),
            (std::vector<int32_t>{5, 7, 6}));
  EXPECT_EQ(ranked->batch().rows(), 3);
  request.set_raw_scores(true);
  ranked = serving.Rerank(request, soon, nullptr);
  ASSERT_TRUE(ranked.ok()) << ranked.status();
  EXPECT_FLOAT_EQ(ranked->results(0).score(), 2.0f);
  EXPECT_FLOAT_EQ(ranked->results(2).score(), -1.0f);

  // Refused before any forward: an empty query, no texts, an empty text.
  const size_t forwards = last.requests().size();
  v1::RerankRequest bad = request;
  bad.clear_query();
  EXPECT_EQ(serving.Rerank(bad, soon, nullptr).status().code(), absl::StatusCode::kInvalidArgument);
  bad = request;
  bad.clear_texts();
  EXPECT_EQ(serving.Rerank(bad, soon, nullptr).status().code(), absl::StatusCode::kInvalidArgument);
  bad = request;
  bad.add_texts("");
  const absl::Status empty = serving.Rerank(bad, soon, nullptr).status();
  EXPECT_EQ(empty.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(empty.message().find("text 3 is empty"), std::string::npos) << empty;
  EXPECT_EQ(last.requests().size(), forwards);
}

// Only a cross-encoder reranks: a classifier with two labels and a BertModel are refused, saying why.
TEST(JobServingRerank, RefusesAModelThatIsNotACrossEncoder) {
  Targets targets(std::vector<RankStub>{});
  v1::RerankRequest request;
  request.set_job_id("job-1");
  request.set_query("the");
  request.add_texts("play");
  std::shared_ptr<JobAssets> assets = SmallAssets();
  serving::Labels two;
  two.names = {"NEGATIVE", "POSITIVE"};
  assets->labels = two;
  for (const v1::ModelVariant variant : {v1::BERT_FOR_SEQUENCE_CLASSIFICATION, v1::BERT_MODEL}) {
    JobServing serving("job-1", SmallPlan(variant), assets, &targets, JobServingOptions());
    const absl::Status refused = serving.Rerank(request, absl::Now() + absl::Seconds(30), nullptr).status();
    EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
    EXPECT_NE(refused.message().find("a BertForSequenceClassification with one label"), std::string::npos) << refused;
    if (variant == v1::BERT_FOR_SEQUENCE_CLASSIFICATION) {
      EXPECT_NE(refused.message().find("with 2 labels"), std::string::npos) << refused;
    }
  }
}

// The query goes into every pair: a long query with many short texts is refused from the counts,
// before the query is copied once per text (here 1 GB of copies).
TEST(JobServingRerank, ALongQueryTimesManyTextsIsRefusedBeforeItIsCopied) {
  FakeWorker last(LastStage);
  Targets targets(std::vector<RankStub>{last.Rank("w0")});
  std::shared_ptr<JobAssets> assets = SmallAssets();
  serving::Labels one;
  one.names = {"LABEL_0"};
  assets->labels = one;
  JobServingOptions options;  // --max_request_text_bytes 32 MiB, --max_batch_tokens 16384
  JobServing serving("job-1", SmallPlan(v1::BERT_FOR_SEQUENCE_CLASSIFICATION, 1), assets, &targets, options);
  v1::RerankRequest request;
  request.set_job_id("job-1");
  request.set_query(std::string(1 << 20, 'x'));
  for (int i = 0; i < 1000; ++i) request.add_texts("a");
  const int64_t before = PeakRss(true);
  const absl::Status refused = serving.Rerank(request, absl::Now() + absl::Seconds(30), nullptr).status();
  const int64_t growth = PeakRss(false) - before;
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;
  EXPECT_NE(refused.message().find("--max_request_text_bytes"), std::string::npos) << refused;
  EXPECT_LT(growth, 100 << 20) << "peak RSS grew by " << growth / (1 << 20) << " MiB";
  request.set_query("q");
  for (int i = 0; i < 6000; ++i) request.add_texts("a");  // 7000 pairs: over 16384 / 3
  const absl::Status many = serving.Rerank(request, absl::Now() + absl::Seconds(30), nullptr).status();
  EXPECT_EQ(many.code(), absl::StatusCode::kInvalidArgument) << many;
  EXPECT_NE(many.message().find("--max_batch_tokens"), std::string::npos) << many;
  EXPECT_TRUE(last.requests().empty());
}

TEST(JobServingTokenizer, TokenizesAndDecodesWithTheJobsVocabulary) {
  Targets targets(std::vector<RankStub>{});
  JobServing serving("job-1", SmallPlan(v1::BERT_MODEL), SmallAssets(), &targets, {});
  auto tokens = serving.Tokenize("the playing", true);
  ASSERT_TRUE(tokens.ok()) << tokens.status();
  std::vector<int64_t> ids;
  std::vector<std::string> texts;
  std::vector<bool> special;
  for (const TokenPiece& t : *tokens) {
    ids.push_back(t.id);
    texts.push_back(t.text);
    special.push_back(t.special);
  }
  EXPECT_EQ(ids, (std::vector<int64_t>{kCls, kThe, kPlay, 8, kSep}));
  EXPECT_EQ(texts, (std::vector<std::string>{"[CLS]", "the", "play", "##ing", "[SEP]"}));
  EXPECT_EQ(special, (std::vector<bool>{true, false, false, false, true}));
  EXPECT_EQ(serving.Tokenize("the", false)->size(), 1u);
  EXPECT_EQ(serving.Tokenize("\xff", true).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(*serving.Decode({kCls, kThe, kPlay, 8, kSep}), "the playing");
  const absl::Status outside = serving.Decode({kThe, 18}).status();
  EXPECT_EQ(outside.code(), absl::StatusCode::kInvalidArgument) << outside;
  EXPECT_NE(outside.message().find("0..17"), std::string::npos) << outside;
  // A checkpoint without a vocabulary: nothing to tokenise with.
  JobServing bare("job-2", SmallPlan(v1::BERT_MODEL), TempDirAssets(SmallPlan(v1::BERT_MODEL)), &targets, {});
  EXPECT_EQ(bare.Tokenize("the", true).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(bare.Decode({kThe}).status().code(), absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace bertshard::server
