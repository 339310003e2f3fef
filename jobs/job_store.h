// File: jobs/job_store.h
// -----------------------------------------------------------------------------
// The coordinator's durable job table: an embedded SQLite database in WAL mode holding every
// bertshard.v1.Job (request, state, state history with timestamps, failure cause, rank
// assignments) and the plan its workers load, so a restarted coordinator still knows every job
// and can take back the ones its workers still hold. State changes follow the job life cycle and
// are atomic; terminal states (FAILED, CANCELLED) are final.
//
// Schema versions: 1 (jobs only) is migrated in place to 2 (adds the plan column) on open; its
// jobs read back with no stored plan. A newer version is refused. Indexes (by creation, by state
// and last change) are made on open when missing.
//
//   PENDING -> PLANNED -> LOADING -> READY        any non-terminal -> FAILED | CANCELLED
//   PLANNED -> PENDING (workers lost before loading)
//   LOADING, READY -> PENDING (a worker lost: the job is placed and loaded again)
//   READY -> PLANNED | LOADING, LOADING -> PLANNED (its serving replica lost, the job is what its
//     others have reached)
//   PENDING, PLANNED -> READY (a live update switched over to new replicas that serve)
//
// Example:
//   ASSIGN_OR_RETURN(auto store, JobStore::Open("/var/lib/bertshard/jobs.db"));
//   RETURN_IF_ERROR(store->Create(job));                       // state PENDING
//   ASSIGN_OR_RETURN(v1::Job j, store->Transition(id, v1::PLANNED, "4 workers assigned"));
//
// Thread safety: thread-safe (one connection, serialised by a mutex).
#ifndef BERTSHARD_JOBS_JOB_STORE_H_
#define BERTSHARD_JOBS_JOB_STORE_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "bertshard/v1/job.pb.h"
#include "bertshard/v1/plan.pb.h"

struct sqlite3;

namespace bertshard::jobs {

struct JobStoreOptions {
  // Clock for timestamps (unix milliseconds); tests pin it.
  std::function<int64_t()> now_millis;
};

class JobStore {
 public:
  // Opens or creates the database at `path` (":memory:" for a private one). INVALID_ARGUMENT if
  // the file is not a bertshard job database; FAILED_PRECONDITION if an existing database can
  // only be read (a read-only file, or one in a read-only directory); UNAVAILABLE if it cannot be
  // opened or created (a missing database in a read-only directory is this).
  static absl::StatusOr<std::unique_ptr<JobStore>> Open(const std::string& path, JobStoreOptions options = {});
  ~JobStore();
  JobStore(const JobStore&) = delete;
  JobStore& operator=(const JobStore&) = delete;

  // Stores a new job, and `plan` with it when given (one write: never a job without its plan);
  // its state becomes PENDING when unset, with a first history entry. ALREADY_EXISTS for a
  // duplicate id, INVALID_ARGUMENT for an empty id.
  //
  // Every write (here and below) fails as RESOURCE_EXHAUSTED when the database's disk is full,
  // FAILED_PRECONDITION when it has become read-only, UNAVAILABLE on an I/O error; what was
  // written before stays readable.
  absl::Status Create(v1::Job job, const v1::ShardPlan* plan = nullptr);

  // Moves job `id` to `state`, recording `reason` (the failure cause for FAILED, the pending
  // reason for PENDING). NOT_FOUND for an unknown id; FAILED_PRECONDITION for a transition the
  // life cycle does not allow (e.g. out of a terminal state). Returns the updated job.
  absl::StatusOr<v1::Job> Transition(const std::string& id, v1::JobState state, const std::string& reason);

  // Transition and the rank assignments replaced by `ranks`, in one write: both happen or neither
  // (a job put back to PENDING never keeps the ranks of the group it lost). Errors as Transition.
  absl::StatusOr<v1::Job> TransitionWithRanks(const std::string& id, v1::JobState state, const std::string& reason,
                                              const std::vector<v1::RankAssignment>& ranks);

  // Replaces the rank assignments of job `id`. NOT_FOUND for an unknown id.
  absl::StatusOr<v1::Job> SetRanks(const std::string& id, const std::vector<v1::RankAssignment>& ranks);

  // Records how many replicas job `id` runs (Job.replicas; ScaleJob) and its autoscaling bounds
  // (Job.min_replicas, Job.max_replicas; 0: none). NOT_FOUND for an unknown id,
  // FAILED_PRECONDITION for a job that has ended.
  absl::StatusOr<v1::Job> SetReplicas(const std::string& id, int32_t replicas, int32_t min_replicas = 0,
                                      int32_t max_replicas = 0);

