#include "jobs/job_store.h"

#include <sqlite3.h>

#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"

namespace bertshard::jobs {
namespace {

// 1: jobs (id, state, created_ms, updated_ms, job). 2: adds jobs.plan, the plan the workers load.
constexpr int kSchemaVersion = 2;

bool Terminal(v1::JobState s) { return s == v1::FAILED || s == v1::CANCELLED; }

// A prepared statement, finalised on scope exit.
class Statement {
 public:
  Statement(sqlite3* db, const char* sql) : db_(db) { rc_ = sqlite3_prepare_v2(db, sql, -1, &stmt_, nullptr); }
  ~Statement() { sqlite3_finalize(stmt_); }
  absl::Status status() const {
    return rc_ == SQLITE_OK ? absl::OkStatus()
                            : absl::InternalError(absl::StrCat("sqlite prepare: ", sqlite3_errmsg(db_)));
  }
  sqlite3_stmt* get() { return stmt_; }

 private:
  sqlite3* db_;
  sqlite3_stmt* stmt_ = nullptr;
  int rc_ = SQLITE_OK;
};

// A failed write as the status a caller can act on. The disk being full is RESOURCE_EXHAUSTED
// (gRPC's own example of it), a read-only database FAILED_PRECONDITION (nothing will change until
// an operator fixes the directory), an I/O error UNAVAILABLE; anything else is a bug: INTERNAL.
absl::Status WriteError(sqlite3* db, int rc, const std::string& what) {
  const std::string detail = absl::StrCat(what, ": ", sqlite3_errmsg(db));
  switch (rc & 0xff) {  // the primary code; extended codes refine it in the high bits
    case SQLITE_FULL:
      return absl::ResourceExhaustedError(absl::StrCat("the job database cannot grow (its disk is full): ", detail));
    case SQLITE_READONLY:
      return absl::FailedPreconditionError(
          absl::StrCat("the job database is read-only (check the data directory): ", detail));
    case SQLITE_IOERR:
    case SQLITE_CANTOPEN:
    case SQLITE_BUSY:
    case SQLITE_LOCKED:
      return absl::UnavailableError(absl::StrCat("the job database cannot be written now: ", detail));
    default:
      return absl::InternalError(absl::StrCat("sqlite ", detail));
  }
}

absl::Status Exec(sqlite3* db, const char* sql) {
  char* error = nullptr;
  const int rc = sqlite3_exec(db, sql, nullptr, nullptr, &error);
  sqlite3_free(error);  // sqlite3_errmsg says the same
  if (rc != SQLITE_OK) return WriteError(db, rc, absl::StrCat("in: ", sql));
  return absl::OkStatus();
}

}  // namespace

bool TransitionAllowed(v1::JobState from, v1::JobState to) {
  if (Terminal(from) || from == to) return false;
  if (to == v1::FAILED || to == v1::CANCELLED) return true;
  // READY from any earlier state: a live update switches the job to its new shape's replicas,
  // which serve, whatever the old shape's had reached (lost, or placed again after a restart).
  if (to == v1::READY && (from == v1::PENDING || from == v1::PLANNED || from == v1::LOADING)) return true;
  switch (from) {
    case v1::PENDING:
      return to == v1::PLANNED;
    case v1::PLANNED:
      return to == v1::LOADING || to == v1::PENDING;
    // A job's state is its most advanced replica's: it falls back when that one loses a worker
    // (to PENDING with one replica; to what the others have reached with several).
    case v1::LOADING:
      return to == v1::PENDING || to == v1::PLANNED;
    case v1::READY:
      return to == v1::PENDING || to == v1::PLANNED || to == v1::LOADING;
    default:
      return false;
  }
}

JobStore::JobStore(sqlite3* db, JobStoreOptions options) : db_(db), options_(std::move(options)) {}

JobStore::~JobStore() {
  absl::MutexLock lock(&mu_);
  sqlite3_close_v2(db_);
}

absl::StatusOr<std::unique_ptr<JobStore>> JobStore::Open(const std::string& path, JobStoreOptions options) {
  if (!options.now_millis) options.now_millis = [] { return absl::ToUnixMillis(absl::Now()); };
  sqlite3* db = nullptr;
  const int rc =
      sqlite3_open_v2(path.c_str(), &db, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_FULLMUTEX, nullptr);
  if (rc != SQLITE_OK) {
    const std::string message = db != nullptr ? sqlite3_errmsg(db) : sqlite3_errstr(rc);
    sqlite3_close_v2(db);
    return absl::UnavailableError(absl::StrCat("cannot open job database ", path, ": ", message));
  }
  auto store = std::unique_ptr<JobStore>(new JobStore(db, std::move(options)));
  // SQLite opens a file it may not write read-only without saying so; the first write would fail
  // much later. Say it now, when the operator starts the coordinator.
  if (path != ":memory:" && sqlite3_db_readonly(db, "main") == 1) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the job database ", path, " is read-only: the coordinator must be able to write it and its directory"));
  }
  absl::MutexLock lock(&store->mu_);
  sqlite3_busy_timeout(db, 5000);
  // WAL: readers never block the writer, and a crash never leaves a half-written job.
  absl::Status s = Exec(db, "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;");
  if (absl::IsResourceExhausted(s) || absl::IsFailedPrecondition(s) || absl::IsUnavailable(s)) {
    return absl::Status(s.code(), absl::StrCat("cannot open job database ", path, ": ", s.message()));
  }
  if (!s.ok()) return absl::InvalidArgumentError(absl::StrCat(path, " is not a usable job database: ", s.message()));
  RETURN_IF_ERROR(Exec(db,
                       "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);"
                       "CREATE TABLE IF NOT EXISTS jobs (id TEXT PRIMARY KEY, state INTEGER NOT NULL,"
                       " created_ms INTEGER NOT NULL, updated_ms INTEGER NOT NULL, job BLOB NOT NULL, plan BLOB);"
                       "CREATE INDEX IF NOT EXISTS jobs_by_created ON jobs (created_ms, id);"
                       // The active jobs (recovery) and the ended ones past retention, without a scan.
                       "CREATE INDEX IF NOT EXISTS jobs_by_state ON jobs (state, updated_ms);"));
  std::string v;
  {
    Statement version(db, "SELECT value FROM meta WHERE key = 'schema_version'");
    RETURN_IF_ERROR(version.status());
    if (sqlite3_step(version.get()) == SQLITE_ROW)
      v = reinterpret_cast<const char*>(sqlite3_column_text(version.get(), 0));
  }
  if (v.empty()) {
    RETURN_IF_ERROR(Exec(db, "INSERT INTO meta (key, value) VALUES ('schema_version', '2')"));
  } else if (v == "1") {
    // Version 1 had no plan column; its jobs keep a NULL plan (GetPlan: none stored).
    RETURN_IF_ERROR(Exec(db,
                         "BEGIN IMMEDIATE; ALTER TABLE jobs ADD COLUMN plan BLOB;"
                         " UPDATE meta SET value = '2' WHERE key = 'schema_version'; COMMIT;"));
  } else if (v != std::to_string(kSchemaVersion)) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, " has job schema version ", v, "; this coordinator reads 1 and ", kSchemaVersion));
  }
  return store;
}

