#include "jobs/job_store.h"

#include <sqlite3.h>

#include <cstdlib>
#include <fstream>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
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
    ASSERT_TRUE((*store)
                    ->SetRanks("job-1", {[] {
                                 v1::RankAssignment r;
                                 r.set_rank(0);
                                 r.set_worker_id("w0");
                                 return r;
                               }()})
                    .ok());
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
  EXPECT_EQ((*store)->Transition("j", v1::LOADING, "").status().code(), absl::StatusCode::kFailedPrecondition);
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

// A job that lost a worker is placed and loaded again: READY and LOADING go back to PENDING, with
// the loss as the pending reason and in the history.
TEST(JobStore, ReadyAndLoadingJobsGoBackToPendingWhenAWorkerIsLost) {
  auto store = JobStore::Open(":memory:");
  ASSERT_TRUE(store.ok());
  ASSERT_TRUE((*store)->Create(NewJob("j")).ok());
  for (v1::JobState s : {v1::PLANNED, v1::LOADING, v1::READY}) ASSERT_TRUE((*store)->Transition("j", s, "").ok());
  auto pending = (*store)->Transition("j", v1::PENDING, "recovering: worker w1 (rank 0) stopped heartbeating");
  ASSERT_TRUE(pending.ok()) << pending.status();
  EXPECT_EQ(pending->pending_reason(), "recovering: worker w1 (rank 0) stopped heartbeating");
  EXPECT_EQ(pending->history(pending->history_size() - 1).state(), v1::PENDING);
  for (v1::JobState s : {v1::PLANNED, v1::LOADING}) ASSERT_TRUE((*store)->Transition("j", s, "").ok());
  EXPECT_TRUE((*store)->Transition("j", v1::PENDING, "lost while loading").ok());
  EXPECT_TRUE(TransitionAllowed(v1::READY, v1::PENDING));
  EXPECT_TRUE(TransitionAllowed(v1::LOADING, v1::PENDING));
  EXPECT_FALSE(TransitionAllowed(v1::FAILED, v1::PENDING));
  EXPECT_FALSE(TransitionAllowed(v1::PENDING, v1::LOADING));  // placed first
}

// A live update that switches over makes the job READY (its new shape's replicas serve) whatever
// the old shape had reached: lost (PENDING), or placed again after a coordinator restart (PLANNED).
// Refused, the job stayed stored PLANNED while it served, and a watcher never saw it READY.
TEST(JobStore, ASwitchedUpdateMakesTheJobReadyFromWhereTheOldShapeWas) {
  auto store = JobStore::Open(":memory:");
  ASSERT_TRUE(store.ok());
  ASSERT_TRUE((*store)->Create(NewJob("planned")).ok());
  ASSERT_TRUE((*store)->Transition("planned", v1::PLANNED, "").ok());
  EXPECT_TRUE((*store)->Transition("planned", v1::READY, "version 1: switched over").ok());
  ASSERT_TRUE((*store)->Create(NewJob("pending")).ok());
  EXPECT_TRUE((*store)->Transition("pending", v1::READY, "version 1: switched over").ok());
  EXPECT_FALSE(TransitionAllowed(v1::FAILED, v1::READY));
  EXPECT_FALSE(TransitionAllowed(v1::CANCELLED, v1::READY));
}

// A job's state is its most advanced replica's: when the only serving replica is lost while another
// loads (or is placed), the job falls back to that one's state, not to PENDING.
TEST(JobStore, AJobFallsBackToWhatItsOtherReplicasHaveReached) {
  EXPECT_TRUE(TransitionAllowed(v1::READY, v1::LOADING));
  EXPECT_TRUE(TransitionAllowed(v1::READY, v1::PLANNED));
  EXPECT_TRUE(TransitionAllowed(v1::LOADING, v1::PLANNED));
  auto store = JobStore::Open(":memory:");
  ASSERT_TRUE(store.ok());
  ASSERT_TRUE((*store)->Create(NewJob("j")).ok());
  for (v1::JobState s : {v1::PLANNED, v1::LOADING, v1::READY, v1::LOADING, v1::PLANNED, v1::LOADING, v1::READY}) {
    ASSERT_TRUE((*store)->Transition("j", s, "").ok()) << v1::JobState_Name(s);
  }
}

