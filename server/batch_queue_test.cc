#include "server/batch_queue.h"

#include <atomic>
#include <chrono>
#include <future>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace bertshard::server {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr int64_t kHidden = 3;

bool PerToken(const std::string& name) { return name == "last_hidden_state" || name == "start_logits"; }

// A forward whose outputs depend per row on that row's real tokens only (and, per token, on the
// position's own token), so any mix-up of rows or positions shows and masked padding changes
// nothing. All values are small integers or halves: exact in float.
BatchOutputs Compute(const v1::TokenInputs& t) {
  const int64_t rows = t.rows();
  const int64_t seq = t.seq();
  const int64_t choices = std::max<int64_t>(1, t.choices());
  BatchOutputs out;
  out.forward_seconds = 0.25;
  out.outputs.resize(4);  // references into it stay valid
  v1::NamedTensor& hidden = out.outputs[0];
  hidden.set_name("last_hidden_state");
  hidden.add_shape(rows);
  hidden.add_shape(seq);
  hidden.add_shape(kHidden);
  v1::NamedTensor& start = out.outputs[1];
  start.set_name("start_logits");
  start.add_shape(rows);
  start.add_shape(seq);
  v1::NamedTensor& pooled = out.outputs[2];
  pooled.set_name("pooler_output");
  pooled.add_shape(rows);
  pooled.add_shape(2);
  std::vector<float> row_sums;
  for (int64_t r = 0; r < rows; ++r) {
    float sum = 0;
    float count = 0;
    for (int64_t p = 0; p < seq; ++p) {
      const int i = static_cast<int>(r * seq + p);
      const float id = static_cast<float>(t.input_ids(i));
      const float mask = static_cast<float>(t.attention_mask(i));
      const float type = static_cast<float>(t.token_type_ids(i));
      for (int64_t h = 0; h < kHidden; ++h) hidden.add_values(id * 16 + type * 4 + mask * 2 + 0.5f * h);
      start.add_values(mask > 0 ? id + 0.5f * p : -1000);
      sum += mask * id;
      count += mask;
    }
    pooled.add_values(sum);
    pooled.add_values(count);
    row_sums.push_back(sum);
  }
  v1::NamedTensor& logits = out.outputs[3];
  logits.set_name("logits");
  if (choices > 1) {  // BertForMultipleChoice: one row of scores per question
    logits.add_shape(rows / choices);
    logits.add_shape(choices);
    for (float s : row_sums) logits.add_values(s);
  } else {
    logits.add_shape(rows);
    logits.add_shape(2);
    for (float s : row_sums) {
      logits.add_values(s);
      logits.add_values(-s);
    }
  }
  return out;
}

// Row-major [rows, seq] tokens whose rows all start with `tag` (so a merged batch shows which
// requests it holds); odd rows end in their own padding.
v1::TokenInputs Tokens(int64_t tag, int64_t rows, int64_t seq, int64_t choices = 1) {
  v1::TokenInputs t;
  t.set_rows(rows);
  t.set_seq(seq);
  t.set_choices(choices);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t p = 0; p < seq; ++p) {
      const bool own_pad = r % 2 == 1 && seq > 1 && p == seq - 1;
      t.add_input_ids(p == 0 ? tag : own_pad ? 0 : 1000 + (tag * 7 + r * 13 + p * 3) % 900);
      t.add_attention_mask(own_pad ? 0 : 1);
      t.add_token_type_ids(p >= seq / 2 && !own_pad ? 1 : 0);
    }
  }
  return t;
}

// Whether `got` holds exactly the outputs `tokens` get when run alone, bit for bit.
::testing::AssertionResult SameAsAlone(const absl::StatusOr<BatchResult>& got, const v1::TokenInputs& tokens) {
  if (!got.ok()) return ::testing::AssertionFailure() << got.status();
  const BatchOutputs want = Compute(tokens);
  if (got->outputs.size() != want.outputs.size()) {
    return ::testing::AssertionFailure() << got->outputs.size() << " outputs, want " << want.outputs.size();
  }
  for (size_t i = 0; i < want.outputs.size(); ++i) {
    if (got->outputs[i].SerializeAsString() != want.outputs[i].SerializeAsString()) {
      return ::testing::AssertionFailure()
             << "output " << want.outputs[i].name() << " differs: got " << got->outputs[i].ShortDebugString()
             << "\nwant " << want.outputs[i].ShortDebugString();
    }
  }
  return ::testing::AssertionSuccess();
}

// The fake forward: records every merged batch and can hold batches until the test lets them run.
class FakeModel {
 public:
  struct Batch {
    v1::TokenInputs merged;
    int micro_batches;
    absl::Time deadline;
    std::vector<int64_t> tags;  // the requests in it, in row order
  };