absl::Status JobStore::PutLocked(const v1::Job& job, bool insert, const v1::ShardPlan* plan) {
  Statement stmt(
      db_, insert ? "INSERT INTO jobs (id, state, created_ms, updated_ms, job, plan) VALUES (?1, ?2, ?3, ?4, ?5, ?6)"
           : plan != nullptr
               ? "UPDATE jobs SET state = ?2, created_ms = ?3, updated_ms = ?4, job = ?5, plan = ?6 WHERE id = ?1"
               : "UPDATE jobs SET state = ?2, created_ms = ?3, updated_ms = ?4, job = ?5 WHERE id = ?1");
  RETURN_IF_ERROR(stmt.status());
  const std::string plan_blob = plan != nullptr ? plan->SerializeAsString() : "";
  if (plan != nullptr) {
    sqlite3_bind_blob(stmt.get(), 6, plan_blob.data(), static_cast<int>(plan_blob.size()), SQLITE_TRANSIENT);
  }
  const std::string blob = job.SerializeAsString();
  sqlite3_bind_text(stmt.get(), 1, job.id().c_str(), -1, SQLITE_TRANSIENT);
  sqlite3_bind_int(stmt.get(), 2, job.state());
  sqlite3_bind_int64(stmt.get(), 3, job.created_unix_millis());
  sqlite3_bind_int64(stmt.get(), 4, job.updated_unix_millis());
  sqlite3_bind_blob(stmt.get(), 5, blob.data(), static_cast<int>(blob.size()), SQLITE_TRANSIENT);
  const int rc = sqlite3_step(stmt.get());
  if (rc == SQLITE_CONSTRAINT) return absl::AlreadyExistsError(absl::StrCat("job ", job.id(), " already exists"));
  if (rc != SQLITE_DONE) return WriteError(db_, rc, absl::StrCat("writing job ", job.id()));
  return absl::OkStatus();
}