// Job.replicas is stored (a restart keeps what ScaleJob asked for), never for an ended job.
TEST(JobStore, StoresTheReplicasOfAJobThatHasNotEnded) {
  auto store = JobStore::Open(":memory:");
  ASSERT_TRUE(store.ok());
  ASSERT_TRUE((*store)->Create(NewJob("j")).ok());
  ASSERT_TRUE((*store)->SetReplicas("j", 3).ok());
  EXPECT_EQ((*store)->Get("j")->replicas(), 3);
  ASSERT_TRUE((*store)->SetReplicas("j", 3, 2, 5).ok());
  EXPECT_EQ((*store)->Get("j")->min_replicas(), 2);
  EXPECT_EQ((*store)->Get("j")->max_replicas(), 5);
  ASSERT_TRUE((*store)->SetReplicas("j", 3).ok());  // by hand: not autoscaled after
  EXPECT_EQ((*store)->Get("j")->max_replicas(), 0);
  EXPECT_EQ((*store)->SetReplicas("nope", 2).status().code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE((*store)->Transition("j", v1::CANCELLED, "").ok());
  EXPECT_EQ((*store)->SetReplicas("j", 2).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*store)->Get("j")->replicas(), 3);
}

// A live update is stored while it runs, and switches the job's request, version and plan in one
// write (a restart finds either the old shape with its update, or the new one).
TEST(JobStore, StoresALiveUpdateAndSwitchesTheShapeInOneWrite) {
  const std::string path = DbPath("updates.db");
  v1::ShardPlan old_plan, new_plan;
  old_plan.set_world_size(2);
  new_plan.set_world_size(1);
  {
    auto store = JobStore::Open(path);
    ASSERT_TRUE(store.ok()) << store.status();
    ASSERT_TRUE((*store)->Create(NewJob("j"), &old_plan).ok());
    v1::JobUpdate update;
    *update.mutable_request() = NewJob("j").request();
    update.mutable_request()->mutable_parallel()->set_tp_size(1);
    update.set_version(1);
    update.set_progress("said at read time");
    ASSERT_TRUE((*store)->SetUpdate("j", &update, "").ok());
    const v1::Job running = *(*store)->Get("j");
    ASSERT_TRUE(running.has_update());
    EXPECT_EQ(running.update().version(), 1);
    EXPECT_EQ(running.update().progress(), "");
    EXPECT_EQ(running.request().parallel().tp_size(), 2);
    EXPECT_EQ((*(*store)->GetPlan("j"))->world_size(), 2);
    v1::RankAssignment rank;
    rank.set_worker_id("w-new");
    rank.set_replica(1);
    ASSERT_TRUE((*store)->SetRanks("j", {rank, rank}).ok());  // as if the old shape's
    rank.set_worker_id("w-newer");
    ASSERT_TRUE((*store)->SwitchShape("j", update.request(), 1, new_plan, {rank}, "version 1: switched").ok());
  }
  auto store = JobStore::Open(path);
  ASSERT_TRUE(store.ok()) << store.status();
  const v1::Job switched = *(*store)->Get("j");
  EXPECT_FALSE(switched.has_update());
  EXPECT_EQ(switched.version(), 1);
  EXPECT_EQ(switched.request().parallel().tp_size(), 1);
  EXPECT_EQ(switched.last_update(), "version 1: switched");
  ASSERT_EQ(switched.ranks_size(), 1);
  EXPECT_EQ(switched.ranks(0).worker_id(), "w-newer");
  EXPECT_EQ((*(*store)->GetPlan("j"))->world_size(), 1);
  // Aborted: cleared, with why; an ended job takes neither.
  v1::JobUpdate again;
  again.set_version(2);
  ASSERT_TRUE((*store)->SetUpdate("j", &again, "").ok());
  ASSERT_TRUE((*store)->SetUpdate("j", nullptr, "version 2: aborted").ok());
  EXPECT_FALSE((*store)->Get("j")->has_update());
  EXPECT_EQ((*store)->Get("j")->last_update(), "version 2: aborted");
  ASSERT_TRUE((*store)->Transition("j", v1::CANCELLED, "").ok());
  EXPECT_EQ((*store)->SetUpdate("j", &again, "").status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*store)->SwitchShape("j", again.request(), 2, new_plan, {}, "").status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*store)->SetUpdate("nope", nullptr, "").status().code(), absl::StatusCode::kNotFound);
}

