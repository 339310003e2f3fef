#include "server/group_restarts.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace bertshard::server {
namespace {

RestartPolicy Policy(int max_restarts) {
  RestartPolicy p;
  p.max_restarts = max_restarts;
  p.backoff_initial = absl::Seconds(1);
  p.backoff_max = absl::Seconds(5);
  p.reset_after = absl::Minutes(10);
  return p;
}

TEST(GroupRestarts, BackoffStartsAtOnceThenDoublesUpToItsCap) {
  const RestartPolicy p = Policy(10);
  EXPECT_EQ(GroupRestarts::Backoff(p, 1), absl::ZeroDuration());
  EXPECT_EQ(GroupRestarts::Backoff(p, 2), absl::Seconds(1));
  EXPECT_EQ(GroupRestarts::Backoff(p, 3), absl::Seconds(2));
  EXPECT_EQ(GroupRestarts::Backoff(p, 4), absl::Seconds(4));
  EXPECT_EQ(GroupRestarts::Backoff(p, 5), absl::Seconds(5));
  EXPECT_EQ(GroupRestarts::Backoff(p, 1000), absl::Seconds(5));  // no overflow on a long run
}

TEST(GroupRestarts, EachLossInARowWaitsLongerAndIsDescribed) {
  GroupRestarts restarts(Policy(10));
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  EXPECT_FALSE(restarts.recovering());
  GroupRestarts::Decision d = restarts.Lost("worker w-1 (rank 0) at h:1 stopped heartbeating", t0);
  EXPECT_FALSE(d.give_up);
  EXPECT_EQ(d.restart, 1);
  EXPECT_EQ(d.not_before, t0);
  EXPECT_TRUE(restarts.recovering());
  EXPECT_EQ(restarts.Describe(), "lost worker w-1 (rank 0) at h:1 stopped heartbeating (restart 1 of at most 10)");
  // Loaded again, lost again soon after: a crash loop, so the next waits.
  restarts.Served(t0 + absl::Seconds(3));
  EXPECT_FALSE(restarts.recovering());
  EXPECT_EQ(restarts.Describe(), "");
  d = restarts.Lost("worker w-2 (rank 0) at h:2 is shutting down", t0 + absl::Seconds(4));
  EXPECT_EQ(d.restart, 2);
  EXPECT_EQ(d.not_before, t0 + absl::Seconds(5));
  // A load that fails (never served) counts too.
  d = restarts.Lost("worker w-3 (rank 0) at h:3: load failed", t0 + absl::Seconds(6));
  EXPECT_EQ(d.restart, 3);
  EXPECT_EQ(d.not_before, t0 + absl::Seconds(8));
  EXPECT_EQ(restarts.not_before(), t0 + absl::Seconds(8));
}

TEST(GroupRestarts, ServingLongEnoughStartsTheCountAgain) {
  GroupRestarts restarts(Policy(2));
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  restarts.Lost("a", t0);
  restarts.Served(t0 + absl::Seconds(1));
  restarts.Lost("b", t0 + absl::Seconds(2));
  restarts.Served(t0 + absl::Seconds(3));
  // Ten minutes of service since: this loss is the first of a new run, not the third.
  const GroupRestarts::Decision d = restarts.Lost("c", t0 + absl::Seconds(3) + absl::Minutes(10));
  EXPECT_FALSE(d.give_up);
  EXPECT_EQ(d.restart, 1);
  EXPECT_EQ(restarts.restarts(), 1);
}

TEST(GroupRestarts, GivesUpPastMaxRestartsNamingEveryLoss) {
  GroupRestarts restarts(Policy(2));
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  EXPECT_FALSE(restarts.Lost("worker w-1 died", t0).give_up);
  EXPECT_FALSE(restarts.Lost("worker w-2 died", t0 + absl::Seconds(1)).give_up);
  const GroupRestarts::Decision d = restarts.Lost("worker w-3 died", t0 + absl::Seconds(2));
  EXPECT_TRUE(d.give_up);
  EXPECT_EQ(d.cause,
            "lost its workers 3 times in a row (--max_restarts=2): 1) worker w-1 died; 2) worker w-2 died; 3) worker "
            "w-3 died");
  EXPECT_FALSE(restarts.recovering());
}

// Bounded: a long run keeps the last 10 causes only; the count and the give-up still say how many
// there were, and which ones are named.
TEST(GroupRestarts, KeepsTheLastTenCausesOfALongRun) {
  GroupRestarts restarts(Policy(1000));
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  for (int i = 1; i <= 1000; ++i) {
    ASSERT_FALSE(restarts.Lost(absl::StrCat("loss ", i), t0 + absl::Seconds(i)).give_up);
  }
  EXPECT_EQ(restarts.restarts(), 1000);
  EXPECT_EQ(restarts.Describe(), "lost loss 1000 (restart 1000 of at most 1000)");
  const GroupRestarts::Decision d = restarts.Lost("loss 1001", t0 + absl::Seconds(1001));
  ASSERT_TRUE(d.give_up);
  EXPECT_EQ(d.cause.rfind("lost its workers 1001 times in a row (--max_restarts=1000): the first 991 not kept; "
                          "992) loss 992; 993) loss 993; ",
                          0),
            0u)
      << d.cause;
  EXPECT_TRUE(absl::EndsWith(d.cause, "; 1001) loss 1001")) << d.cause;
  EXPECT_LT(d.cause.size(), 300u);
}

TEST(GroupRestarts, ZeroMaxRestartsEndsAtTheFirstLoss) {
  GroupRestarts restarts(Policy(0));
  const GroupRestarts::Decision d = restarts.Lost("worker w-1 died", absl::FromUnixSeconds(1));
  EXPECT_TRUE(d.give_up);
  EXPECT_TRUE(absl::StrContains(d.cause, "worker w-1 died")) << d.cause;
}

}  // namespace
}  // namespace bertshard::server