absl::Status JobStore::Create(v1::Job job, const v1::ShardPlan* plan) {
  if (job.id().empty()) return absl::InvalidArgumentError("a job needs an id");
  const int64_t now = options_.now_millis();
  if (job.state() == v1::JOB_STATE_UNSPECIFIED) job.set_state(v1::PENDING);
  job.set_created_unix_millis(now);
  job.set_updated_unix_millis(now);
  v1::StateChange* first = job.add_history();
  first->set_state(job.state());
  first->set_unix_millis(now);
  absl::MutexLock lock(&mu_);
  return PutLocked(job, /*insert=*/true, plan);
}

absl::StatusOr<v1::Job> JobStore::GetLocked(const std::string& id) {
  Statement stmt(db_, "SELECT job FROM jobs WHERE id = ?1");
  RETURN_IF_ERROR(stmt.status());
  sqlite3_bind_text(stmt.get(), 1, id.c_str(), -1, SQLITE_TRANSIENT);
  if (sqlite3_step(stmt.get()) != SQLITE_ROW) return absl::NotFoundError(absl::StrCat("no job ", id));
  v1::Job job;
  const void* blob = sqlite3_column_blob(stmt.get(), 0);
  if (!job.ParseFromArray(blob, sqlite3_column_bytes(stmt.get(), 0))) {
    return absl::DataLossError(absl::StrCat("job ", id, " is corrupt in the database"));
  }
  return job;
}

absl::StatusOr<v1::Job> JobStore::Get(const std::string& id) {
  absl::MutexLock lock(&mu_);
  return GetLocked(id);
}

void CapHistory(v1::Job* job) {
  const int over = job->history_size() - (kHistoryHead + kHistoryTail);
  if (over <= 0) return;
  job->mutable_history()->DeleteSubrange(kHistoryHead, over);
  job->set_history_dropped(job->history_dropped() + over);
}

absl::StatusOr<v1::Job> JobStore::TransitionLocked(const std::string& id, v1::JobState state, const std::string& reason,
                                                   const std::vector<v1::RankAssignment>* ranks) {
  ASSIGN_OR_RETURN(v1::Job job, GetLocked(id));
  if (!TransitionAllowed(job.state(), state)) {
    return absl::FailedPreconditionError(absl::StrCat("job ", id, " is ", v1::JobState_Name(job.state()),
                                                      " and cannot become ", v1::JobState_Name(state)));
  }
  const int64_t now = options_.now_millis();
  job.set_state(state);
  job.set_updated_unix_millis(now);
  if (state == v1::FAILED) job.set_failure_cause(reason);
  job.set_pending_reason(state == v1::PENDING ? reason : "");
  v1::StateChange* change = job.add_history();
  change->set_state(state);
  change->set_unix_millis(now);
  change->set_reason(reason);
  CapHistory(&job);
  if (ranks != nullptr) {
    job.clear_ranks();
    for (const auto& r : *ranks) *job.add_ranks() = r;
  }
  RETURN_IF_ERROR(PutLocked(job, /*insert=*/false));
  return job;
}