// A lost group's ranks are cleared in the same write that puts the job back to PENDING: both or
// neither, so a job is never stored PENDING with the ranks of the group it lost (nor READY without
// them).
TEST(JobStore, ClearsTheRanksAndGoesBackToPendingInOneWrite) {
  auto store = JobStore::Open(":memory:");
  ASSERT_TRUE(store.ok());
  ASSERT_TRUE((*store)->Create(NewJob("j")).ok());
  v1::RankAssignment rank;
  rank.set_rank(0);
  rank.set_worker_id("w1");
  rank.set_worker_address("127.0.0.1:9");
  ASSERT_TRUE((*store)->SetRanks("j", {rank}).ok());
  for (v1::JobState s : {v1::PLANNED, v1::LOADING, v1::READY}) ASSERT_TRUE((*store)->Transition("j", s, "").ok());
  auto pending = (*store)->TransitionWithRanks("j", v1::PENDING, "recovering: lost w1", {});
  ASSERT_TRUE(pending.ok()) << pending.status();
  EXPECT_EQ(pending->ranks_size(), 0);
  EXPECT_EQ((*store)->Get("j")->ranks_size(), 0);
  EXPECT_EQ((*store)->Get("j")->state(), v1::PENDING);
  // Refused (out of an ended state), it changes neither the state nor the ranks.
  ASSERT_TRUE((*store)->TransitionWithRanks("j", v1::PLANNED, "placed", {rank}).ok());
  ASSERT_TRUE((*store)->Transition("j", v1::CANCELLED, "").ok());
  const absl::StatusOr<v1::Job> refused = (*store)->TransitionWithRanks("j", v1::PENDING, "again", {});
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  const v1::Job kept = *(*store)->Get("j");
  EXPECT_EQ(kept.state(), v1::CANCELLED);
  ASSERT_EQ(kept.ranks_size(), 1);
  EXPECT_EQ(kept.ranks(0).worker_id(), "w1");
}

// A job lost and placed again for months keeps a bounded history: the first 16 transitions and the
// last 48, the ones between counted as dropped.
TEST(JobStore, KeepsTheFirstAndLastTransitionsOfALongHistory) {
  auto store = JobStore::Open(":memory:");
  ASSERT_TRUE(store.ok());
  ASSERT_TRUE((*store)->Create(NewJob("j")).ok());
  int transitions = 1;  // Create's
  for (int loss = 1; loss <= 100; ++loss) {
    for (v1::JobState s : {v1::PLANNED, v1::LOADING, v1::READY}) {
      ASSERT_TRUE((*store)->Transition("j", s, absl::StrCat("placement ", loss)).ok());
    }
    ASSERT_TRUE((*store)->Transition("j", v1::PENDING, absl::StrCat("recovering: lost ", loss)).ok());
    transitions += 4;
  }
  const v1::Job job = *(*store)->Get("j");
  ASSERT_EQ(job.history_size(), kHistoryHead + kHistoryTail);
  EXPECT_EQ(job.history_dropped(), transitions - (kHistoryHead + kHistoryTail));
  EXPECT_EQ(job.history(0).state(), v1::PENDING);  // the submission
  EXPECT_EQ(job.history(1).reason(), "placement 1");
  EXPECT_EQ(job.history(job.history_size() - 1).reason(), "recovering: lost 100");
  EXPECT_EQ(job.history(job.history_size() - 4).reason(), "placement 100");
  EXPECT_EQ(job.pending_reason(), "recovering: lost 100");
}

