#include "jobs/job_store.h"

#include <cstdlib>
#include <fstream>
#include <thread>

#include "gtest/gtest.h"

namespace bertshard::jobs {
namespace {

std::string DbPath(const std::string& name) { return std::string(std::getenv("TEST_TMPDIR")) + "/" + name; }

v1::Job NewJob(const std::string& id) {
  v1::Job job;
  job.set_id(id);
  job.mutable_request()->set_variant(v1::BERT_FOR_MASKED_LM);
  job.mutable_request()->mutable_parallel()->set_tp_size(2);
  return job;
}

JobStoreOptions FixedClock(int64_t* now) {
  return {.now_millis = [now] { return (*now)++; }};
}

TEST(JobStore, PersistsJobsAndHistoryAcrossReopen) {
  int64_t now = 1000;
  const std::string path = DbPath("persist.db");
  {
    auto store = JobStore::Open(path, FixedClock(&now));
    ASSERT_TRUE(store.ok()) << store.status();
    ASSERT_TRUE((*store)->Create(NewJob("job-1")).ok());
    ASSERT_TRUE((*store)->Create(NewJob("job-2")).ok());
    ASSERT_TRUE((*store)->Transition("job-1", v1::PLANNED, "4 workers").ok());
    ASSERT_TRUE((*store)->SetRanks("job-1", {[] {
                  v1::RankAssignment r;
                  r.set_rank(0);
                  r.set_worker_id("w0");
                  return r;
                }()}).ok());
    ASSERT_TRUE((*store)->Transition("job-1", v1::LOADING, "").ok());
  }
  auto store = JobStore::Open(path, FixedClock(&now));
  ASSERT_TRUE(store.ok()) << store.status();
  auto job = (*store)->Get("job-1");
  ASSERT_TRUE(job.ok());
  EXPECT_EQ(job->state(), v1::LOADING);
  EXPECT_EQ(job->request().parallel().tp_size(), 2);
  ASSERT_EQ(job->history_size(), 3);
  EXPECT_EQ(job->history(0).state(), v1::PENDING);
  EXPECT_EQ(job->history(1).reason(), "4 workers");
  EXPECT_LT(job->history(1).unix_millis(), job->history(2).unix_millis());
  EXPECT_EQ(job->ranks(0).worker_id(), "w0");
  auto all = (*store)->List();
  ASSERT_EQ(all->size(), 2u);
  EXPECT_EQ((*all)[0].id(), "job-1");
  // WAL mode is on.
  std::ifstream wal(path + "-wal");
  EXPECT_TRUE(wal.good());
}

TEST(JobStore, EnforcesTheLifeCycle) {
  auto store = JobStore::Open(":memory:");
  ASSERT_TRUE(store.ok());
  ASSERT_TRUE((*store)->Create(NewJob("j")).ok());
  EXPECT_EQ((*store)->Create(NewJob("j")).code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ((*store)->Create(NewJob("")).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*store)->Transition("j", v1::READY, "").status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*store)->Transition("nope", v1::PLANNED, "").status().code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE((*store)->Transition("j", v1::PLANNED, "").ok());
  auto pending = (*store)->Transition("j", v1::PENDING, "worker w3 left before loading");
  ASSERT_TRUE(pending.ok());
  EXPECT_EQ(pending->pending_reason(), "worker w3 left before loading");
  auto failed = (*store)->Transition("j", v1::FAILED, "worker w1 (rank 1) stopped heartbeating");
  ASSERT_TRUE(failed.ok());
  EXPECT_EQ(failed->failure_cause(), "worker w1 (rank 1) stopped heartbeating");
  EXPECT_EQ((*store)->Transition("j", v1::CANCELLED, "").status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(TransitionAllowed(v1::READY, v1::CANCELLED));
  EXPECT_FALSE(TransitionAllowed(v1::CANCELLED, v1::PENDING));
  EXPECT_FALSE(TransitionAllowed(v1::LOADING, v1::LOADING));
}

TEST(JobStore, RestartFailsJobsThatHadWorkers) {
  auto store = JobStore::Open(":memory:");
  for (const char* id : {"pending", "planned", "ready", "cancelled"}) ASSERT_TRUE((*store)->Create(NewJob(id)).ok());
  ASSERT_TRUE((*store)->Transition("planned", v1::PLANNED, "").ok());
  for (auto s : {v1::PLANNED, v1::LOADING, v1::READY}) ASSERT_TRUE((*store)->Transition("ready", s, "").ok());
  ASSERT_TRUE((*store)->Transition("cancelled", v1::CANCELLED, "").ok());
  auto failed = (*store)->FailJobsWithWorkers("coordinator restarted: workers must re-register");
  ASSERT_TRUE(failed.ok()) << failed.status();
  ASSERT_EQ(failed->size(), 2u);
  EXPECT_EQ((*store)->Get("ready")->state(), v1::FAILED);
  EXPECT_EQ((*store)->Get("pending")->state(), v1::PENDING);
  EXPECT_EQ((*store)->Get("cancelled")->state(), v1::CANCELLED);
}

TEST(JobStore, ConcurrentWritersAreSerialised) {
  auto store = JobStore::Open(DbPath("concurrent.db"));
  ASSERT_TRUE(store.ok());
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 25; ++i) {
        const std::string id = "t" + std::to_string(t) + "-" + std::to_string(i);
        EXPECT_TRUE((*store)->Create(NewJob(id)).ok());
        EXPECT_TRUE((*store)->Transition(id, v1::PLANNED, "").ok());
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ((*store)->List()->size(), 100u);
}

TEST(JobStore, RefusesFilesThatAreNotJobDatabases) {
  const std::string path = DbPath("not_a_db");
  std::ofstream(path) << "this is not sqlite, just text that is long enough to look like a header....";
  EXPECT_FALSE(JobStore::Open(path).ok());
  EXPECT_EQ(JobStore::Open("/nonexistent/dir/jobs.db").status().code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace bertshard::jobs