absl::StatusOr<v1::Job> JobStore::Transition(const std::string& id, v1::JobState state, const std::string& reason) {
  absl::MutexLock lock(&mu_);
  return TransitionLocked(id, state, reason);
}

absl::StatusOr<v1::Job> JobStore::TransitionWithRanks(const std::string& id, v1::JobState state,
                                                      const std::string& reason,
                                                      const std::vector<v1::RankAssignment>& ranks) {
  absl::MutexLock lock(&mu_);
  return TransitionLocked(id, state, reason, &ranks);
}

absl::StatusOr<v1::Job> JobStore::SetRanks(const std::string& id, const std::vector<v1::RankAssignment>& ranks) {
  absl::MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(v1::Job job, GetLocked(id));
  job.clear_ranks();
  for (const auto& r : ranks) *job.add_ranks() = r;
  job.set_updated_unix_millis(options_.now_millis());
  RETURN_IF_ERROR(PutLocked(job, /*insert=*/false));
  return job;
}

absl::StatusOr<v1::Job> JobStore::SetReplicas(const std::string& id, int32_t replicas, int32_t min_replicas,
                                              int32_t max_replicas) {
  absl::MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(v1::Job job, GetLocked(id));
  if (Terminal(job.state())) {
    return absl::FailedPreconditionError(absl::StrCat("job ", id, " is ", v1::JobState_Name(job.state())));
  }
  job.set_replicas(replicas);
  job.set_min_replicas(min_replicas);
  job.set_max_replicas(max_replicas);
  job.set_updated_unix_millis(options_.now_millis());
  RETURN_IF_ERROR(PutLocked(job, /*insert=*/false));
  return job;
}

absl::StatusOr<v1::Job> JobStore::SetUpdate(const std::string& id, const v1::JobUpdate* update,
                                            const std::string& note) {
  absl::MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(v1::Job job, GetLocked(id));
  if (Terminal(job.state())) {
    return absl::FailedPreconditionError(absl::StrCat("job ", id, " is ", v1::JobState_Name(job.state())));
  }
  if (update != nullptr) {
    *job.mutable_update() = *update;
    job.mutable_update()->clear_progress();  // said at read time, never stored
  } else {
    job.clear_update();
  }
  if (!note.empty()) job.set_last_update(note);
  job.set_updated_unix_millis(options_.now_millis());
  RETURN_IF_ERROR(PutLocked(job, /*insert=*/false));
  return job;
}

absl::StatusOr<v1::Job> JobStore::SwitchShape(const std::string& id, const v1::PlanRequest& request, int32_t version,
                                              const v1::ShardPlan& plan, const std::vector<v1::RankAssignment>& ranks,
                                              const std::string& note) {
  absl::MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(v1::Job job, GetLocked(id));
  if (Terminal(job.state())) {
    return absl::FailedPreconditionError(absl::StrCat("job ", id, " is ", v1::JobState_Name(job.state())));
  }
  *job.mutable_request() = request;
  job.set_version(version);
  job.clear_ranks();
  for (const v1::RankAssignment& a : ranks) *job.add_ranks() = a;
  job.clear_update();
  job.set_last_update(note);
  job.set_updated_unix_millis(options_.now_millis());
  RETURN_IF_ERROR(PutLocked(job, /*insert=*/false, &plan));
  return job;
}