  absl::StatusOr<BatchOutputs> Run(const v1::TokenInputs& merged, int micro_batches, absl::Time deadline) {
    absl::MutexLock lock(&mu_);
    const int index = started_++;
    if (++in_flight_ > max_in_flight_) max_in_flight_ = in_flight_;
    Batch batch{merged, micro_batches, deadline, {}};
    for (int64_t r = 0; r < merged.rows(); ++r) {
      const int64_t tag = merged.input_ids(static_cast<int>(r * merged.seq()));
      if (batch.tags.empty() || batch.tags.back() != tag) batch.tags.push_back(tag);
    }
    batches_.push_back(std::move(batch));
    auto may_run = [this, index]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !gated_ || allowed_ > index; };
    mu_.Await(absl::Condition(&may_run));
    if (slow_ > absl::ZeroDuration()) {
      mu_.Unlock();
      absl::SleepFor(slow_);
      mu_.Lock();
    }
    --in_flight_;
    if (!fail_.ok()) return fail_;
    BatchOutputs out = Compute(merged);
    if (bad_shape_) out.outputs[2].set_shape(0, merged.rows() + 1);
    return out;
  }

  // From now on batch i runs only once Allow has been called for it.
  void Gate() {
    absl::MutexLock lock(&mu_);
    gated_ = true;
  }
  void Allow(int batches) {
    absl::MutexLock lock(&mu_);
    allowed_ += batches;
  }
  void Ungate() {
    absl::MutexLock lock(&mu_);
    gated_ = false;
  }
  void WaitStarted(int n) {
    absl::MutexLock lock(&mu_);
    auto started = [this, n]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return started_ >= n; };
    mu_.Await(absl::Condition(&started));
  }
  void FailWith(absl::Status status) {
    absl::MutexLock lock(&mu_);
    fail_ = std::move(status);
  }
  void BadShape() {
    absl::MutexLock lock(&mu_);
    bad_shape_ = true;
  }
  void Slow(absl::Duration d) {
    absl::MutexLock lock(&mu_);
    slow_ = d;
  }
  std::vector<Batch> batches() {
    absl::MutexLock lock(&mu_);
    return batches_;
  }
  std::vector<std::vector<int64_t>> tags() {
    std::vector<std::vector<int64_t>> out;
    for (const Batch& b : batches()) out.push_back(b.tags);
    return out;
  }
  int max_in_flight() {
    absl::MutexLock lock(&mu_);
    return max_in_flight_;
  }

 private:
  absl::Mutex mu_;
  bool gated_ ABSL_GUARDED_BY(mu_) = false;
  int allowed_ ABSL_GUARDED_BY(mu_) = 0;
  int started_ ABSL_GUARDED_BY(mu_) = 0;
  int in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  int max_in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status fail_ ABSL_GUARDED_BY(mu_);
  bool bad_shape_ ABSL_GUARDED_BY(mu_) = false;
  absl::Duration slow_ ABSL_GUARDED_BY(mu_);
  std::vector<Batch> batches_ ABSL_GUARDED_BY(mu_);
};

// Polls `done` (no assumption on how fast the machine is).
bool WaitUntil(const std::function<bool()>& done) {
  const absl::Time give_up = absl::Now() + absl::Seconds(60);
  while (!done()) {
    if (absl::Now() > give_up) return false;
    absl::SleepFor(absl::Milliseconds(1));
  }
  return true;
}

absl::Time Far() { return absl::Now() + absl::Minutes(10); }

class BatchQueueTest : public ::testing::Test {
 protected:
  void Start(BatchLimits limits, BatchPadding padding = {}) {
    queue_ = std::make_unique<BatchQueue>(
        limits, padding,
        [this](const v1::TokenInputs& m, int micro_batches, absl::Time d, const v1::ForwardWant&) {
          return model_.Run(m, micro_batches, d);
        },
        PerToken,
        [this](const BatchStats& s) {
          absl::MutexLock lock(&mu_);
          observed_.push_back(s);
        });
  }

  std::future<absl::StatusOr<BatchResult>> SubmitAsync(v1::TokenInputs tokens, absl::Time deadline,
                                                       std::function<bool()> cancelled = nullptr,
                                                       int micro_batches = 0) {
    return std::async(std::launch::async, [this, tokens = std::move(tokens), deadline, cancelled, micro_batches] {
      return queue_->Submit(tokens, deadline, cancelled, micro_batches);
    });
  }

  // Submits and waits until the request is queued, so that arrival order is the call order.
  std::future<absl::StatusOr<BatchResult>> Enqueue(v1::TokenInputs tokens, absl::Time deadline,
                                                   std::function<bool()> cancelled = nullptr, int micro_batches = 0) {
    const int before = queue_->queued();
    auto f = SubmitAsync(std::move(tokens), deadline, std::move(cancelled), micro_batches);
    EXPECT_TRUE(WaitUntil([&] { return queue_->queued() > before; }));
    return f;
  }

  // Holds every batch; submits a blocker (tag 1) and waits until it runs, so that what is
  // submitted next queues behind it.
  std::future<absl::StatusOr<BatchResult>> Block() {
    model_.Gate();
    auto f = SubmitAsync(Tokens(1, 1, 4), Far());
    model_.WaitStarted(1);
    return f;
  }

  std::vector<BatchStats> observed() {
    absl::MutexLock lock(&mu_);
    return observed_;
  }

  static bool Ready(const std::future<absl::StatusOr<BatchResult>>& f) {
    return f.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
  }

  FakeModel model_;
  absl::Mutex mu_;
  std::vector<BatchStats> observed_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<BatchQueue> queue_;
};

TEST_F(BatchQueueTest, LoneRequestRunsAsItCameWithoutDelay) {
  Start(BatchLimits{});
  const v1::TokenInputs tokens = Tokens(5, 2, 7);
  const absl::Time start = absl::Now();
  absl::StatusOr<BatchResult> r = queue_->Submit(tokens, Far());
  EXPECT_TRUE(SameAsAlone(r, tokens));
  // Generous: a delay of its own would be visible only as added latency.
  EXPECT_LT(absl::Now() - start, absl::Seconds(20));
  EXPECT_LT(r->queued, absl::Seconds(20));
  EXPECT_EQ(r->forward_seconds, 0.25);
  EXPECT_EQ(r->batch.requests, 1);
  EXPECT_EQ(r->batch.rows, 2);
  EXPECT_EQ(r->batch.seq, 7);
  EXPECT_EQ(r->batch.tokens, 14);
  const auto batches = model_.batches();
  ASSERT_EQ(batches.size(), 1u);
  EXPECT_EQ(batches[0].merged.SerializeAsString(), tokens.SerializeAsString());
  EXPECT_EQ(batches[0].micro_batches, 1);
  EXPECT_EQ(queue_->queued(), 0);
}

