// File: server/job_recovery.h
// -----------------------------------------------------------------------------
// How a restarted coordinator takes back the jobs its workers still hold (cluster.h says the
// rules as users see them, readoption.h decides one job): what each stored job becomes at start
// (RecoverStoredJobs), what one worker's held shards say (SortHeldShards), and the state of a job
// waiting for its ranks (JobRecovery: which came back, which cannot, until when). The scheduler
// applies what these return: it owns the jobs, the pool and the locks.
//
// Example:
//   ASSIGN_OR_RETURN(auto stored, RecoverStoredJobs(store, model_root, now + grace, record));
//   for (RecoveredJob& j : stored) runtimes[j.job.id()] = MakeRuntime(std::move(j));
//   ...  // a worker registers
//   HeldShards sorted = SortHeldShards(info, request.held(), known, recovering);
//
// Failure model: a stored job that cannot be planned or placed again is FAILED in the store with
// the cause; a store write refused is passed to `record` (said on stderr) and the job is settled as
// far as the store allows (a PLANNED job whose return to PENDING is refused stays PLANNED and is not
// placed). A held shard whose job the store cannot read now is left for the next heartbeat.
//
// Thread safety: functions without state; JobRecovery is guarded by its owner's lock.
#ifndef BERTSHARD_SERVER_JOB_RECOVERY_H_
#define BERTSHARD_SERVER_JOB_RECOVERY_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "bertshard/v1/coordinator.pb.h"
#include "bertshard/v1/job.pb.h"
#include "bertshard/v1/worker.pb.h"
#include "common/checkpoint_dir.h"
#include "common/model_root.h"
#include "jobs/job_store.h"
#include "server/job_assets.h"
#include "server/readoption.h"

namespace bertshard::server {

inline bool TerminalState(v1::JobState s) { return s == v1::FAILED || s == v1::CANCELLED; }

// A READY or LOADING job from the database, waiting for its ranks after a restart.
struct JobRecovery {
  absl::Time deadline;
  bool was_loading = false;
  std::vector<v1::RankAssignment> previous;  // the ranks as stored before the restart
  std::vector<RankReport> reports;           // held shards reported since
  std::set<int> lost;                        // ranks whose previous worker came back without them

  // Job.recovering: until when it waits, and for which of its `world_size` ranks.
  std::string Describe(int world_size) const;
  // DecideReadoption on what came back so far, the grace being over at `now` or not.
  ReadoptionDecision Decide(int world_size, absl::Time now, absl::Duration grace) const;
  // The reports of `worker_id` no longer count (it registers again, and reports again with that).
  void ForgetWorker(const std::string& worker_id);
};

// A request's checkpoint as this coordinator reads it: opened once under `root` (common/
// checkpoint_dir.h), its config.json read through that descriptor and applied to the request, so
// that the planner reads nothing by path.
struct LocalCheckpoint {
  v1::PlanRequest request;  // config and variant filled in from config.json; checkpoint cleared
  std::shared_ptr<const common::CheckpointDir> dir;  // null when the request names no checkpoint
};
// INVALID_ARGUMENT when the checkpoint is outside the root, not a checkpoint directory, or its
// config.json cannot be read or is not valid.
absl::StatusOr<LocalCheckpoint> OpenLocalCheckpoint(const common::ModelRoot& root, const v1::PlanRequest& request);
// OpenLocalCheckpoint's request, for the read-only Plan RPC.
absl::StatusOr<v1::PlanRequest> LocalPlanRequest(const common::ModelRoot& root, const v1::PlanRequest& request);

// What a restarted coordinator makes of one stored job that has not ended.
struct RecoveredJob {
  v1::Job job;  // as stored, after the writes below
  v1::ShardPlan plan;
  std::string backend;  // normalised
  // Why it is PENDING again ("the coordinator restarted before loading", after the recovery it was
  // placed for, "recovering: lost ... (restart K of at most N); ", when it was); empty otherwise.
  std::string pending_note;
  // READY and LOADING jobs: each replica with stored ranks, waiting for them (by replica index;
  // the others are placed again).
  std::map<int32_t, std::unique_ptr<JobRecovery>> recoveries;
  // Its serving assets, read again from its checkpoint under the root (each part's error, should
  // the checkpoint be gone or refused now, is the requests' that need it).
  std::shared_ptr<const JobAssets> assets;
};

// "recovering: lost CAUSE (restart K of at most N)" when the latest placement of `job` (its last
// PENDING entry, with no READY after it) was a recovery from a lost group; empty otherwise.
std::string StoredRecovery(const v1::Job& job);

// The stored jobs that have not ended, in the store's order: PENDING as they are, PLANNED back to
// PENDING (ranks cleared in the same write; a recovering job's reason still says it recovers, see
// StoredRecovery), READY and LOADING recovering until `deadline`, each with its assets
// read (before anything is served: the files are read here, never on a request). Jobs stored without a
// plan are planned again (and the plan stored); jobs that cannot be are FAILED. The store's other
// refusals go to `record(status, what was being done)`. Fails only when the store cannot be listed.
absl::StatusOr<std::vector<RecoveredJob>> RecoverStoredJobs(
    jobs::JobStore& store, const common::ModelRoot& root, absl::Time deadline,
    const std::function<void(const absl::Status&, const std::string&)>& record);

// What the store and the scheduler know of a held shard's job.
enum class HeldJob {
  kUnknown,      // no such job, or it has ended: unload
  kStoreSilent,  // the store did not answer: decide at the next heartbeat
  kKnown,        // a job this coordinator runs
};

// One worker's held shards, sorted. Shards go by their key on the worker: a job's id for its
// first replica, ReplicaKey (replica_keys.h) for the others; "job" below means that key.
struct HeldShards {
  std::vector<std::string> unload;  // jobs the worker must drop
  // The recovering job and rank the (idle) worker reported and is taken back for, if any: added to
  // that job's reports here; the caller assigns the worker.
  std::optional<std::pair<std::string, int32_t>> taken_back;
  // Recovering jobs whose decision may have changed (a report came, or a rank is lost).
  std::set<std::string> decide;
};

// `worker` (its id, address, and the job and rank it serves) reports `held`. `known` says what the
// store knows of a job; `recovering` are the jobs waiting for their ranks, updated here: a report
// from an idle worker joins its job's reports; a rank that this worker's address held before the
// restart and no longer holds is lost; a shard of the job the worker now serves, under another rank
// (placed again after a lost group, reported before its old shard went), is never unloaded.
HeldShards SortHeldShards(const v1::WorkerInfo& worker, const google::protobuf::RepeatedPtrField<v1::HeldShard>& held,
                          const std::function<HeldJob(const std::string& job_id)>& known,
                          const std::map<std::string, JobRecovery*>& recovering);

}  // namespace bertshard::server

#endif  // BERTSHARD_SERVER_JOB_RECOVERY_H_