absl::Status JobStore::SetPendingReason(const std::string& id, const std::string& reason) {
  absl::MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(v1::Job job, GetLocked(id));
  if (job.state() != v1::PENDING) {
    return absl::FailedPreconditionError(
        absl::StrCat("job ", id, " is ", v1::JobState_Name(job.state()), ", not PENDING"));
  }
  job.set_pending_reason(reason);
  job.set_updated_unix_millis(options_.now_millis());
  return PutLocked(job, /*insert=*/false);
}

absl::Status JobStore::SetPlan(const std::string& id, const v1::ShardPlan& plan) {
  absl::MutexLock lock(&mu_);
  Statement stmt(db_, "UPDATE jobs SET plan = ?2 WHERE id = ?1");
  RETURN_IF_ERROR(stmt.status());
  const std::string blob = plan.SerializeAsString();
  sqlite3_bind_text(stmt.get(), 1, id.c_str(), -1, SQLITE_TRANSIENT);
  sqlite3_bind_blob(stmt.get(), 2, blob.data(), static_cast<int>(blob.size()), SQLITE_TRANSIENT);
  if (const int rc = sqlite3_step(stmt.get()); rc != SQLITE_DONE) {
    return WriteError(db_, rc, absl::StrCat("writing the plan of job ", id));
  }
  if (sqlite3_changes(db_) == 0) return absl::NotFoundError(absl::StrCat("no job ", id));
  return absl::OkStatus();
}

absl::StatusOr<std::optional<v1::ShardPlan>> JobStore::GetPlan(const std::string& id) {
  absl::MutexLock lock(&mu_);
  Statement stmt(db_, "SELECT plan FROM jobs WHERE id = ?1");
  RETURN_IF_ERROR(stmt.status());
  sqlite3_bind_text(stmt.get(), 1, id.c_str(), -1, SQLITE_TRANSIENT);
  if (sqlite3_step(stmt.get()) != SQLITE_ROW) return absl::NotFoundError(absl::StrCat("no job ", id));
  if (sqlite3_column_type(stmt.get(), 0) == SQLITE_NULL) return std::optional<v1::ShardPlan>();
  v1::ShardPlan plan;
  if (!plan.ParseFromArray(sqlite3_column_blob(stmt.get(), 0), sqlite3_column_bytes(stmt.get(), 0))) {
    return absl::DataLossError(absl::StrCat("the plan of job ", id, " is corrupt in the database"));
  }
  return std::optional<v1::ShardPlan>(std::move(plan));
}

namespace {

// Every row `stmt` yields, column 0 parsed as a Job.
absl::StatusOr<std::vector<v1::Job>> ReadJobs(sqlite3* db, sqlite3_stmt* stmt) {
  std::vector<v1::Job> jobs;
  int rc;
  while ((rc = sqlite3_step(stmt)) == SQLITE_ROW) {
    v1::Job job;
    if (!job.ParseFromArray(sqlite3_column_blob(stmt, 0), sqlite3_column_bytes(stmt, 0))) {
      return absl::DataLossError("a job is corrupt in the database");
    }
    jobs.push_back(std::move(job));
  }
  if (rc != SQLITE_DONE) return WriteError(db, rc, "reading jobs");
  return jobs;
}

// A page token: the last listed job's position, "<created_ms>/<id>". Opaque to callers.
std::string PageToken(const v1::Job& job) { return absl::StrCat(job.created_unix_millis(), "/", job.id()); }

bool ParsePageToken(const std::string& token, int64_t* created_ms, std::string* id) {
  const size_t slash = token.find('/');
  if (slash == std::string::npos || slash + 1 >= token.size()) return false;
  *id = token.substr(slash + 1);
  return absl::SimpleAtoi(token.substr(0, slash), created_ms);
}

}  // namespace

absl::StatusOr<std::vector<v1::Job>> JobStore::List() {
  absl::MutexLock lock(&mu_);
  Statement stmt(db_, "SELECT job FROM jobs ORDER BY created_ms, id");
  RETURN_IF_ERROR(stmt.status());
  return ReadJobs(db_, stmt.get());
}