TEST_F(BatchQueueTest, MergesWhatQueuedWhileABatchRanAndSplitsRowsBack) {
  Start(BatchLimits{}, BatchPadding{/*pad_token_id=*/77});
  auto blocker = Block();
  const v1::TokenInputs a = Tokens(10, 2, 5), b = Tokens(11, 1, 9), c = Tokens(12, 3, 3);
  auto fa = Enqueue(a, Far());
  auto fb = Enqueue(b, Far());
  auto fc = Enqueue(c, Far());
  model_.Ungate();
  EXPECT_TRUE(SameAsAlone(blocker.get(), Tokens(1, 1, 4)));
  absl::StatusOr<BatchResult> ra = fa.get(), rb = fb.get(), rc = fc.get();
  EXPECT_TRUE(SameAsAlone(ra, a));
  EXPECT_TRUE(SameAsAlone(rb, b));
  EXPECT_TRUE(SameAsAlone(rc, c));
  EXPECT_EQ(ra->batch.requests, 3);
  EXPECT_EQ(ra->batch.rows, 6);
  EXPECT_EQ(ra->batch.seq, 9);
  EXPECT_EQ(ra->batch.tokens, 54);
  EXPECT_EQ(ra->forward_seconds, 0.25);

  const auto batches = model_.batches();
  ASSERT_EQ(batches.size(), 2u);
  EXPECT_THAT(batches[1].tags, ElementsAre(10, 11, 12));
  const v1::TokenInputs& m = batches[1].merged;
  EXPECT_EQ(m.rows(), 6);
  EXPECT_EQ(m.seq(), 9);
  ASSERT_EQ(m.input_ids_size(), 54);
  // a's second row: its own 5 tokens (the last its own padding), then the batch's padding.
  for (int p = 0; p < 9; ++p) {
    const int i = 9 + p;
    if (p < 5) {
      EXPECT_EQ(m.input_ids(i), a.input_ids(5 + p));
      EXPECT_EQ(m.attention_mask(i), a.attention_mask(5 + p));
      EXPECT_EQ(m.token_type_ids(i), a.token_type_ids(5 + p));
    } else {
      EXPECT_EQ(m.input_ids(i), 77);
      EXPECT_EQ(m.attention_mask(i), 0);
      EXPECT_EQ(m.token_type_ids(i), 0);
    }
  }
  EXPECT_EQ(observed().size(), 2u);
}

TEST_F(BatchQueueTest, EmptyMaskAndTypesMeanOnesAndZeros) {
  Start(BatchLimits{});
  auto blocker = Block();
  v1::TokenInputs bare = Tokens(10, 1, 4);
  bare.clear_attention_mask();
  bare.clear_token_type_ids();
  auto fa = Enqueue(bare, Far());
  auto fb = Enqueue(Tokens(11, 1, 6), Far());
  model_.Ungate();
  ASSERT_TRUE(blocker.get().ok());
  v1::TokenInputs full = bare;
  full.mutable_attention_mask()->Resize(4, 1);
  full.mutable_token_type_ids()->Resize(4, 0);
  EXPECT_TRUE(SameAsAlone(fa.get(), full));
  EXPECT_TRUE(SameAsAlone(fb.get(), Tokens(11, 1, 6)));
  ASSERT_EQ(model_.batches().size(), 2u);
  EXPECT_THAT(model_.batches()[1].tags, ElementsAre(10, 11));
}

TEST_F(BatchQueueTest, ManyConcurrentSubmittersGetExactlyTheirRowsWithinTheLimits) {
  BatchLimits limits;
  limits.max_batch_tokens = 256;
  limits.max_batch_requests = 5;
  // Rounded up to a multiple of 4 unless that passes 42 (a longest seq of 41 stays 41).
  Start(limits, BatchPadding{/*pad_token_id=*/0, /*seq_multiple=*/4, /*max_seq=*/42});
  constexpr int kThreads = 12;
  constexpr int kPerThread = 25;
  // The first batch is held until every other thread has queued, so merging surely happens.
  model_.Gate();
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([this, t, &failures] {
      std::mt19937 rng(t);
      for (int i = 0; i < kPerThread; ++i) {
        const int64_t rows = std::uniform_int_distribution<int64_t>(1, 4)(rng);
        const int64_t seq = std::uniform_int_distribution<int64_t>(1, 41)(rng);
        const int64_t tag = 100 + t * kPerThread + i;
        const v1::TokenInputs tokens = Tokens(tag, rows, seq);
        absl::StatusOr<BatchResult> r = queue_->Submit(tokens, Far());
        const ::testing::AssertionResult same = SameAsAlone(r, tokens);
        if (!same) {
          ADD_FAILURE() << "request " << tag << ": " << same.message();
          ++failures;
        }
      }
    });
  }
  ASSERT_TRUE(WaitUntil([this] {
    const std::vector<BatchStats> first = observed();  // the held batch may hold several already
    return first.size() == 1 && first[0].requests + queue_->queued() == kThreads;
  }));
  model_.Ungate();
  for (auto& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);

  EXPECT_EQ(model_.max_in_flight(), 1);  // one batch at a time
  const auto batches = model_.batches();
  const auto stats = observed();
  ASSERT_EQ(stats.size(), batches.size());
  int requests = 0;
  int merged = 0;
  std::set<int64_t> seen;
  for (size_t i = 0; i < batches.size(); ++i) {
    const BatchStats& s = stats[i];
    const v1::TokenInputs& m = batches[i].merged;
    requests += s.requests;
    if (s.requests > 1) ++merged;
    EXPECT_LE(s.requests, 5);
    EXPECT_LE(s.tokens, 256);
    EXPECT_EQ(s.tokens, s.rows * s.seq);
    EXPECT_EQ(m.rows(), s.rows);
    EXPECT_EQ(m.seq(), s.seq);
    EXPECT_EQ(m.input_ids_size(), s.tokens);
    EXPECT_EQ(static_cast<int>(batches[i].tags.size()), s.requests);
    if (s.requests > 1) {
      EXPECT_TRUE(s.seq % 4 == 0 || s.seq == 41) << s.seq;
    }
    for (int64_t tag : batches[i].tags) EXPECT_TRUE(seen.insert(tag).second) << "request " << tag << " ran twice";
  }
  EXPECT_EQ(requests, kThreads * kPerThread);
  EXPECT_GE(merged, 1);
}

