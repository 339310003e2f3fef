// BatchQueue regrouping (BatchLimits::regroup_delay): closed-loop callers answered by one forward
// are waited for so that they merge again, a lone caller never waits, the wait ends at the delay,
// when the batch is full or when the queue closes, and deadlines and cancellation hold during it.
#include <atomic>
#include <chrono>
#include <future>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
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