// The scheduler rewrites why a PENDING job waits as the pool changes; only while it is PENDING.
TEST(JobStore, RewritesThePendingReasonOfPendingJobsOnly) {
  auto store = JobStore::Open(":memory:");
  ASSERT_TRUE(store.ok());
  v1::Job job = NewJob("j");
  job.set_backend("nccl");
  ASSERT_TRUE((*store)->Create(job).ok());
  ASSERT_TRUE((*store)->SetPendingReason("j", "cuda:0 of a is reported by 2 workers").ok());
  EXPECT_EQ((*store)->Get("j")->pending_reason(), "cuda:0 of a is reported by 2 workers");
  EXPECT_EQ((*store)->Get("j")->backend(), "nccl");
  EXPECT_EQ((*store)->SetPendingReason("nope", "x").code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE((*store)->Transition("j", v1::PLANNED, "").ok());
  EXPECT_EQ((*store)->SetPendingReason("j", "x").code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*store)->Get("j")->pending_reason(), "");
}

TEST(JobStore, KeepsPlansApartFromJobs) {
  const std::string path = DbPath("plans.db");
  v1::ShardPlan plan;
  plan.set_world_size(4);
  plan.set_variant(v1::BERT_FOR_MASKED_LM);
  {
    auto store = JobStore::Open(path);
    ASSERT_TRUE(store.ok()) << store.status();
    ASSERT_TRUE((*store)->Create(NewJob("with-plan")).ok());
    ASSERT_TRUE((*store)->Create(NewJob("without-plan")).ok());
    ASSERT_TRUE((*store)->SetPlan("with-plan", plan).ok());
    ASSERT_TRUE((*store)->Transition("with-plan", v1::PLANNED, "").ok());  // updating the job keeps the plan
    EXPECT_EQ((*store)->SetPlan("nope", plan).code(), absl::StatusCode::kNotFound);
  }
  auto store = JobStore::Open(path);
  ASSERT_TRUE(store.ok()) << store.status();
  auto stored = (*store)->GetPlan("with-plan");
  ASSERT_TRUE(stored.ok()) << stored.status();
  ASSERT_TRUE(stored->has_value());
  EXPECT_EQ((*stored)->world_size(), 4);
  EXPECT_EQ((*stored)->variant(), v1::BERT_FOR_MASKED_LM);
  auto none = (*store)->GetPlan("without-plan");
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_FALSE(none->has_value());
  EXPECT_EQ((*store)->GetPlan("nope").status().code(), absl::StatusCode::kNotFound);
}

// A database written by schema version 1 (the table as it was then) opens, keeps its jobs, and
// takes plans from then on.
TEST(JobStore, MigratesVersionOneDatabases) {
  const std::string path = DbPath("version1.db");
  {
    sqlite3* db = nullptr;
    ASSERT_EQ(sqlite3_open(path.c_str(), &db), SQLITE_OK);
    v1::Job job = NewJob("old-job");
    job.set_state(v1::READY);
    const std::string blob = job.SerializeAsString();
    const std::string sql =
        "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);"
        "CREATE TABLE jobs (id TEXT PRIMARY KEY, state INTEGER NOT NULL, created_ms INTEGER NOT NULL,"
        " updated_ms INTEGER NOT NULL, job BLOB NOT NULL);"
        "INSERT INTO meta VALUES ('schema_version', '1');";
    ASSERT_EQ(sqlite3_exec(db, sql.c_str(), nullptr, nullptr, nullptr), SQLITE_OK) << sqlite3_errmsg(db);
    sqlite3_stmt* insert = nullptr;
    ASSERT_EQ(sqlite3_prepare_v2(db, "INSERT INTO jobs VALUES ('old-job', 4, 1, 1, ?1)", -1, &insert, nullptr),
              SQLITE_OK);
    sqlite3_bind_blob(insert, 1, blob.data(), static_cast<int>(blob.size()), SQLITE_TRANSIENT);
    ASSERT_EQ(sqlite3_step(insert), SQLITE_DONE);
    sqlite3_finalize(insert);
    sqlite3_close(db);
  }
  auto store = JobStore::Open(path);
  ASSERT_TRUE(store.ok()) << store.status();
  auto job = (*store)->Get("old-job");
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->state(), v1::READY);
  auto plan = (*store)->GetPlan("old-job");
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_FALSE(plan->has_value());
  v1::ShardPlan p;
  p.set_world_size(2);
  ASSERT_TRUE((*store)->SetPlan("old-job", p).ok());
  EXPECT_EQ((*(*store)->GetPlan("old-job"))->world_size(), 2);
  store->reset();
  auto reopened = JobStore::Open(path);  // now version 2: no second migration
  ASSERT_TRUE(reopened.ok()) << reopened.status();
  EXPECT_EQ((*(*reopened)->GetPlan("old-job"))->world_size(), 2);
}

