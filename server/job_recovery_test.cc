#include "server/job_recovery.h"

#include <fcntl.h>
#include <stdio.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "planner/planner.h"

namespace bertshard::server {
namespace {

v1::PlanRequest Request() {
  v1::PlanRequest request;
  request.set_variant(v1::BERT_FOR_MASKED_LM);
  request.mutable_parallel()->set_tp_size(2);  // BERT-base's configuration: no checkpoint to read
  return request;
}

class RecoverStoredJobsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto store = jobs::JobStore::Open(":memory:");
    ASSERT_TRUE(store.ok()) << store.status();
    store_ = *std::move(store);
  }

  // Stores job `id` as a stopped coordinator left it in `state`, with its plan unless `no_plan`.
  void Store(const std::string& id, v1::JobState state, bool no_plan = false) {
    v1::Job job;
    job.set_id(id);
    *job.mutable_request() = Request();
    job.set_submitted_by("host:10.0.0.1");
    auto plan = planner::Plan(Request());
    ASSERT_TRUE(plan.ok()) << plan.status();
    ASSERT_TRUE(store_->Create(job, no_plan ? nullptr : &*plan).ok());
    v1::RankAssignment a;
    a.set_rank(0);
    a.set_worker_id("old-0");
    a.set_worker_address("127.0.0.1:9");
    ASSERT_TRUE(store_->SetRanks(id, {a}).ok());
    for (v1::JobState s : {v1::PLANNED, v1::LOADING, v1::READY}) {
      if (state == v1::PENDING) break;
      ASSERT_TRUE(store_->Transition(id, s, "").ok());
      if (s == state) break;
    }
    if (state == v1::FAILED) {
      ASSERT_TRUE(store_->Transition(id, v1::FAILED, "before").ok());
    }
  }

  absl::StatusOr<std::vector<RecoveredJob>> Recover() {
    return RecoverStoredJobs(*store_, common::ModelRoot(), deadline_,
                             [this](const absl::Status& s, const std::string& what) {
                               if (!s.ok()) refusals_.push_back(what);
                             });
  }

  std::unique_ptr<jobs::JobStore> store_;
  const absl::Time deadline_ = absl::Now() + absl::Seconds(10);
  std::vector<std::string> refusals_;
};

TEST_F(RecoverStoredJobsTest, SettlesEachStoredJobByItsState) {
  ASSERT_NO_FATAL_FAILURE(Store("job-pending", v1::PENDING));
  ASSERT_NO_FATAL_FAILURE(Store("job-planned", v1::PLANNED));
  ASSERT_NO_FATAL_FAILURE(Store("job-loading", v1::LOADING));
  ASSERT_NO_FATAL_FAILURE(Store("job-ready", v1::READY));
  ASSERT_NO_FATAL_FAILURE(Store("job-failed", v1::FAILED));
  auto recovered = Recover();
  ASSERT_TRUE(recovered.ok()) << recovered.status();
  ASSERT_EQ(recovered->size(), 4u);  // the ended one is left as it is
  std::map<std::string, const RecoveredJob*> by_id;
  for (const RecoveredJob& j : *recovered) by_id[j.job.id()] = &j;
  ASSERT_EQ(by_id.count("job-failed"), 0u);

  const RecoveredJob& pending = *by_id.at("job-pending");
  EXPECT_EQ(pending.job.state(), v1::PENDING);
  EXPECT_TRUE(pending.recoveries.empty());
  EXPECT_EQ(pending.backend, "gloo");  // stored before backends
  EXPECT_EQ(pending.plan.world_size(), 2);

  // Nothing was loading: back to PENDING, ranks cleared, saying why.
  const RecoveredJob& planned = *by_id.at("job-planned");
  EXPECT_EQ(planned.job.state(), v1::PENDING);
  EXPECT_EQ(planned.pending_note, "the coordinator restarted before loading");
  EXPECT_EQ(planned.job.pending_reason().rfind("the coordinator restarted before loading; ", 0), 0u)
      << planned.job.pending_reason();
  EXPECT_EQ(store_->Get("job-planned")->ranks_size(), 0);
  EXPECT_EQ(store_->Get("job-planned")->state(), v1::PENDING);

  for (const char* id : {"job-loading", "job-ready"}) {
    const RecoveredJob& j = *by_id.at(id);
    ASSERT_EQ(j.recoveries.size(), 1u) << id;
    const JobRecovery& recovery = *j.recoveries.at(0);  // stored before replicas: replica 0
    EXPECT_EQ(recovery.deadline, deadline_);
    EXPECT_EQ(recovery.was_loading, std::string(id) == "job-loading");
    ASSERT_EQ(recovery.previous.size(), 1u);
    EXPECT_EQ(recovery.previous[0].worker_address(), "127.0.0.1:9");
    EXPECT_EQ(store_->Get(id)->state(), std::string(id) == "job-loading" ? v1::LOADING : v1::READY);
  }
  EXPECT_TRUE(refusals_.empty());
}