TEST_F(BatchQueueTest, TokenLimitBoundsTheMergedBatch) {
  BatchLimits limits;
  limits.max_batch_tokens = 50;
  Start(limits);
  auto blocker = Block();
  std::vector<std::future<absl::StatusOr<BatchResult>>> fs;
  for (int i = 0; i < 6; ++i) fs.push_back(Enqueue(Tokens(10 + i, 2, 10), Far()));
  model_.Ungate();
  ASSERT_TRUE(blocker.get().ok());
  for (int i = 0; i < 6; ++i) {
    absl::StatusOr<BatchResult> r = fs[static_cast<size_t>(i)].get();
    EXPECT_TRUE(SameAsAlone(r, Tokens(10 + i, 2, 10)));
    EXPECT_EQ(r->batch.tokens, 40);  // a third request would make 60
  }
  EXPECT_THAT(model_.tags(),
              ElementsAre(ElementsAre(1), ElementsAre(10, 11), ElementsAre(12, 13), ElementsAre(14, 15)));
}

TEST_F(BatchQueueTest, RequestLimitBoundsTheMergedBatch) {
  BatchLimits limits;
  limits.max_batch_requests = 4;
  Start(limits);
  auto blocker = Block();
  std::vector<std::future<absl::StatusOr<BatchResult>>> fs;
  for (int i = 0; i < 6; ++i) fs.push_back(Enqueue(Tokens(10 + i, 1, 3), Far()));
  model_.Ungate();
  ASSERT_TRUE(blocker.get().ok());
  for (int i = 0; i < 6; ++i) EXPECT_TRUE(SameAsAlone(fs[static_cast<size_t>(i)].get(), Tokens(10 + i, 1, 3)));
  EXPECT_THAT(model_.tags(), ElementsAre(ElementsAre(1), ElementsAre(10, 11, 12, 13), ElementsAre(14, 15)));
}

