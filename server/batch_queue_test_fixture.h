// File: server/batch_queue_test_fixture.h
// -----------------------------------------------------------------------------
// What the BatchQueue tests share (batch_queue_test, batch_queue_regroup_test, _fairness_test,
// _lanes_test): a fake forward
// whose outputs depend per row on that row's real tokens only (so any mix-up of rows or positions
// shows), FakeModel, which records every merged batch and can hold batches at a gate until the test
// lets them run, and BatchQueueTest, a fixture with a queue in front of it.
//
// Example:
//   TEST_F(BatchQueueTest, Something) {
//     Start(BatchLimits{});
//     auto blocker = Block();  // tag 1 runs, held; what is submitted next queues behind it
//     auto f = Enqueue(Tokens(10, 1, 3), Far());
//     model_.Ungate();
//     EXPECT_TRUE(SameAsAlone(f.get(), Tokens(10, 1, 3)));
//   }
//
// Failure model: mismatches are gtest assertion results; WaitUntil gives up after 60 s.
//
// Thread safety: FakeModel and the fixture's observer are thread-safe (the queue's lane threads
// call them, several at once with several lanes); the rest is called from the test's thread.
#ifndef BERTSHARD_SERVER_BATCH_QUEUE_TEST_FIXTURE_H_
#define BERTSHARD_SERVER_BATCH_QUEUE_TEST_FIXTURE_H_

#include <algorithm>
#include <chrono>
#include <functional>
#include <future>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "server/batch_queue.h"

namespace bertshard::server::batch_queue_testing {

inline constexpr int64_t kHidden = 3;

inline bool PerToken(const std::string& name) { return name == "last_hidden_state" || name == "start_logits"; }

// A forward whose outputs depend per row on that row's real tokens only (and, per token, on the
// position's own token), so any mix-up of rows or positions shows and masked padding changes
// nothing. All values are small integers or halves: exact in float.
inline BatchOutputs Compute(const v1::TokenInputs& t) {
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
inline v1::TokenInputs Tokens(int64_t tag, int64_t rows, int64_t seq, int64_t choices = 1) {
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
inline ::testing::AssertionResult SameAsAlone(const absl::StatusOr<BatchResult>& got, const v1::TokenInputs& tokens) {
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
    int in_flight = 0;          // batches in Run when it entered, itself included
  };

  absl::StatusOr<BatchOutputs> Run(const v1::TokenInputs& merged, int micro_batches, absl::Time deadline) {
    absl::MutexLock lock(&mu_);
    const int index = started_++;
    if (++in_flight_ > max_in_flight_) max_in_flight_ = in_flight_;
    if (on_start_) {  // without mu_: it may call into the queue
      const std::function<void(int)> on_start = on_start_;
      mu_.Unlock();
      on_start(index);
      mu_.Lock();
    }
    Batch batch{merged, micro_batches, deadline, {}, in_flight_};
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
  // Whether n batches have entered Run within `timeout` (false: a test fails instead of hanging).
  bool WaitStarted(int n, absl::Duration timeout) {
    absl::MutexLock lock(&mu_);
    auto started = [this, n]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return started_ >= n; };
    return mu_.AwaitWithTimeout(absl::Condition(&started), timeout);
  }
  // Called at the start of every batch's Run, with its index, on the queue's lane thread.
  void OnStart(std::function<void(int index)> on_start) {
    absl::MutexLock lock(&mu_);
    on_start_ = std::move(on_start);
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
  int in_flight() {
    absl::MutexLock lock(&mu_);
    return in_flight_;
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
  std::function<void(int)> on_start_ ABSL_GUARDED_BY(mu_);
};

// Polls `done` (no assumption on how fast the machine is).
inline bool WaitUntil(const std::function<bool()>& done) {
  const absl::Time give_up = absl::Now() + absl::Seconds(60);
  while (!done()) {
    if (absl::Now() > give_up) return false;
    absl::SleepFor(absl::Milliseconds(1));
  }
  return true;
}

inline absl::Time Far() { return absl::Now() + absl::Minutes(10); }

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
                                                       std::function<bool()> cancelled = nullptr, int micro_batches = 0,
                                                       Caller caller = {}) {
    return std::async(std::launch::async,
                      [this, tokens = std::move(tokens), deadline, cancelled, micro_batches, caller] {
                        return queue_->Submit(tokens, deadline, cancelled, micro_batches, EveryOutput(), caller);
                      });
  }

  // Submits and waits until the request is queued, so that arrival order is the call order.
  std::future<absl::StatusOr<BatchResult>> Enqueue(v1::TokenInputs tokens, absl::Time deadline,
                                                   std::function<bool()> cancelled = nullptr, int micro_batches = 0,
                                                   Caller caller = {}) {
    const int before = queue_->queued();
    auto f = SubmitAsync(std::move(tokens), deadline, std::move(cancelled), micro_batches, std::move(caller));
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

}  // namespace bertshard::server::batch_queue_testing

#endif  // BERTSHARD_SERVER_BATCH_QUEUE_TEST_FIXTURE_H_
