#include "client/load_progress.h"

#include <vector>

#include "gtest/gtest.h"

namespace bertshard::client {
namespace {

constexpr int64_t kMiB = 1 << 20;

// A LOADING event with each rank's (loaded, total); a total of 0 is a rank that has not reported.
v1::JobEvent Event(const std::vector<std::pair<int64_t, int64_t>>& ranks) {
  v1::JobEvent event;
  event.mutable_job()->set_state(v1::LOADING);
  for (size_t r = 0; r < ranks.size(); ++r) {
    v1::RankProgress* p = event.add_ranks();
    p->set_rank(static_cast<int>(r));
    p->mutable_progress()->set_bytes_loaded(ranks[r].first);
    p->mutable_progress()->set_bytes_total(ranks[r].second);
  }
  return event;
}

// The demo's sequence: four ranks (40 + 8 + 20 + 20 MiB) reporting one after another. Summed
// from the events alone it read 65%, 100%, 55%, ...; against the plan's total it only goes up.
const std::vector<v1::JobEvent>& DemoEvents() {
  static const auto* events = new std::vector<v1::JobEvent>{
      Event({{26 * kMiB, 40 * kMiB}, {0, 0}, {0, 0}, {0, 0}}),
      Event({{40 * kMiB, 40 * kMiB}, {0, 0}, {0, 0}, {0, 0}}),
      Event({{40 * kMiB, 40 * kMiB}, {4 * kMiB, 8 * kMiB}, {0, 0}, {0, 0}}),
      Event({{40 * kMiB, 40 * kMiB}, {8 * kMiB, 8 * kMiB}, {0, 0}, {0, 0}}),
      Event({{40 * kMiB, 40 * kMiB}, {8 * kMiB, 8 * kMiB}, {10 * kMiB, 20 * kMiB}, {0, 0}}),
      Event({{40 * kMiB, 40 * kMiB}, {8 * kMiB, 8 * kMiB}, {20 * kMiB, 20 * kMiB}, {20 * kMiB, 20 * kMiB}}),
  };
  return *events;
}

TEST(JobLoadProgress, AgainstThePlansTotalTheBarOnlyMovesForward) {
  JobLoadProgress progress(88 * kMiB);
  std::vector<int> percents;
  for (const v1::JobEvent& e : DemoEvents()) {
    const LoadReading r = progress.Update(e);
    EXPECT_EQ(r.total, 88 * kMiB);
    percents.push_back(r.percent);
  }
  EXPECT_EQ(percents, (std::vector<int>{29, 45, 50, 54, 65, 100}));
}

TEST(JobLoadProgress, WithoutThePlanThePercentStillNeverGoesBack) {
  JobLoadProgress progress(0);
  std::vector<int> percents;
  for (const v1::JobEvent& e : DemoEvents()) percents.push_back(progress.Update(e).percent);
  // Summed alone these read 65, 100, 91, 100, 85, 100: held at 100 until the end.
  EXPECT_EQ(percents, (std::vector<int>{65, 100, 100, 100, 100, 100}));
}

TEST(JobLoadProgress, ARankStartingOverKeepsWhatItHadPlaced) {
  JobLoadProgress progress(20 * kMiB);
  EXPECT_EQ(progress.Update(Event({{10 * kMiB, 10 * kMiB}, {5 * kMiB, 10 * kMiB}})).percent, 75);
  const LoadReading restarted = progress.Update(Event({{10 * kMiB, 10 * kMiB}, {1 * kMiB, 10 * kMiB}}));
  EXPECT_EQ(restarted.percent, 75);
  EXPECT_EQ(restarted.loaded, 15 * kMiB);
  EXPECT_EQ(progress.Update(Event({{10 * kMiB, 10 * kMiB}, {10 * kMiB, 10 * kMiB}})).percent, 100);
}

TEST(JobLoadProgress, RanksReportingMoreThanThePlanRaiseTheTotal) {
  JobLoadProgress progress(10 * kMiB);
  const LoadReading r = progress.Update(Event({{5 * kMiB, 10 * kMiB}, {5 * kMiB, 10 * kMiB}}));
  EXPECT_EQ(r.total, 20 * kMiB);
  EXPECT_EQ(r.percent, 50);
  EXPECT_EQ(JobLoadProgress(0).Update(Event({{0, 0}})).percent, 0);  // nothing known: 0%, no division
}

// Two replicas of a 1-rank plan: their rank 0s are two ranks, and the job is loaded when both are.
TEST(JobLoadProgress, EachReplicasRanksCountOnTheirOwn) {
  JobLoadProgress progress(2 * 10 * kMiB);
  v1::JobEvent event;
  for (int replica = 0; replica < 2; ++replica) {
    v1::RankProgress* r = event.add_ranks();
    r->set_rank(0);
    r->set_replica(replica);
    r->mutable_progress()->set_bytes_loaded(replica == 0 ? 10 * kMiB : 0);
    r->mutable_progress()->set_bytes_total(10 * kMiB);
  }
  const LoadReading half = progress.Update(event);
  EXPECT_EQ(half.loaded, 10 * kMiB);
  EXPECT_EQ(half.total, 20 * kMiB);
  EXPECT_EQ(half.percent, 50);
  event.mutable_ranks(1)->mutable_progress()->set_bytes_loaded(10 * kMiB);
  EXPECT_EQ(progress.Update(event).percent, 100);
}

TEST(PlanBytes, SumsEveryRanksParamBytes) {
  v1::ShardPlan plan;
  plan.add_ranks()->set_param_bytes(3);
  plan.add_ranks()->set_param_bytes(4);
  EXPECT_EQ(PlanBytes(plan), 7);
}

}  // namespace
}  // namespace bertshard::client
