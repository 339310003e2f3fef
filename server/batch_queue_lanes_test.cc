// BatchQueue lanes (SetConcurrency, for a job's replicas): up to n batches run at once, each on its
// own thread; one lane never runs two; lowering never interrupts a running batch and dispatches
// nothing new while n or more run; raising lets a waiting batch start at once, from any thread;
// every caller gets its own rows; regrouping waits for the callers of the forward that ended;
// Close and the destructor with several lanes running.
#include <atomic>
#include <future>
#include <random>
#include <set>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/batch_queue.h"
#include "server/batch_queue_test_fixture.h"

namespace bertshard::server {
namespace {

using batch_queue_testing::BatchQueueTest;
using batch_queue_testing::Far;
using batch_queue_testing::SameAsAlone;
using batch_queue_testing::Tokens;
using batch_queue_testing::WaitUntil;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::UnorderedElementsAre;

using Result = std::future<absl::StatusOr<BatchResult>>;

// How long a test waits for what must happen: a thread to wake and start a forward, no work to
// speak of (a machine that slow fails it). Short enough that a queue without lanes fails every test
// within the target's timeout instead of timing it out. The tests never ASSERT while batches are
// held: the futures of held requests would wait for them when destroyed.
constexpr absl::Duration kPatience = absl::Seconds(15);
// How long a test looks for what must not happen: a wrong queue would do it at once, a right one
// never, so a slow machine can only miss a bug, never fail a right queue.
constexpr absl::Duration kLook = absl::Milliseconds(300);

// One request a batch, no regrouping: each request is a batch of its own, dispatched as soon as a
// lane is free.
BatchLimits OnePerBatch() {
  BatchLimits limits;
  limits.max_batch_requests = 1;
  limits.regroup_delay = absl::ZeroDuration();
  return limits;
}

TEST_F(BatchQueueTest, TwoLanesRunTwoBatchesAtOnce) {
  Start(OnePerBatch());
  queue_->SetConcurrency(2);
  model_.Gate();  // neither forward returns until both have entered
  Result a = SubmitAsync(Tokens(10, 1, 3), Far());
  Result b = SubmitAsync(Tokens(11, 2, 5), Far());
  const bool both = model_.WaitStarted(2, kPatience);
  EXPECT_TRUE(both) << "the second batch did not start while the first ran";
  EXPECT_EQ(model_.in_flight(), both ? 2 : 1);
  EXPECT_EQ(queue_->running(), both ? 2 : 1);
  model_.Ungate();
  EXPECT_TRUE(SameAsAlone(a.get(), Tokens(10, 1, 3)));
  EXPECT_TRUE(SameAsAlone(b.get(), Tokens(11, 2, 5)));
  EXPECT_EQ(model_.max_in_flight(), 2);
  EXPECT_THAT(model_.tags(), UnorderedElementsAre(ElementsAre(10), ElementsAre(11)));
  EXPECT_TRUE(WaitUntil([this] { return queue_->running() == 0; }));
}

// Four lane threads were started and are kept, but with one lane only one of them runs at once.
TEST_F(BatchQueueTest, OneLaneAfterFourRunsOneAtATimeUnderManySubmitters) {
  BatchLimits limits;
  limits.max_batch_tokens = 256;
  limits.max_batch_requests = 5;
  limits.max_client_queued_tokens = 1 << 20;  // the shares are batch_queue_fairness_test's
  Start(limits);
  queue_->SetConcurrency(4);
  model_.Gate();
  std::vector<Result> first;
  for (int i = 0; i < 4; ++i) {
    first.push_back(SubmitAsync(Tokens(10 + i, 1, 3), Far()));
    if (!model_.WaitStarted(i + 1, kPatience)) {
      ADD_FAILURE() << "lane " << i + 1 << " of 4 did not start";
      break;
    }
  }
  EXPECT_EQ(model_.max_in_flight(), 4);
  queue_->SetConcurrency(0);  // counts as 1
  model_.Ungate();
  for (Result& f : first) EXPECT_TRUE(f.get().ok());

  constexpr int kThreads = 12;
  constexpr int kPerThread = 20;
  std::atomic<int> failures{0};
  std::atomic<int> most_running{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([this, t, &failures, &most_running] {
      std::mt19937 rng(t);
      for (int i = 0; i < kPerThread; ++i) {
        const int64_t tag = 100 + t * kPerThread + i;
        const v1::TokenInputs tokens = Tokens(tag, std::uniform_int_distribution<int64_t>(1, 3)(rng),
                                              std::uniform_int_distribution<int64_t>(1, 30)(rng));
        absl::StatusOr<BatchResult> r = queue_->Submit(tokens, Far());
        if (!SameAsAlone(r, tokens)) ++failures;
        int seen = most_running.load();
        const int now = queue_->running();
        while (now > seen && !most_running.compare_exchange_weak(seen, now)) {
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_LE(most_running.load(), 1);
  const auto batches = model_.batches();
  ASSERT_GT(batches.size(), 4u);
  int requests = 0;
  for (size_t i = 4; i < batches.size(); ++i) {
    EXPECT_EQ(batches[i].in_flight, 1) << "batch " << i << " started while another ran";
    requests += static_cast<int>(batches[i].tags.size());
  }
  EXPECT_EQ(requests, kThreads * kPerThread);
}

TEST_F(BatchQueueTest, LoweringWhileTwoRunStartsNoThirdUntilBothEnd) {
  Start(OnePerBatch());
  queue_->SetConcurrency(2);
  model_.Gate();
  Result a = SubmitAsync(Tokens(10, 1, 3), Far());
  EXPECT_TRUE(model_.WaitStarted(1, kPatience));
  Result b = SubmitAsync(Tokens(11, 1, 3), Far());
  const bool both = model_.WaitStarted(2, kPatience);
  EXPECT_TRUE(both) << "the second lane did not start";
  Result c = Enqueue(Tokens(12, 1, 3), Far());
  Result d = Enqueue(Tokens(13, 1, 3), Far());
  queue_->SetConcurrency(1);
  EXPECT_EQ(queue_->running(), both ? 2 : 1);  // neither running batch was interrupted
  model_.Allow(1);                             // a ends; b still runs, so one lane is in use
  EXPECT_TRUE(SameAsAlone(a.get(), Tokens(10, 1, 3)));
  EXPECT_FALSE(model_.WaitStarted(3, kLook)) << "a third batch started while b still ran";
  EXPECT_EQ(queue_->queued(), 2);
  model_.Allow(1);  // b ends: now c, then d, one at a time
  EXPECT_TRUE(SameAsAlone(b.get(), Tokens(11, 1, 3)));
  model_.Ungate();
  EXPECT_TRUE(SameAsAlone(c.get(), Tokens(12, 1, 3)));
  EXPECT_TRUE(SameAsAlone(d.get(), Tokens(13, 1, 3)));
  const auto batches = model_.batches();
  ASSERT_EQ(batches.size(), 4u);
  EXPECT_THAT(batches[2].tags, ElementsAre(12));
  EXPECT_EQ(batches[2].in_flight, 1);
  EXPECT_EQ(batches[3].in_flight, 1);
}

TEST_F(BatchQueueTest, RaisingWhileOneRunsStartsAWaitingBatchAtOnce) {
  Start(OnePerBatch());
  auto blocker = Block();  // tag 1, held on the only lane
  Result a = Enqueue(Tokens(10, 1, 3), Far());
  EXPECT_FALSE(model_.WaitStarted(2, kLook)) << "one lane ran two batches";
  queue_->SetConcurrency(2);
  EXPECT_TRUE(model_.WaitStarted(2, kPatience)) << "raising the concurrency did not start the waiting batch";
  EXPECT_EQ(queue_->running(), 2);
  EXPECT_EQ(queue_->queued(), 0);
  EXPECT_THAT(model_.tags(), ElementsAre(ElementsAre(1), ElementsAre(10)));
  model_.Ungate();
  EXPECT_TRUE(SameAsAlone(blocker.get(), Tokens(1, 1, 4)));
  EXPECT_TRUE(SameAsAlone(a.get(), Tokens(10, 1, 3)));
}

// SetConcurrency does not block and calls nothing of the caller's: here it runs from inside the
// forward, while the caller's own lock is held.
TEST_F(BatchQueueTest, SetConcurrencyFromInsideTheForwardUnderTheCallersLock) {
  Start(OnePerBatch());
  absl::Mutex caller_mu;
  model_.OnStart([this, &caller_mu](int index) {
    absl::MutexLock lock(&caller_mu);
    if (index == 0) queue_->SetConcurrency(2);
  });
  model_.Gate();
  Result a = SubmitAsync(Tokens(10, 1, 3), Far());
  EXPECT_TRUE(model_.WaitStarted(1, kPatience));
  Result b = SubmitAsync(Tokens(11, 1, 3), Far());  // a's forward raised it: b starts beside a
  EXPECT_TRUE(model_.WaitStarted(2, kPatience)) << "the concurrency raised from the forward did not apply";
  model_.Ungate();
  EXPECT_TRUE(SameAsAlone(a.get(), Tokens(10, 1, 3)));
  EXPECT_TRUE(SameAsAlone(b.get(), Tokens(11, 1, 3)));
  EXPECT_EQ(model_.max_in_flight(), 2);
}

TEST_F(BatchQueueTest, EveryCallerGetsItsOwnRowsWithThreeLanes) {
  BatchLimits limits;
  limits.max_batch_tokens = 256;
  limits.max_batch_requests = 5;
  limits.max_client_queued_tokens = 1 << 20;
  Start(limits, BatchPadding{/*pad_token_id=*/0, /*seq_multiple=*/4, /*max_seq=*/42});
  queue_->SetConcurrency(3);
  constexpr int kThreads = 12;
  constexpr int kPerThread = 25;
  // The first three batches are held until they all run, so three lanes surely run at once, and
  // what the other threads send meanwhile queues and merges.
  model_.Gate();
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([this, t, &failures] {
      std::mt19937 rng(t);
      for (int i = 0; i < kPerThread; ++i) {
        const int64_t tag = 100 + t * kPerThread + i;
        const v1::TokenInputs tokens = Tokens(tag, std::uniform_int_distribution<int64_t>(1, 4)(rng),
                                              std::uniform_int_distribution<int64_t>(1, 41)(rng));
        absl::StatusOr<BatchResult> r = queue_->Submit(tokens, Far());
        const ::testing::AssertionResult same = SameAsAlone(r, tokens);
        if (!same) {
          ADD_FAILURE() << "request " << tag << ": " << same.message();
          ++failures;
        }
      }
    });
  }
  const bool three = model_.WaitStarted(3, kPatience);
  EXPECT_TRUE(three) << "three lanes did not run at once";
  if (three) {
    EXPECT_TRUE(WaitUntil([this] {
      int held = 0;
      for (const BatchStats& s : observed()) held += s.requests;
      return held + queue_->queued() == kThreads;
    }));
  }
  model_.Ungate();
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(model_.max_in_flight(), 3);
  const auto batches = model_.batches();
  const auto stats = observed();
  ASSERT_EQ(stats.size(), batches.size());
  int requests = 0;
  int merged = 0;
  std::set<int64_t> seen;
  for (size_t i = 0; i < batches.size(); ++i) {
    EXPECT_LE(batches[i].in_flight, 3);
    EXPECT_LE(batches[i].merged.rows() * batches[i].merged.seq(), 256);
    EXPECT_LE(batches[i].tags.size(), 5u);
    requests += static_cast<int>(batches[i].tags.size());
    if (batches[i].tags.size() > 1) ++merged;
    for (int64_t tag : batches[i].tags) EXPECT_TRUE(seen.insert(tag).second) << "request " << tag << " ran twice";
  }
  EXPECT_EQ(requests, kThreads * kPerThread);
  EXPECT_GE(merged, 1);
}

// A lane frees when its forward ends; the next batch waits for that forward's callers (not for
// those of the forward still running on the other lane) and runs beside it.
TEST_F(BatchQueueTest, RegroupWaitsForTheCallersOfTheForwardThatEnded) {
  BatchLimits limits = OnePerBatch();
  limits.max_batch_requests = 32;
  limits.regroup_delay = absl::Seconds(20);  // long: only the caller's return may end the wait
  Start(limits);
  queue_->SetConcurrency(2);
  model_.Gate();
  Result a = SubmitAsync(Tokens(10, 1, 3), Far());
  EXPECT_TRUE(model_.WaitStarted(1, kPatience));
  Result b = SubmitAsync(Tokens(11, 1, 3), Far());
  const bool both = model_.WaitStarted(2, kPatience);
  EXPECT_TRUE(both) << "the second lane did not start";
  Result c = Enqueue(Tokens(12, 1, 5), Far());  // both lanes busy: it queues
  model_.Allow(1);                              // a's forward ends, b's still runs
  EXPECT_TRUE(SameAsAlone(a.get(), Tokens(10, 1, 3)));
  const absl::Time again = absl::Now();
  Result a2 = SubmitAsync(Tokens(13, 1, 4), Far());  // a's caller comes back; c waited for it
  EXPECT_TRUE(model_.WaitStarted(3, kPatience));
  EXPECT_LT(absl::Now() - again, absl::Seconds(10));  // its return ended the wait, not the delay
  EXPECT_EQ(model_.in_flight(), both ? 2 : 1);        // beside b
  model_.Ungate();
  EXPECT_TRUE(SameAsAlone(b.get(), Tokens(11, 1, 3)));
  absl::StatusOr<BatchResult> rc = c.get();
  EXPECT_TRUE(SameAsAlone(rc, Tokens(12, 1, 5)));
  EXPECT_TRUE(SameAsAlone(a2.get(), Tokens(13, 1, 4)));
  EXPECT_EQ(rc->batch.requests, 2);
  EXPECT_THAT(model_.tags(), ElementsAre(ElementsAre(10), ElementsAre(11), ElementsAre(12, 13)));
}

TEST_F(BatchQueueTest, CloseWhileTwoRunFailsTheWaitingAndTheRunningFinish) {
  Start(OnePerBatch());
  queue_->SetConcurrency(2);
  model_.Gate();
  Result a = SubmitAsync(Tokens(10, 1, 3), Far());
  EXPECT_TRUE(model_.WaitStarted(1, kPatience));
  Result b = SubmitAsync(Tokens(11, 1, 3), Far());
  EXPECT_TRUE(model_.WaitStarted(2, kPatience)) << "the second lane did not start";
  Result c = Enqueue(Tokens(12, 1, 3), Far());
  Result d = Enqueue(Tokens(13, 1, 3), Far());
  queue_->Close("job job-9 failed");
  for (Result* f : {&c, &d}) EXPECT_EQ(f->get().status(), absl::UnavailableError("job job-9 failed"));
  EXPECT_EQ(queue_->Submit(Tokens(14, 1, 3), Far()).status(), absl::UnavailableError("job job-9 failed"));
  EXPECT_FALSE(Ready(a));
  EXPECT_FALSE(Ready(b));
  EXPECT_EQ(queue_->running(), 2);
  model_.Ungate();
  EXPECT_TRUE(SameAsAlone(a.get(), Tokens(10, 1, 3)));
  EXPECT_TRUE(SameAsAlone(b.get(), Tokens(11, 1, 3)));
  EXPECT_TRUE(WaitUntil([this] { return queue_->running() == 0; }));
  EXPECT_THAT(model_.tags(), ElementsAre(ElementsAre(10), ElementsAre(11)));
}

// Two lanes running and two idle (their threads started by the raise to 4): the destructor fails
// the waiting request, waits for both running batches and ends all four threads.
TEST_F(BatchQueueTest, DestructorWaitsForEveryRunningLane) {
  Start(OnePerBatch());
  queue_->SetConcurrency(4);
  queue_->SetConcurrency(2);
  model_.Gate();
  Result a = SubmitAsync(Tokens(10, 1, 3), Far());
  EXPECT_TRUE(model_.WaitStarted(1, kPatience));
  Result b = SubmitAsync(Tokens(11, 1, 3), Far());
  EXPECT_TRUE(model_.WaitStarted(2, kPatience)) << "the second lane did not start";
  Result c = Enqueue(Tokens(12, 1, 3), Far());
  std::atomic<bool> destroyed{false};
  std::thread destroy([this, &destroyed] {
    queue_.reset();
    destroyed = true;
  });
  absl::StatusOr<BatchResult> rc = c.get();
  EXPECT_EQ(rc.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(rc.status().message(), HasSubstr("job is going away"));
  EXPECT_FALSE(Ready(a));
  EXPECT_FALSE(Ready(b));
  EXPECT_FALSE(destroyed.load()) << "the destructor returned while two batches ran";
  model_.Allow(1);
  EXPECT_TRUE(SameAsAlone(a.get(), Tokens(10, 1, 3)));
  EXPECT_FALSE(destroyed.load()) << "the destructor returned while a batch ran";
  model_.Ungate();
  destroy.join();
  EXPECT_TRUE(SameAsAlone(b.get(), Tokens(11, 1, 3)));
  EXPECT_THAT(model_.tags(), ElementsAre(ElementsAre(10), ElementsAre(11)));
}

}  // namespace
}  // namespace bertshard::server