absl::StatusOr<JobStore::Page> JobStore::ListPage(int page_size, const std::string& page_token) {
  if (page_size < 1) return absl::InvalidArgumentError(absl::StrCat("page_size must be >= 1, not ", page_size));
  int64_t after_ms = -1;
  std::string after_id;
  if (!page_token.empty() && !ParsePageToken(page_token, &after_ms, &after_id)) {
    return absl::InvalidArgumentError("page_token is not one a ListJobs answer gave");
  }
  absl::MutexLock lock(&mu_);
  // One more than asked for: whether another page follows.
  Statement stmt(db_, "SELECT job FROM jobs WHERE (created_ms, id) > (?1, ?2) ORDER BY created_ms, id LIMIT ?3");
  RETURN_IF_ERROR(stmt.status());
  sqlite3_bind_int64(stmt.get(), 1, after_ms);
  sqlite3_bind_text(stmt.get(), 2, after_id.c_str(), -1, SQLITE_TRANSIENT);
  sqlite3_bind_int64(stmt.get(), 3, static_cast<int64_t>(page_size) + 1);
  Page page;
  ASSIGN_OR_RETURN(page.jobs, ReadJobs(db_, stmt.get()));
  if (page.jobs.size() > static_cast<size_t>(page_size)) {
    page.jobs.resize(static_cast<size_t>(page_size));
    page.next_page_token = PageToken(page.jobs.back());
  }
  return page;
}

absl::StatusOr<std::vector<v1::Job>> JobStore::ListActive() {
  absl::MutexLock lock(&mu_);
  Statement stmt(db_, "SELECT job FROM jobs WHERE state IN (?1, ?2, ?3, ?4) ORDER BY created_ms, id");
  RETURN_IF_ERROR(stmt.status());
  int i = 0;
  for (v1::JobState state : {v1::PENDING, v1::PLANNED, v1::LOADING, v1::READY}) {
    sqlite3_bind_int(stmt.get(), ++i, state);
  }
  return ReadJobs(db_, stmt.get());
}

absl::StatusOr<std::map<v1::JobState, int64_t>> JobStore::CountByState() {
  absl::MutexLock lock(&mu_);
  Statement stmt(db_, "SELECT state, COUNT(*) FROM jobs GROUP BY state");
  RETURN_IF_ERROR(stmt.status());
  std::map<v1::JobState, int64_t> counts;
  int rc;
  while ((rc = sqlite3_step(stmt.get())) == SQLITE_ROW) {
    const int state = sqlite3_column_int(stmt.get(), 0);
    if (v1::JobState_IsValid(state)) counts[static_cast<v1::JobState>(state)] = sqlite3_column_int64(stmt.get(), 1);
  }
  if (rc != SQLITE_DONE) return WriteError(db_, rc, "counting jobs");
  return counts;
}

absl::StatusOr<int> JobStore::DeleteEndedBefore(int64_t before_unix_millis, int limit) {
  absl::MutexLock lock(&mu_);
  Statement stmt(db_,
                 "DELETE FROM jobs WHERE id IN (SELECT id FROM jobs WHERE state IN (?1, ?2) AND updated_ms < ?3"
                 " ORDER BY updated_ms LIMIT ?4)");
  RETURN_IF_ERROR(stmt.status());
  sqlite3_bind_int(stmt.get(), 1, v1::FAILED);
  sqlite3_bind_int(stmt.get(), 2, v1::CANCELLED);
  sqlite3_bind_int64(stmt.get(), 3, before_unix_millis);
  sqlite3_bind_int(stmt.get(), 4, limit);
  if (const int rc = sqlite3_step(stmt.get()); rc != SQLITE_DONE) {
    return WriteError(db_, rc, "deleting ended jobs past retention");
  }
  return sqlite3_changes(db_);
}

}  // namespace bertshard::jobs