  // A live update of job `id` starts (`update` stored as Job.update, its progress not) or ends
  // without switching over (null: cleared); a non-empty `note` becomes Job.last_update. NOT_FOUND
  // for an unknown id, FAILED_PRECONDITION for a job that has ended.
  absl::StatusOr<v1::Job> SetUpdate(const std::string& id, const v1::JobUpdate* update, const std::string& note);
  // A live update of job `id` switches over: its request, version, plan and ranks become the new
  // shape's and Job.update is cleared, `note` becoming Job.last_update, all in one write (a restart
  // finds the old shape with its ranks and update, or the new one with its ranks: never a plan with
  // another shape's workers). Errors as SetUpdate's.
  absl::StatusOr<v1::Job> SwitchShape(const std::string& id, const v1::PlanRequest& request, int32_t version,
                                      const v1::ShardPlan& plan, const std::vector<v1::RankAssignment>& ranks,
                                      const std::string& note);

  // Rewrites why PENDING job `id` waits (the pool changed under it). FAILED_PRECONDITION for a
  // job in another state, NOT_FOUND for an unknown id.
  absl::Status SetPendingReason(const std::string& id, const std::string& reason);

  absl::StatusOr<v1::Job> Get(const std::string& id);
  // Every job, oldest first. Reads the whole table: for tests and tools, not for a server's paths
  // (ListPage, ListActive, CountByState are bounded or indexed).
  absl::StatusOr<std::vector<v1::Job>> List();

  // One page of the jobs, oldest first: at most `page_size` (>= 1) jobs after the one
  // `page_token` names ("" for the first page). `next_page_token` is "" on the last page. A
  // token stays valid while jobs are added or deleted (it names a position, not a row).
  // INVALID_ARGUMENT for a token this store did not make, or page_size < 1.
  struct Page {
    std::vector<v1::Job> jobs;
    std::string next_page_token;
  };
  absl::StatusOr<Page> ListPage(int page_size, const std::string& page_token);
  // The jobs that have not ended (PENDING, PLANNED, LOADING, READY), oldest first; read through
  // the index on state, so ended jobs cost nothing here.
  absl::StatusOr<std::vector<v1::Job>> ListActive();
  // How many jobs are in each state (states with none are absent); one indexed count query.
  absl::StatusOr<std::map<v1::JobState, int64_t>> CountByState();
  // Deletes up to `limit` ended jobs (FAILED, CANCELLED) last changed before `before_unix_millis`,
  // oldest first, with their plans; returns how many went. Job history is kept this long
  // (--job_retention), not for good.
  absl::StatusOr<int> DeleteEndedBefore(int64_t before_unix_millis, int limit);

  // Stores the plan job `id`'s workers load (kept apart from the Job: plans of big models are a
  // few MiB, and clients list jobs often). NOT_FOUND for an unknown id.
  absl::Status SetPlan(const std::string& id, const v1::ShardPlan& plan);
  // The plan stored with SetPlan; nullopt when none was (jobs from schema version 1). NOT_FOUND
  // for an unknown id, DATA_LOSS for an unreadable plan.
  absl::StatusOr<std::optional<v1::ShardPlan>> GetPlan(const std::string& id);

 private:
  JobStore(sqlite3* db, JobStoreOptions options);
  absl::StatusOr<v1::Job> GetLocked(const std::string& id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status PutLocked(const v1::Job& job, bool insert, const v1::ShardPlan* plan = nullptr)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // `ranks`: replaces the rank assignments in the same write; nullptr: kept.
  absl::StatusOr<v1::Job> TransitionLocked(const std::string& id, v1::JobState state, const std::string& reason,
                                           const std::vector<v1::RankAssignment>* ranks = nullptr)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  absl::Mutex mu_;
  sqlite3* const db_ ABSL_GUARDED_BY(mu_);
  const JobStoreOptions options_;
};

// A job's stored history is bounded: its first kHistoryHead transitions (submission, first
// placement and load) and its last kHistoryTail (the latest losses and recoveries); the ones between
// are dropped as new ones come, and counted in Job.history_dropped. Every read (GetJob, ListJobs,
// WatchJob) carries at most this much.
inline constexpr int kHistoryHead = 16;
inline constexpr int kHistoryTail = 48;
// Drops what is over the bound from the middle of `job`'s history, counting it.
void CapHistory(v1::Job* job);

// Whether the life cycle allows `from` -> `to`.
bool TransitionAllowed(v1::JobState from, v1::JobState to);

}  // namespace bertshard::jobs

#endif  // BERTSHARD_JOBS_JOB_STORE_H_
