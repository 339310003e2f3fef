#include "server/replica_autoscaler.h"

#include "gtest/gtest.h"

namespace bertshard::server {
namespace {

constexpr absl::Duration kTick = absl::Milliseconds(250);

class AutoscalerTest : public ::testing::Test {
 protected:
  // `ticks` samples, each with the serving replicas busy `fraction` of the tick; the last answer.
  int Run(int ticks, double fraction, int serving, int current, int min = 1, int max = 4) {
    int wanted = current;
    for (int i = 0; i < ticks; ++i) {
      now_ += kTick;
      wanted = autoscaler_.Observe(now_, kTick * (fraction * serving), serving, current, min, max);
      if (wanted != current) return wanted;
    }
    return wanted;
  }

  AutoscalePolicy policy_{0.7, absl::Seconds(2), absl::Seconds(10)};
  ReplicaAutoscaler autoscaler_{policy_};
  absl::Time now_ = absl::FromUnixSeconds(1000);
};

TEST_F(AutoscalerTest, AddsAReplicaOnlyOnceTheLoadHasLastedUpAfter) {
  autoscaler_.Observe(now_, absl::ZeroDuration(), 1, 1, 1, 4);  // starts the measuring
  EXPECT_EQ(Run(7, 1.0, 1, 1), 1);                              // 1.75 s of full load: not yet
  EXPECT_EQ(Run(1, 1.0, 1, 1), 2);                              // 2 s
  // Measured anew after a change (its first sample only starts it): another up_after.
  EXPECT_EQ(Run(8, 1.0, 2, 2), 2);
  EXPECT_EQ(Run(1, 1.0, 2, 2), 3);
}

TEST_F(AutoscalerTest, ABurstShorterThanUpAfterAddsNothing) {
  autoscaler_.Observe(now_, absl::ZeroDuration(), 1, 1, 1, 4);
  EXPECT_EQ(Run(4, 1.0, 1, 1), 1);
  EXPECT_EQ(Run(4, 0.2, 1, 1), 1);  // the last 2 s average 0.6: under the target
  EXPECT_EQ(Run(40, 0.65, 1, 1), 1);
}

TEST_F(AutoscalerTest, RemovesAReplicaOnlyWhenTheOthersWouldStayUnderTheTarget) {
  autoscaler_.Observe(now_, absl::ZeroDuration(), 2, 2, 1, 4);
  // 0.4 on two replicas is 0.8 on one: over the target, so both stay.
  EXPECT_EQ(Run(80, 0.4, 2, 2), 2);
  autoscaler_.Reset();
  autoscaler_.Observe(now_, absl::ZeroDuration(), 2, 2, 1, 4);
  EXPECT_EQ(Run(39, 0.2, 2, 2), 2);  // 9.75 s idle enough: not yet down_after
  EXPECT_EQ(Run(1, 0.2, 2, 2), 1);
}

TEST_F(AutoscalerTest, KeepsWithinTheBoundsAndWaitsForLoadingReplicas) {
  autoscaler_.Observe(now_, absl::ZeroDuration(), 2, 2, 2, 2);
  EXPECT_EQ(Run(80, 1.0, 2, 2, 2, 2), 2);  // at max
  EXPECT_EQ(Run(80, 0.0, 2, 2, 2, 2), 2);  // at min
  // A replica still loading: nothing is decided on the one that serves.
  EXPECT_EQ(Run(80, 1.0, 1, 2, 1, 4), 2);
  // Bounds that moved past the count bring it back inside.
  autoscaler_.Reset();
  EXPECT_EQ(Run(1, 0.5, 2, 2, 3, 4), 3);
}

// While the replica just added loads, the one serving does two's work: that is not the load two
// will see, and it must not call for a third the moment the second serves.
TEST_F(AutoscalerTest, WhatOneReplicaDidWhileTheOtherLoadedIsNotCounted) {
  autoscaler_.Observe(now_, absl::ZeroDuration(), 1, 1, 1, 4);
  EXPECT_EQ(Run(8, 1.0, 1, 1), 2);
  EXPECT_EQ(Run(40, 1.0, 1, 2), 2);  // 10 s loading, the one serving saturated
  EXPECT_EQ(Run(7, 0.6, 2, 2), 2);   // two serve, 0.6 each: no third
  EXPECT_EQ(Run(40, 0.6, 2, 2), 2);
}

// After a pause in the measuring (Reset: an update ran), the first sample only starts it again: a
// gap longer than down_after is no evidence of idleness.
TEST_F(AutoscalerTest, APauseInTheMeasuringIsNoEvidenceOfIdleness) {
  autoscaler_.Observe(now_, absl::ZeroDuration(), 2, 2, 1, 4);
  EXPECT_EQ(Run(4, 0.9, 2, 2), 2);
  autoscaler_.Reset();
  now_ += absl::Seconds(30);
  EXPECT_EQ(autoscaler_.Observe(now_, kTick, 2, 2, 1, 4), 2);
  EXPECT_EQ(Run(4, 0.9, 2, 2), 2);
}

TEST_F(AutoscalerTest, UtilisationOverAWindow) {
  EXPECT_EQ(autoscaler_.Utilisation(absl::Seconds(2)), 0);
  autoscaler_.Observe(now_, absl::ZeroDuration(), 2, 2, 1, 4);
  Run(8, 0.5, 2, 2, 2, 2);
  EXPECT_NEAR(autoscaler_.Utilisation(absl::Seconds(2)), 0.5, 1e-9);
}

}  // namespace
}  // namespace bertshard::server