TEST_F(BatchQueueTest, OversizeOrMalformedRequestIsInvalidArgument) {
  BatchLimits limits;
  limits.max_batch_tokens = 100;
  Start(limits);
  absl::StatusOr<BatchResult> r = queue_->Submit(Tokens(10, 3, 40), Far());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("120"));
  EXPECT_THAT(r.status().message(), HasSubstr("100"));
  EXPECT_THAT(r.status().message(), HasSubstr("--max_batch_tokens"));

  v1::TokenInputs short_ids = Tokens(10, 2, 4);
  short_ids.mutable_input_ids()->RemoveLast();
  EXPECT_EQ(queue_->Submit(short_ids, Far()).status().code(), absl::StatusCode::kInvalidArgument);
  v1::TokenInputs short_mask = Tokens(10, 2, 4);
  short_mask.mutable_attention_mask()->RemoveLast();
  EXPECT_EQ(queue_->Submit(short_mask, Far()).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(queue_->Submit(Tokens(10, 3, 4, /*choices=*/2), Far()).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(queue_->Submit(Tokens(10, 0, 4), Far()).status().code(), absl::StatusCode::kInvalidArgument);
  // Exactly the limit is fine.
  EXPECT_TRUE(SameAsAlone(queue_->Submit(Tokens(10, 2, 50), Far()), Tokens(10, 2, 50)));
  EXPECT_EQ(model_.batches().size(), 1u);
}

TEST_F(BatchQueueTest, DeadlineWhileQueuedIsNeverDispatched) {
  Start(BatchLimits{});
  auto blocker = Block();
  absl::StatusOr<BatchResult> r = queue_->Submit(Tokens(10, 1, 3), absl::Now() + absl::Milliseconds(50));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(r.status().message(), HasSubstr("queued"));
  EXPECT_EQ(queue_->queued(), 0);
  EXPECT_EQ(queue_->Submit(Tokens(11, 1, 3), absl::Now() - absl::Seconds(1)).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  model_.Ungate();
  EXPECT_TRUE(blocker.get().ok());
  EXPECT_THAT(model_.tags(), ElementsAre(ElementsAre(1)));
}

TEST_F(BatchQueueTest, DeadlineWhileRunningReturnsAtOnceAndTheBatchGoesOn) {
  BatchLimits limits;
  limits.max_batch_requests = 2;
  limits.max_batch_delay = absl::Hours(1);  // the two run together once both are in
  Start(limits);
  model_.Gate();
  // The margin only has to cover queueing the second request.
  const absl::Time soon = absl::Now() + absl::Seconds(3);
  const absl::Time later = Far();
  auto fa = Enqueue(Tokens(10, 1, 3), soon);
  auto fb = SubmitAsync(Tokens(11, 2, 5), later);
  model_.WaitStarted(1);
  ASSERT_THAT(model_.tags(), ElementsAre(ElementsAre(10, 11)));
  EXPECT_EQ(model_.batches()[0].deadline, later);  // the batch runs to its latest deadline
  absl::StatusOr<BatchResult> ra = fa.get();       // returns while the batch is still held
  EXPECT_EQ(ra.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(ra.status().message(), HasSubstr("batch ran"));
  EXPECT_FALSE(Ready(fb));
  model_.Allow(1);
  EXPECT_TRUE(SameAsAlone(fb.get(), Tokens(11, 2, 5)));
}

TEST_F(BatchQueueTest, CancelledWhileQueuedIsNeverDispatched) {
  Start(BatchLimits{});
  auto blocker = Block();
  std::atomic<bool> gone_a{false}, gone_b{false};
  auto fa = Enqueue(Tokens(10, 1, 3), Far(), [&gone_a] { return gone_a.load(); });
  auto fb = Enqueue(Tokens(11, 1, 3), Far(), [&gone_b] { return gone_b.load(); });
  auto fc = Enqueue(Tokens(12, 1, 3), Far());
  gone_a = true;  // noticed by its own Submit within 20 ms
  absl::StatusOr<BatchResult> ra = fa.get();
  EXPECT_EQ(ra.status().code(), absl::StatusCode::kCancelled);
  EXPECT_THAT(ra.status().message(), HasSubstr("queued"));
  EXPECT_EQ(queue_->queued(), 2);
  gone_b = true;  // at once before dispatch: whoever notices first, it is not sent
  model_.Ungate();
  EXPECT_TRUE(blocker.get().ok());
  EXPECT_EQ(fb.get().status().code(), absl::StatusCode::kCancelled);
  EXPECT_TRUE(SameAsAlone(fc.get(), Tokens(12, 1, 3)));
  EXPECT_THAT(model_.tags(), ElementsAre(ElementsAre(1), ElementsAre(12)));
}

TEST_F(BatchQueueTest, CancelledWhileRunningReturnsAtOnceAndTheBatchGoesOn) {
  Start(BatchLimits{});
  auto blocker = Block();
  std::atomic<bool> gone{false};
  auto fa = Enqueue(Tokens(10, 1, 3), Far(), [&gone] { return gone.load(); });
  auto fb = Enqueue(Tokens(11, 1, 4), Far());
  model_.Allow(1);
  model_.WaitStarted(2);
  ASSERT_THAT(model_.tags(), ElementsAre(ElementsAre(1), ElementsAre(10, 11)));
  gone = true;
  absl::StatusOr<BatchResult> ra = fa.get();
  EXPECT_EQ(ra.status().code(), absl::StatusCode::kCancelled);
  EXPECT_THAT(ra.status().message(), HasSubstr("batch ran"));
  EXPECT_FALSE(Ready(fb));
  model_.Allow(1);
  EXPECT_TRUE(blocker.get().ok());
  EXPECT_TRUE(SameAsAlone(fb.get(), Tokens(11, 1, 4)));
}

TEST_F(BatchQueueTest, ForwardErrorGoesToEveryRequestOfTheBatch) {
  Start(BatchLimits{});
  auto blocker = Block();
  auto fa = Enqueue(Tokens(10, 1, 3), Far());
  auto fb = Enqueue(Tokens(11, 2, 6), Far());
  model_.FailWith(absl::UnavailableError("rank 1 failed"));
  model_.Ungate();
  EXPECT_EQ(blocker.get().status(), absl::UnavailableError("rank 1 failed"));  // held before; fails too
  EXPECT_EQ(fa.get().status(), absl::UnavailableError("rank 1 failed"));
  EXPECT_EQ(fb.get().status(), absl::UnavailableError("rank 1 failed"));
  EXPECT_THAT(model_.tags(), ElementsAre(ElementsAre(1), ElementsAre(10, 11)));
}

TEST_F(BatchQueueTest, OutputThatDoesNotFitTheBatchIsAnErrorForAll) {
  Start(BatchLimits{});
  auto blocker = Block();
  auto fa = Enqueue(Tokens(10, 1, 3), Far());
  auto fb = Enqueue(Tokens(11, 2, 6), Far());
  model_.BadShape();
  model_.Ungate();
  EXPECT_TRUE(blocker.get().ok());
  for (auto* f : {&fa, &fb}) {
    absl::StatusOr<BatchResult> r = f->get();
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInternal);
    EXPECT_THAT(r.status().message(), HasSubstr("pooler_output"));
  }
}

TEST_F(BatchQueueTest, DelayMergesRequestsArrivingWithinItAndEndsWhenTheBatchIsFull) {
  BatchLimits limits;
  limits.max_batch_requests = 2;
  limits.max_batch_delay = absl::Hours(1);
  Start(limits);
  auto fa = Enqueue(Tokens(10, 1, 3), Far());  // waits for company, not an hour
  EXPECT_FALSE(Ready(fa));
  auto fb = SubmitAsync(Tokens(11, 1, 8), Far());
  EXPECT_TRUE(SameAsAlone(fa.get(), Tokens(10, 1, 3)));
  EXPECT_TRUE(SameAsAlone(fb.get(), Tokens(11, 1, 8)));
  EXPECT_THAT(model_.tags(), ElementsAre(ElementsAre(10, 11)));
}

TEST_F(BatchQueueTest, DelayEndsForALoneRequest) {
  BatchLimits limits;
  limits.max_batch_delay = absl::Milliseconds(100);
  Start(limits);
  absl::StatusOr<BatchResult> r = queue_->Submit(Tokens(10, 1, 3), Far());
  EXPECT_TRUE(SameAsAlone(r, Tokens(10, 1, 3)));
  EXPECT_GE(r->queued, absl::Milliseconds(100));
  EXPECT_EQ(r->batch.requests, 1);
}

TEST_F(BatchQueueTest, DestructorFailsQueuedRequestsAndDoesNotHang) {
  Start(BatchLimits{});
  auto blocker = Block();
  auto fa = Enqueue(Tokens(10, 1, 3), Far());
  auto fb = Enqueue(Tokens(11, 1, 3), Far());
  std::thread destroy([this] { queue_.reset(); });
  // The queued ones fail while the running batch is still held.
  for (auto* f : {&fa, &fb}) {
    absl::StatusOr<BatchResult> r = f->get();
    EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable);
    EXPECT_THAT(r.status().message(), HasSubstr("job is going away"));
  }
  EXPECT_FALSE(Ready(blocker));
  model_.Ungate();
  destroy.join();
  EXPECT_TRUE(SameAsAlone(blocker.get(), Tokens(1, 1, 4)));
  EXPECT_THAT(model_.tags(), ElementsAre(ElementsAre(1)));
}

TEST_F(BatchQueueTest, ClosedQueueRefusesRequests) {
  Start(BatchLimits{});
  queue_->Close("job job-3 failed");
  queue_->Close("again");
  absl::StatusOr<BatchResult> r = queue_->Submit(Tokens(10, 1, 3), Far());
  EXPECT_EQ(r.status(), absl::UnavailableError("job job-3 failed"));
  EXPECT_TRUE(model_.batches().empty());
}

TEST_F(BatchQueueTest, GroupsByLengthButTheOldestRunsFirst) {
  BatchLimits limits;
  limits.max_batch_requests = 2;
  Start(limits);
  auto blocker = Block();
  auto fa = Enqueue(Tokens(10, 1, 8), Far());
  auto fb = Enqueue(Tokens(11, 1, 64), Far());
  auto fc = Enqueue(Tokens(12, 1, 10), Far());
  auto fd = Enqueue(Tokens(13, 1, 12), Far());
  model_.Ungate();
  ASSERT_TRUE(blocker.get().ok());
  EXPECT_TRUE(SameAsAlone(fa.get(), Tokens(10, 1, 8)));
  EXPECT_TRUE(SameAsAlone(fb.get(), Tokens(11, 1, 64)));
  EXPECT_TRUE(SameAsAlone(fc.get(), Tokens(12, 1, 10)));
  EXPECT_TRUE(SameAsAlone(fd.get(), Tokens(13, 1, 12)));
  // 10 goes with 12 (closest length), not 11 (next in line); 11, the oldest then, is not passed
  // over again.
  EXPECT_THAT(model_.tags(), ElementsAre(ElementsAre(1), ElementsAre(10, 12), ElementsAre(11, 13)));
}

TEST_F(BatchQueueTest, MicroBatchedRunAloneAndOnlyEqualChoicesMerge) {
  Start(BatchLimits{});
  auto blocker = Block();
  auto fa = Enqueue(Tokens(10, 2, 4), Far(), nullptr, /*micro_batches=*/2);
  auto fb = Enqueue(Tokens(11, 1, 5), Far());
  auto fc = Enqueue(Tokens(12, 4, 6, /*choices=*/2), Far());
  auto fd = Enqueue(Tokens(13, 6, 9, /*choices=*/2), Far());
  auto fe = Enqueue(Tokens(14, 2, 3), Far());
  auto ff = Enqueue(Tokens(15, 3, 3, /*choices=*/3), Far());
  model_.Ungate();
  ASSERT_TRUE(blocker.get().ok());
  EXPECT_TRUE(SameAsAlone(fa.get(), Tokens(10, 2, 4)));
  EXPECT_TRUE(SameAsAlone(fb.get(), Tokens(11, 1, 5)));
  absl::StatusOr<BatchResult> rc = fc.get();
  EXPECT_TRUE(SameAsAlone(rc, Tokens(12, 4, 6, 2)));
  EXPECT_TRUE(SameAsAlone(fd.get(), Tokens(13, 6, 9, 2)));
  EXPECT_TRUE(SameAsAlone(fe.get(), Tokens(14, 2, 3)));
  EXPECT_TRUE(SameAsAlone(ff.get(), Tokens(15, 3, 3, 3)));
  EXPECT_THAT(model_.tags(),
              ElementsAre(ElementsAre(1), ElementsAre(10), ElementsAre(11, 14), ElementsAre(12, 13), ElementsAre(15)));
  const auto batches = model_.batches();
  EXPECT_EQ(batches[1].micro_batches, 2);  // the micro-batched request, alone and as it came
  EXPECT_EQ(batches[1].merged.SerializeAsString(), Tokens(10, 2, 4).SerializeAsString());
  EXPECT_EQ(batches[2].micro_batches, 1);
  // The multiple-choice logits came back one row per question: 2 of the merged 5.
  ASSERT_TRUE(rc.ok());
  EXPECT_EQ(rc->batch.rows, 10);
  EXPECT_EQ(batches[3].merged.choices(), 2);
  EXPECT_THAT(rc->outputs[3].shape(), ElementsAre(2, 2));
}

// Regrouping (BatchLimits::regroup_delay). The delays are long where a test shows that a batch
// does not wait for them, so that only a wrong rule, not a slow machine, can fail it.
BatchLimits Regroup(absl::Duration delay) {
  BatchLimits limits;
  limits.regroup_delay = delay;
  return limits;
}

TEST_F(BatchQueueTest, LoneClientNeverWaitsForRegroup) {
  Start(Regroup(absl::Seconds(5)));
  for (int i = 0; i < 5; ++i) {
    // Its own next request is the one the last forward answered coming back: no wait.
    const absl::Time start = absl::Now();
    absl::StatusOr<BatchResult> r = queue_->Submit(Tokens(10 + i, 1, 3), Far());
    EXPECT_TRUE(SameAsAlone(r, Tokens(10 + i, 1, 3)));
    EXPECT_LT(absl::Now() - start, absl::Seconds(2)) << "request " << i;
    EXPECT_LT(r->queued, absl::Seconds(2)) << "request " << i;
  }
  EXPECT_EQ(model_.batches().size(), 5u);
}

TEST_F(BatchQueueTest, ClosedLoopCallersInDifferentBatchesRegroupIntoOne) {
  Start(Regroup(absl::Seconds(20)));
  model_.Gate();
  auto fa = SubmitAsync(Tokens(10, 1, 3), Far());
  model_.WaitStarted(1);
  auto fb = Enqueue(Tokens(11, 1, 5), Far());  // queues behind a's forward
  model_.Ungate();
  EXPECT_TRUE(SameAsAlone(fa.get(), Tokens(10, 1, 3)));
  // a's caller sends again; b waited for it instead of running alone.
  const absl::Time again = absl::Now();
  auto fa2 = SubmitAsync(Tokens(12, 1, 4), Far());
  absl::StatusOr<BatchResult> rb = fb.get();
  EXPECT_TRUE(SameAsAlone(rb, Tokens(11, 1, 5)));
  EXPECT_TRUE(SameAsAlone(fa2.get(), Tokens(12, 1, 4)));
  EXPECT_EQ(rb->batch.requests, 2);
  EXPECT_LT(absl::Now() - again, absl::Seconds(10));  // a's return ended the wait, not the delay
  EXPECT_THAT(model_.tags(), ElementsAre(ElementsAre(10), ElementsAre(11, 12)));
}

TEST_F(BatchQueueTest, WithoutRegroupTheAnsweredCallerWaitsForTheNextBatch) {
  Start(Regroup(absl::ZeroDuration()));
  model_.Gate();
  auto fa = SubmitAsync(Tokens(10, 1, 3), Far());
  model_.WaitStarted(1);
  auto fb = Enqueue(Tokens(11, 1, 5), Far());
  model_.Allow(1);
  EXPECT_TRUE(SameAsAlone(fa.get(), Tokens(10, 1, 3)));
  // b runs alone as soon as a's forward ends (held at the gate), before a's caller is back.
  ASSERT_TRUE(WaitUntil([this] { return model_.batches().size() == 2; }));
  auto fa2 = SubmitAsync(Tokens(12, 1, 4), Far());
  model_.Ungate();
  absl::StatusOr<BatchResult> rb = fb.get();
  EXPECT_TRUE(SameAsAlone(rb, Tokens(11, 1, 5)));
  EXPECT_EQ(rb->batch.requests, 1);
  EXPECT_TRUE(SameAsAlone(fa2.get(), Tokens(12, 1, 4)));
  EXPECT_THAT(model_.tags(), ElementsAre(ElementsAre(10), ElementsAre(11), ElementsAre(12)));
}

TEST_F(BatchQueueTest, RegroupWaitsForAsManyRequestsAsTheLastForwardAnswered) {
  Start(Regroup(absl::Seconds(20)));
  auto blocker = Block();  // tag 1, held
  auto f10 = Enqueue(Tokens(10, 1, 3), Far());
  auto f11 = Enqueue(Tokens(11, 1, 3), Far());
  model_.Allow(1);
  ASSERT_TRUE(blocker.get().ok());
  // The blocker's caller comes back: 10, 11 and it make a forward of 3 (held).
  auto f9 = SubmitAsync(Tokens(9, 1, 3), Far());
  model_.WaitStarted(2);
  // EXPECT, not ASSERT, while a batch is held: the futures wait for their requests when destroyed.
  EXPECT_THAT(model_.tags(), ElementsAre(ElementsAre(1), ElementsAre(10, 11, 9)));
  auto f12 = Enqueue(Tokens(12, 1, 3), Far());
  model_.Ungate();
  for (auto* f : {&f9, &f10, &f11}) EXPECT_TRUE(f->get().ok());
  // Two of its three callers come back: not yet.
  // Queued one after the other (so in this order), unless dispatched at once (wrongly).
  auto f13 = SubmitAsync(Tokens(13, 1, 3), Far());
  ASSERT_TRUE(WaitUntil([this] { return queue_->queued() == 2 || model_.batches().size() > 2; }));
  auto f14 = SubmitAsync(Tokens(14, 1, 3), Far());
  ASSERT_TRUE(WaitUntil([this] { return queue_->queued() == 3 || model_.batches().size() > 2; }));
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_EQ(model_.batches().size(), 2u);
  // The third does.
  const absl::Time third = absl::Now();
  auto f15 = SubmitAsync(Tokens(15, 1, 3), Far());
  absl::StatusOr<BatchResult> r12 = f12.get();
  EXPECT_TRUE(SameAsAlone(r12, Tokens(12, 1, 3)));
  EXPECT_EQ(r12->batch.requests, 4);
  EXPECT_LT(absl::Now() - third, absl::Seconds(10));
  for (auto* f : {&f13, &f14, &f15}) EXPECT_TRUE(f->get().ok());
  EXPECT_THAT(model_.tags(), ElementsAre(ElementsAre(1), ElementsAre(10, 11, 9), ElementsAre(12, 13, 14, 15)));
}

TEST_F(BatchQueueTest, RegroupWaitEndsAtTheDelayWhenTheCallersDoNotComeBack) {
  const absl::Duration delay = absl::Seconds(2);
  Start(Regroup(delay));
  model_.Gate();
  auto fa = SubmitAsync(Tokens(10, 1, 3), Far());
  model_.WaitStarted(1);
  auto fb = Enqueue(Tokens(11, 1, 5), Far());
  model_.Ungate();
  EXPECT_TRUE(fa.get().ok());  // and a's caller never sends again
  if (fb.wait_for(std::chrono::seconds(60)) != std::future_status::ready) {
    queue_->Close("the regroup wait did not end");  // so that fb's destructor does not wait forever
    FAIL() << "the regroup wait did not end";
  }
  absl::StatusOr<BatchResult> rb = fb.get();
  EXPECT_TRUE(SameAsAlone(rb, Tokens(11, 1, 5)));
  EXPECT_EQ(rb->batch.requests, 1);
  // b queued before a's forward ended, so its queueing covers the whole wait.
  EXPECT_GE(rb->queued, delay * 0.9);
  EXPECT_THAT(model_.tags(), ElementsAre(ElementsAre(10), ElementsAre(11)));
}

TEST_F(BatchQueueTest, FullBatchDoesNotWaitForRegroup) {
  BatchLimits limits = Regroup(absl::Seconds(20));
  limits.max_batch_requests = 2;
  Start(limits);
  auto blocker = Block();
  auto fa = Enqueue(Tokens(10, 1, 3), Far());
  auto fb = Enqueue(Tokens(11, 1, 3), Far());
  const absl::Time start = absl::Now();
  model_.Ungate();
  ASSERT_TRUE(blocker.get().ok());
  absl::StatusOr<BatchResult> ra = fa.get();
  EXPECT_TRUE(SameAsAlone(ra, Tokens(10, 1, 3)));
  EXPECT_TRUE(SameAsAlone(fb.get(), Tokens(11, 1, 3)));
  EXPECT_EQ(ra->batch.requests, 2);
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
}

TEST_F(BatchQueueTest, CloseDuringARegroupWaitFailsTheWaitingRequestsAtOnce) {
  Start(Regroup(absl::Seconds(20)));
  model_.Gate();
  auto fa = SubmitAsync(Tokens(10, 1, 3), Far());
  model_.WaitStarted(1);
  auto fb = Enqueue(Tokens(11, 1, 5), Far());
  auto fc = Enqueue(Tokens(12, 1, 5), Far());
  model_.Ungate();
  EXPECT_TRUE(fa.get().ok());  // b and c now wait for a's caller
  const absl::Time start = absl::Now();
  queue_->Close("job job-7 failed");
  for (auto* f : {&fb, &fc}) EXPECT_EQ(f->get().status(), absl::UnavailableError("job job-7 failed"));
  EXPECT_EQ(queue_->Submit(Tokens(13, 1, 3), Far()).status(), absl::UnavailableError("job job-7 failed"));
  queue_.reset();  // the queue's thread leaves its wait too
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  EXPECT_THAT(model_.tags(), ElementsAre(ElementsAre(10)));
}

TEST_F(BatchQueueTest, DeadlineAndCancellationHoldDuringARegroupWait) {
  Start(Regroup(absl::Seconds(20)));
  model_.Gate();
  auto fa = SubmitAsync(Tokens(10, 1, 3), Far());
  model_.WaitStarted(1);
  // The margin only has to cover queueing both and ending a's forward.
  auto fb = Enqueue(Tokens(11, 1, 5), absl::Now() + absl::Seconds(3));
  std::atomic<bool> gone{false};
  auto fc = Enqueue(Tokens(12, 1, 5), Far(), [&gone] { return gone.load(); });
  model_.Ungate();
  EXPECT_TRUE(fa.get().ok());
  const absl::Time start = absl::Now();
  gone = true;
  absl::StatusOr<BatchResult> rc = fc.get();
  EXPECT_EQ(rc.status().code(), absl::StatusCode::kCancelled);
  EXPECT_THAT(rc.status().message(), HasSubstr("queued"));
  absl::StatusOr<BatchResult> rb = fb.get();
  EXPECT_EQ(rb.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(rb.status().message(), HasSubstr("queued"));
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  EXPECT_EQ(queue_->queued(), 0);
  // a's caller coming back runs at once: neither b nor c was sent.
  absl::StatusOr<BatchResult> rd = queue_->Submit(Tokens(13, 1, 3), Far());
  EXPECT_TRUE(SameAsAlone(rd, Tokens(13, 1, 3)));
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  EXPECT_THAT(model_.tags(), ElementsAre(ElementsAre(10), ElementsAre(13)));
}

}  // namespace
}  // namespace bertshard::server