TEST(JobStore, RefusesNewerSchemaVersions) {
  const std::string path = DbPath("version9.db");
  {
    auto store = JobStore::Open(path);
    ASSERT_TRUE(store.ok());
  }
  sqlite3* db = nullptr;
  ASSERT_EQ(sqlite3_open(path.c_str(), &db), SQLITE_OK);
  ASSERT_EQ(sqlite3_exec(db, "UPDATE meta SET value = '9' WHERE key = 'schema_version'", nullptr, nullptr, nullptr),
            SQLITE_OK);
  sqlite3_close(db);
  auto store = JobStore::Open(path);
  EXPECT_EQ(store.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(store.status().message().find("version 9"), std::string::npos) << store.status();
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

// ListJobs pages through the table in creation order; tokens survive inserts and deletes.
TEST(JobStore, PagesInCreationOrder) {
  int64_t now = 1000;
  auto store = JobStore::Open(":memory:", FixedClock(&now));
  ASSERT_TRUE(store.ok());
  for (int i = 0; i < 7; ++i) ASSERT_TRUE((*store)->Create(NewJob("job-" + std::to_string(i))).ok());
  std::vector<std::string> seen;
  std::string token;
  int pages = 0;
  do {
    auto page = (*store)->ListPage(3, token);
    ASSERT_TRUE(page.ok()) << page.status();
    EXPECT_LE(page->jobs.size(), 3u);
    for (const v1::Job& job : page->jobs) seen.push_back(job.id());
    token = page->next_page_token;
    if (++pages == 1) {
      ASSERT_TRUE((*store)->Create(NewJob("job-7")).ok());  // added mid-listing: seen at the end
    }
  } while (!token.empty() && pages < 10);
  EXPECT_EQ(pages, 3);
  ASSERT_EQ(seen.size(), 8u);
  for (int i = 0; i < 8; ++i) EXPECT_EQ(seen[i], "job-" + std::to_string(i));
  auto exact = (*store)->ListPage(8, "");
  ASSERT_TRUE(exact.ok());
  EXPECT_EQ(exact->jobs.size(), 8u);
  EXPECT_EQ(exact->next_page_token, "");
  EXPECT_EQ((*store)->ListPage(0, "").status().code(), absl::StatusCode::kInvalidArgument);
  for (const char* bad : {"x", "12", "/job-1", "abc/job-1", "12/"}) {
    EXPECT_EQ((*store)->ListPage(3, bad).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

// Recovery reads the active jobs only; metrics count by state; ended jobs past retention go.
TEST(JobStore, ActiveJobsCountsAndRetention) {
  int64_t now = 1000;
  auto store = JobStore::Open(":memory:", FixedClock(&now));
  ASSERT_TRUE(store.ok());
  for (const char* id : {"pending", "ready", "failed", "cancelled", "late-cancelled"}) {
    ASSERT_TRUE((*store)->Create(NewJob(id)).ok());
  }
  v1::ShardPlan plan;
  ASSERT_TRUE((*store)->SetPlan("failed", plan).ok());
  for (v1::JobState s : {v1::PLANNED, v1::LOADING, v1::READY}) ASSERT_TRUE((*store)->Transition("ready", s, "").ok());
  ASSERT_TRUE((*store)->Transition("failed", v1::FAILED, "boom").ok());
  ASSERT_TRUE((*store)->Transition("cancelled", v1::CANCELLED, "").ok());
  const int64_t cutoff = now;
  now += 1000;
  ASSERT_TRUE((*store)->Transition("late-cancelled", v1::CANCELLED, "").ok());

  auto active = (*store)->ListActive();
  ASSERT_TRUE(active.ok());
  ASSERT_EQ(active->size(), 2u);
  EXPECT_EQ((*active)[0].id(), "pending");
  EXPECT_EQ((*active)[1].id(), "ready");
  auto counts = (*store)->CountByState();
  ASSERT_TRUE(counts.ok());
  EXPECT_EQ(*counts,
            (std::map<v1::JobState, int64_t>{{v1::PENDING, 1}, {v1::READY, 1}, {v1::FAILED, 1}, {v1::CANCELLED, 2}}));

  auto deleted = (*store)->DeleteEndedBefore(cutoff, 1);  // one at a time, oldest first
  ASSERT_TRUE(deleted.ok());
  EXPECT_EQ(*deleted, 1);
  EXPECT_EQ((*store)->Get("failed").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ((*store)->GetPlan("failed").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(*(*store)->DeleteEndedBefore(cutoff, 100), 1);  // "cancelled"
  EXPECT_EQ(*(*store)->DeleteEndedBefore(cutoff, 100), 0);  // "late-cancelled" is newer; active ones stay
  EXPECT_TRUE((*store)->Get("late-cancelled").ok());
  EXPECT_EQ((*store)->List()->size(), 3u);
}

// The queries a server runs per submit, scrape or restart use the indexes, not a table scan.
TEST(JobStore, ServerQueriesUseIndexes) {
  const std::string path = DbPath("plans.db");
  { ASSERT_TRUE(JobStore::Open(path).ok()); }
  sqlite3* db = nullptr;
  ASSERT_EQ(sqlite3_open(path.c_str(), &db), SQLITE_OK);
  const auto plan = [db](const std::string& sql) {
    std::string out;
    sqlite3_stmt* stmt = nullptr;
    EXPECT_EQ(sqlite3_prepare_v2(db, ("EXPLAIN QUERY PLAN " + sql).c_str(), -1, &stmt, nullptr), SQLITE_OK) << sql;
    while (sqlite3_step(stmt) == SQLITE_ROW)
      out += std::string(reinterpret_cast<const char*>(sqlite3_column_text(stmt, 3))) + ";";
    sqlite3_finalize(stmt);
    return out;
  };
  for (const char* sql : {"SELECT job FROM jobs WHERE state IN (1, 2, 3, 4) ORDER BY created_ms, id",
                          "SELECT id FROM jobs WHERE state IN (5, 6) AND updated_ms < 10 ORDER BY updated_ms LIMIT 5",
                          "SELECT job FROM jobs WHERE (created_ms, id) > (1, 'a') ORDER BY created_ms, id LIMIT 3"}) {
    const std::string explained = plan(sql);
    // SEARCH: a range of an index; SCAN would read every row.
    EXPECT_TRUE(explained.find("SEARCH") != std::string::npos && explained.find("INDEX") != std::string::npos)
        << sql << ": " << explained;
  }
  sqlite3_close(db);
}

TEST(JobStore, RefusesFilesThatAreNotJobDatabases) {
  const std::string path = DbPath("not_a_db");
  std::ofstream(path) << "this is not sqlite, just text that is long enough to look like a header....";
  EXPECT_FALSE(JobStore::Open(path).ok());
  EXPECT_EQ(JobStore::Open("/nonexistent/dir/jobs.db").status().code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace bertshard::jobs
