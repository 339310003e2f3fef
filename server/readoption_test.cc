#include "server/readoption.h"

#include "gtest/gtest.h"

namespace bertshard::server {
namespace {

using Outcome = ReadoptionDecision::Outcome;

RankReport Report(int rank, int64_t next_sequence, int world_size = 2) {
  RankReport r;
  r.worker_id = "worker-" + std::to_string(rank + 10);
  r.address = "10.0.0." + std::to_string(rank) + ":50061";
  r.shard.set_job_id("job-1");
  r.shard.set_rank(rank);
  r.shard.set_world_size(world_size);
  r.shard.set_next_sequence(next_sequence);
  return r;
}

ReadoptionInput TwoRanks() {
  ReadoptionInput in;
  in.world_size = 2;
  in.grace = absl::Seconds(5);
  for (int rank = 0; rank < 2; ++rank) {
    v1::RankAssignment a;
    a.set_rank(rank);
    a.set_worker_id("worker-" + std::to_string(rank + 1) + "-old");
    a.set_worker_address("10.0.0." + std::to_string(rank) + ":50061");
    in.previous.push_back(a);
  }
  return in;
}

TEST(DecideReadoption, AdoptsWhenEveryRankAgrees) {
  ReadoptionInput in = TwoRanks();
  in.reports = {Report(1, 7), Report(0, 7)};
  const ReadoptionDecision d = DecideReadoption(in);
  ASSERT_EQ(d.outcome, Outcome::kAdopt) << d.cause;
  EXPECT_EQ(d.next_sequence, 7);
  EXPECT_EQ(d.rank_workers, (std::vector<std::string>{"worker-10", "worker-11"}));
}

TEST(DecideReadoption, WaitsForMissingRanksDuringTheGracePeriod) {
  ReadoptionInput in = TwoRanks();
  in.reports = {Report(0, 3)};
  const ReadoptionDecision d = DecideReadoption(in);
  EXPECT_EQ(d.outcome, Outcome::kWait);
  EXPECT_EQ(d.waiting_for, "rank 1");
}

TEST(DecideReadoption, FailsNamingRanksMissingAfterTheGracePeriod) {
  ReadoptionInput in = TwoRanks();
  in.reports = {Report(0, 3)};
  in.grace_over = true;
  const ReadoptionDecision d = DecideReadoption(in);
  ASSERT_EQ(d.outcome, Outcome::kFail);
  EXPECT_EQ(d.cause,
            "after a coordinator restart rank 1 (last on worker worker-2-old at 10.0.0.1:50061) did not "
            "come back within 5s");
}

TEST(DecideReadoption, FailsAtOnceWhenAMissingRanksWorkerCameBackWithoutIt) {
  ReadoptionInput in = TwoRanks();
  in.lost = {1};  // rank 0 has not come back yet either: no reason to wait for it
  const ReadoptionDecision d = DecideReadoption(in);
  ASSERT_EQ(d.outcome, Outcome::kFail);
  EXPECT_EQ(d.cause,
            "after a coordinator restart rank 1 (worker worker-2-old at 10.0.0.1:50061 registered again "
            "without it) cannot come back");
}

TEST(DecideReadoption, FailsWhenRanksDisagreeOnTheSequence) {
  ReadoptionInput in = TwoRanks();
  in.reports = {Report(0, 5), Report(1, 4)};
  const ReadoptionDecision d = DecideReadoption(in);
  ASSERT_EQ(d.outcome, Outcome::kFail);
  EXPECT_NE(d.cause.find("disagree on the next forward (rank 0: 5, rank 1: 4)"), std::string::npos) << d.cause;
}

TEST(DecideReadoption, FailsOnBrokenDuplicateOrMisfitRanks) {
  ReadoptionInput in = TwoRanks();
  RankReport broken = Report(1, 4);
  broken.shard.set_broken("gloo: connection closed");
  in.reports = {Report(0, 4), broken};
  ReadoptionDecision d = DecideReadoption(in);
  ASSERT_EQ(d.outcome, Outcome::kFail);
  EXPECT_NE(d.cause.find("rank 1 on worker worker-11 at 10.0.0.1:50061 came back broken: gloo"), std::string::npos)
      << d.cause;

  RankReport running = Report(1, 0);
  running.shard.set_forward_running(true);
  in.reports = {Report(0, 4), running};
  d = DecideReadoption(in);
  ASSERT_EQ(d.outcome, Outcome::kFail);
  EXPECT_NE(d.cause.find("rank 1 on worker worker-11 at 10.0.0.1:50061 was still running a forward"), std::string::npos)
      << d.cause;

  in.reports = {Report(0, 4), Report(0, 4)};
  d = DecideReadoption(in);
  ASSERT_EQ(d.outcome, Outcome::kFail);
  EXPECT_NE(d.cause.find("rank 0 is held by two workers"), std::string::npos) << d.cause;

  in.reports = {Report(0, 4, /*world_size=*/4)};
  d = DecideReadoption(in);
  ASSERT_EQ(d.outcome, Outcome::kFail);
  EXPECT_NE(d.cause.find("of a world of 4; the job's plan has 2 ranks"), std::string::npos) << d.cause;
}

TEST(DecideReadoption, LoadingJobWithUnfinishedRanksFailsWithThatCause) {
  ReadoptionInput in = TwoRanks();
  in.was_loading = true;
  in.reports = {Report(0, 0)};
  in.lost = {1};
  ReadoptionDecision d = DecideReadoption(in);
  ASSERT_EQ(d.outcome, Outcome::kFail);
  EXPECT_NE(d.cause.find("the coordinator restarted while the job was loading; rank 1"), std::string::npos) << d.cause;
  // Every rank finished loading before the restart: nothing was cut off, the job is whole.
  in.reports.push_back(Report(1, 0));
  d = DecideReadoption(in);
  EXPECT_EQ(d.outcome, Outcome::kAdopt) << d.cause;
}

}  // namespace
}  // namespace bertshard::server