// The latest placement's wait says whether a job recovers: a recovery's reason up to its count; a
// first placement's, or a READY after the loss, is none.
TEST(StoredRecovery, IsTheLastPendingReasonWhenItWasARecovery) {
  v1::Job job;
  const auto add = [&job](v1::JobState state, const std::string& reason) {
    v1::StateChange* c = job.add_history();
    c->set_state(state);
    c->set_reason(reason);
  };
  add(v1::PENDING, "waiting for 2 healthy idle CPU workers (gloo)");
  add(v1::PLANNED, "2 workers assigned");
  EXPECT_EQ(StoredRecovery(job), "");
  add(v1::LOADING, "");
  add(v1::READY, "");
  add(v1::PENDING, "recovering: lost worker w (rank 1) at h:1 (its pod) failed (restart 3 of at most 5); waiting (x)");
  add(v1::PLANNED, "2 workers assigned");
  EXPECT_EQ(StoredRecovery(job), "recovering: lost worker w (rank 1) at h:1 (its pod) failed (restart 3 of at most 5)");
  add(v1::LOADING, "");
  add(v1::READY, "");
  EXPECT_EQ(StoredRecovery(job), "");
}

// Jobs stored before plans were are planned again (and the plan stored); one that cannot be planned
// any more is FAILED with the cause.
TEST_F(RecoverStoredJobsTest, PlansAgainOrFailsJobsStoredWithoutAPlan) {
  ASSERT_NO_FATAL_FAILURE(Store("job-old", v1::READY, /*no_plan=*/true));
  v1::Job broken;
  broken.set_id("job-broken");
  *broken.mutable_request() = Request();
  broken.mutable_request()->mutable_parallel()->set_tp_size(5);  // 12 heads do not split 5 ways
  ASSERT_TRUE(store_->Create(broken).ok());
  auto recovered = Recover();
  ASSERT_TRUE(recovered.ok()) << recovered.status();
  ASSERT_EQ(recovered->size(), 1u);
  EXPECT_EQ((*recovered)[0].job.id(), "job-old");
  EXPECT_TRUE(store_->GetPlan("job-old")->has_value());
  const v1::Job failed = *store_->Get("job-broken");
  EXPECT_EQ(failed.state(), v1::FAILED);
  EXPECT_NE(failed.failure_cause().find("the coordinator restarted and cannot plan the job"), std::string::npos)
      << failed.DebugString();
}

// Each replica of a READY job waits for its own ranks (by RankAssignment.replica); a replica with
// no ranks stored has none to wait for (it is placed again).
TEST_F(RecoverStoredJobsTest, EachReplicaWithStoredRanksWaitsForItsOwn) {
  ASSERT_NO_FATAL_FAILURE(Store("job-ready", v1::READY));
  std::vector<v1::RankAssignment> ranks;
  for (int32_t replica : {0, 2}) {
    for (int32_t rank : {0, 1}) {
      v1::RankAssignment a;
      a.set_rank(rank);
      a.set_replica(replica);
      a.set_worker_id(absl::StrCat("w", replica, rank));
      a.set_worker_address(absl::StrCat("127.0.0.1:", 10 * replica + rank + 1));
      ranks.push_back(a);
    }
  }
  ASSERT_TRUE(store_->SetRanks("job-ready", ranks).ok());
  ASSERT_TRUE(store_->SetReplicas("job-ready", 3).ok());
  auto recovered = Recover();
  ASSERT_TRUE(recovered.ok()) << recovered.status();
  ASSERT_EQ(recovered->size(), 1u);
  const RecoveredJob& job = (*recovered)[0];
  EXPECT_EQ(job.job.replicas(), 3);
  ASSERT_EQ(job.recoveries.size(), 2u);
  for (int32_t replica : {0, 2}) {
    const JobRecovery& recovery = *job.recoveries.at(replica);
    ASSERT_EQ(recovery.previous.size(), 2u) << replica;
    for (const v1::RankAssignment& a : recovery.previous) EXPECT_EQ(a.replica(), replica);
    EXPECT_EQ(recovery.previous[1].worker_id(), absl::StrCat("w", replica, 1));
  }
  EXPECT_EQ(job.recoveries.count(1), 0u);
}

RankReport Report(const std::string& worker, int rank, int64_t next_sequence) {
  RankReport r;
  r.worker_id = worker;
  r.address = "127.0.0.1:" + std::to_string(9 + rank);
  r.shard.set_job_id("job-1");
  r.shard.set_rank(rank);
  r.shard.set_world_size(2);
  r.shard.set_next_sequence(next_sequence);
  return r;
}

TEST(JobRecovery, SaysWhichRanksItWaitsForAndDecidesOnWhatCameBack) {
  JobRecovery recovery;
  recovery.deadline = absl::FromUnixSeconds(1767225600);  // 2026-01-01T00:00:00Z
  EXPECT_EQ(recovery.Describe(2),
            "the coordinator restarted; waiting until 2026-01-01T00:00:00+00:00 for ranks 0, 1 of 2 to come back");
  recovery.reports.push_back(Report("w0", 0, 7));
  EXPECT_NE(recovery.Describe(2).find("for rank 1 of 2"), std::string::npos) << recovery.Describe(2);
  const absl::Time before = recovery.deadline - absl::Seconds(1);
  EXPECT_EQ(recovery.Decide(2, before, absl::Seconds(10)).outcome, ReadoptionDecision::Outcome::kWait);
  EXPECT_EQ(recovery.Decide(2, recovery.deadline, absl::Seconds(10)).outcome, ReadoptionDecision::Outcome::kFail);
  recovery.reports.push_back(Report("w1", 1, 7));
  const ReadoptionDecision adopt = recovery.Decide(2, before, absl::Seconds(10));
  ASSERT_EQ(adopt.outcome, ReadoptionDecision::Outcome::kAdopt);
  EXPECT_EQ(adopt.rank_workers, (std::vector<std::string>{"w0", "w1"}));
  EXPECT_EQ(adopt.next_sequence, 7);
  recovery.ForgetWorker("w0");  // it registers again: its report counts again when it comes
  ASSERT_EQ(recovery.reports.size(), 1u);
  EXPECT_EQ(recovery.reports[0].worker_id, "w1");
}

v1::HeldShard Held(const std::string& job, int rank) {
  v1::HeldShard h;
  h.set_job_id(job);
  h.set_rank(rank);
  h.set_world_size(2);
  return h;
}

TEST(SortHeldShards, ReportsForRecoveringJobsTheRestToUnload) {
  JobRecovery recovery;
  v1::RankAssignment was;
  was.set_rank(1);
  was.set_worker_address("127.0.0.1:9");  // this worker's address held rank 1 before the restart
  recovery.previous.push_back(was);
  const std::map<std::string, JobRecovery*> recovering = {{"job-1", &recovery}};
  const auto known = [](const std::string& job) {
    if (job == "job-silent") return HeldJob::kStoreSilent;
    if (job == "job-1" || job == "job-running") return HeldJob::kKnown;
    return HeldJob::kUnknown;
  };
  v1::WorkerInfo worker;
  worker.set_worker_id("w0");
  worker.set_address("127.0.0.1:9");
  google::protobuf::RepeatedPtrField<v1::HeldShard> held;
  *held.Add() = Held("job-gone", 0);
  *held.Add() = Held("job-silent", 0);
  *held.Add() = Held("job-1", 0);
  *held.Add() = Held("job-running", 1);  // known, but the worker is taken back for job-1 first
  const HeldShards sorted = SortHeldShards(worker, held, known, recovering);
  EXPECT_EQ(sorted.unload, (std::vector<std::string>{"job-gone", "job-running"}));
  ASSERT_TRUE(sorted.taken_back.has_value());
  EXPECT_EQ(*sorted.taken_back, std::make_pair(std::string("job-1"), 0));
  ASSERT_EQ(recovery.reports.size(), 1u);
  EXPECT_EQ(recovery.reports[0].worker_id, "w0");
  EXPECT_EQ(recovery.reports[0].shard.rank(), 0);
  // It held rank 1 before and does not now: lost, so the job is decided at once.
  EXPECT_EQ(recovery.lost, std::set<int>{1});
  EXPECT_EQ(sorted.decide, std::set<std::string>{"job-1"});
}

TEST(SortHeldShards, AWorkerKeepsTheShardItServes) {
  JobRecovery recovery;
  const std::map<std::string, JobRecovery*> recovering = {{"job-1", &recovery}};
  v1::WorkerInfo worker;
  worker.set_worker_id("w0");
  worker.set_address("127.0.0.1:9");
  worker.set_job_id("job-2");
  worker.set_rank(1);
  google::protobuf::RepeatedPtrField<v1::HeldShard> held;
  *held.Add() = Held("job-2", 1);
  *held.Add() = Held("job-1", 0);  // busy with job-2: not taken back, unloads
  *held.Add() = Held("job-2", 0);  // job-2 placed again here as rank 1: its shard, not to drop
  const HeldShards sorted = SortHeldShards(
      worker, held, [](const std::string&) { return HeldJob::kKnown; }, recovering);
  EXPECT_EQ(sorted.unload, std::vector<std::string>{"job-1"});
  EXPECT_FALSE(sorted.taken_back.has_value());
  EXPECT_TRUE(recovery.reports.empty());
  EXPECT_TRUE(sorted.decide.empty());
}

// Issue 21's rename race on the coordinator's side: config.json swapped with a link leading out of
// the root (to a config of another shape) as fast as the box allows, for 2 s, while the Plan RPC's
// path (LocalPlanRequest, then the planner) runs. No plan is ever made from the outside config.
TEST(LocalPlanRequest, ARenameRaceNeverPlansFromAFileOutsideTheRoot) {
  namespace fs = std::filesystem;
  const fs::path base = fs::path(std::getenv("TEST_TMPDIR")) / "plan_race";
  fs::remove_all(base);
  fs::create_directories(base / "models" / "bert");
  fs::create_directories(base / "models" / "spare");
  fs::create_directories(base / "outside");
  const auto config = [](int hidden) {
    return R"({"architectures": ["BertForMaskedLM"], "hidden_size": )" + std::to_string(hidden) +
           R"(, "num_attention_heads": 2, "intermediate_size": 64, "num_hidden_layers": 2})";
  };
  std::ofstream(base / "models" / "bert" / "config.json") << config(32);
  std::ofstream(base / "outside" / "config.json") << config(64);
  fs::create_symlink(base / "outside" / "config.json", base / "models" / "spare" / "config.json");
  const std::string inside = (base / "models" / "bert" / "config.json").string();
  const std::string spare = (base / "models" / "spare" / "config.json").string();
  const common::ModelRoot root = common::ModelRoot::Open((base / "models").string()).value();

  std::atomic<bool> stop{false};
  std::thread swapper([&] {
    while (!stop.load()) renameat2(AT_FDCWD, inside.c_str(), AT_FDCWD, spare.c_str(), RENAME_EXCHANGE);
  });
  int inside_plans = 0, outside_plans = 0, refused = 0;
  v1::PlanRequest request;
  request.set_checkpoint("bert");
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  while (std::chrono::steady_clock::now() < end) {
    absl::StatusOr<v1::PlanRequest> local = LocalPlanRequest(root, request);
    absl::StatusOr<v1::ShardPlan> plan = local.ok() ? planner::Plan(*local) : local.status();
    if (!plan.ok()) {
      ++refused;
      continue;
    }
    (plan->config().hidden_size() == 32 ? inside_plans : outside_plans) += 1;
  }
  stop = true;
  swapper.join();
  std::cerr << "plans of the inside config " << inside_plans << ", of the outside one " << outside_plans << ", refused "
            << refused << "\n";
  EXPECT_GT(inside_plans + refused, 0);
  EXPECT_EQ(outside_plans, 0);
}

}  // namespace
}  // namespace bertshard::server
