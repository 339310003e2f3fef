// File: server/scheduler.h
// -----------------------------------------------------------------------------
// The coordinator's jobs: admission (SubmitJob), placement of their ranks on idle workers
// (placement.h), loading with progress (shard_loading.h), losing a job's group and placing it
// again (group_restarts.h), failing and cancelling them, re-adoption after a restart
// (job_recovery.h, readoption.h), and what a worker's arrival, departure or silence means for its
// job (that last part, with re-adoption and losing a group, in scheduler_workers.cc). Jobs persist
// in a JobStore; the workers are a WorkerPool's.
// Cluster (cluster.h) is the front that the gRPC layer talks to; the rules users see are there.
//
// Example:
//   WorkerPool pool(options, incarnation);
//   ASSIGN_OR_RETURN(auto scheduler, Scheduler::Create(options, std::move(store), &pool));
//   ASSIGN_OR_RETURN(v1::Job job, scheduler->SubmitJob(request, "host:10.0.0.1"));
//   scheduler->RegisterWorker(worker);  // placed and loading once enough workers are idle
//   ASSIGN_OR_RETURN(ForwardTarget next, scheduler->NextForward(job.id(), deadline));  // its ranks
//
// Failure model: as cluster.h says. A write the job store refuses is said on stderr (once per
// distinct failure); a job the store cannot follow into LOADING, READY or back to PENDING (a lost
// group) fails; a placement the
// store refuses is retried by the monitor every quarter heartbeat interval.
//
// Thread safety: thread-safe. One lock (mu_) guards the jobs' runtimes, the index of PENDING jobs
// and the scheduler's flags; it is taken before the pool's (never the other way round) and never
// held during a gRPC call or while the whole job table is read (scheduling reads the PENDING index,
// ListJobs reads its page of the store before taking it; only Create reads the active jobs, and the
// taken-back jobs' checkpoint assets, under it, before anything is served). Under it the store is read
// and written one job at a time. Each job load and each batch queue destroyed off the lock runs on a
// thread of a ThreadGroup that is joined as the threads end, as is each Unload call to a lost
// group's survivor (it takes the lock when it returns, to let the worker be placed again).
#ifndef BERTSHARD_SERVER_SCHEDULER_H_
#define BERTSHARD_SERVER_SCHEDULER_H_

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "bertshard/v1/coordinator.pb.h"
#include "bertshard/v1/worker.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "jobs/job_store.h"
#include "server/batch_queue.h"
#include "server/cluster_options.h"
#include "server/group_restarts.h"
#include "server/job_recovery.h"
#include "server/job_serving.h"
#include "server/recovery_metrics.h"
#include "server/thread_group.h"
#include "server/worker_pool.h"

namespace bertshard::server {

// One TP x PP group of workers serving a job: its placement, load and forwards. A job has one
// today; replicas will make it several, each with its own GroupRuntime inside the JobRuntime.
// Fields are guarded by the Scheduler's lock.
struct GroupRuntime {
  explicit GroupRuntime(const RestartPolicy& policy) : restarts(policy) {}
  std::vector<std::string> rank_workers;
  std::vector<v1::RankProgress> progress;
  std::vector<std::shared_ptr<grpc::ClientContext>> load_contexts;
  // The next forward's number. Advanced only by the batch queue's thread (one forward at a time, so
  // every rank sees one order), set by recovery before the job serves again, and 0 on every new
  // placement (a fresh load numbers from 0).
  int64_t next_sequence = 0;
  // Loaded and answering (READY, not recovering after a restart): what the stored job says, kept
  // here so that serving a request needs no database read.
  bool serving = false;
  // Ends the forward in flight when the group is lost elsewhere (LoseGroupLocked) or the job fails,
  // instead of letting it wait for the surviving ranks' collective timeout. A new one for each
  // placement: the old one stays aborted.
  std::shared_ptr<ForwardAbort> forward_abort = std::make_shared<ForwardAbort>();
  // Which placement this is: advanced when the group is placed and when it is lost, so that a load
  // or a forward's failure from an earlier placement finds it changed and does nothing.
  int64_t generation = 0;
  // Losses in a row, backoff and the --max_restarts limit (group_restarts.h).
  GroupRestarts restarts;
};

// One job as this coordinator runs it, from its submission (or its recovery at start) until it
// ends: then it is erased (a load in flight keeps its pointer until it sees `ended`), so memory
// follows the live jobs, not the history. Fields are guarded by the Scheduler's lock.
struct JobRuntime {
  explicit JobRuntime(const RestartPolicy& policy) : group(policy) {}
  v1::ShardPlan plan;
  std::string checkpoint;
  // Read at submit (or when taken back after a restart) through the checkpoint's descriptors, off
  // the lock; what the job serves with, whatever becomes of the files' names later.
  std::shared_ptr<const JobAssets> assets;
  std::string backend = "gloo";  // "gloo" (CPU workers) or "nccl" (one rank per GPU)
  std::string submitted_by;      // counted against ClusterOptions::max_jobs_per_client until ended
  std::string name;              // SubmitJobRequest.name (job_names.h), unique among the live jobs; may be empty
  // FAILED or CANCELLED here (FailJobLocked), whether or not the store took the write: no load
  // starts or finishes for it after.
  bool ended = false;
  // Said before what a PENDING job waits for in its pending reason (why it is PENDING again).
  std::string pending_note;
  std::unique_ptr<JobRecovery> recovery;  // set while recovering after a restart
  GroupRuntime group;
  // The job's request path (assets, batch queue, decoding); made on the first Infer/Embed call
  // (while its group serves or is being placed again), closed (and released off the lock) when the
  // job ends.
  std::shared_ptr<JobServing> job_serving;
};

// The jobs' JobServings reach their ranks through it (ForwardTargets, job_serving.h).
class Scheduler final : public ForwardTargets {
 public:
  // Takes back the stored jobs (job_recovery.h) and starts the monitor (liveness, recovery
  // deadlines, placements to retry). `pool` must outlive the scheduler.
  static absl::StatusOr<std::unique_ptr<Scheduler>> Create(const ClusterOptions& options,
                                                           std::unique_ptr<jobs::JobStore> store, WorkerPool* pool);
  ~Scheduler() override;  // Stop()
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  // Shutdown: cancels the loads, closes every batch queue (waiting requests fail), then joins the
  // monitor and every background thread, and only then releases the queues. No batch queue is made
  // and no job is placed after. Idempotent.
  void Stop() ABSL_LOCKS_EXCLUDED(mu_);
  // From now on no worker is declared dead and no job is placed. Idempotent.
  void Drain() ABSL_LOCKS_EXCLUDED(mu_);

  // A worker arrives (or comes again); see cluster.h. The response lists the held jobs to unload.
  v1::RegisterWorkerResponse RegisterWorker(const v1::RegisterWorkerRequest& request) ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<v1::HeartbeatResponse> Heartbeat(const v1::HeartbeatRequest& request) ABSL_LOCKS_EXCLUDED(mu_);

  absl::StatusOr<v1::Job> SubmitJob(const v1::SubmitJobRequest& request, const std::string& client)
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<v1::Job> GetJob(const std::string& id) ABSL_LOCKS_EXCLUDED(mu_);
  // One page of the jobs, oldest first (jobs::JobStore::ListPage), recovering filled in.
  absl::StatusOr<jobs::JobStore::Page> ListJobs(int page_size, const std::string& page_token) ABSL_LOCKS_EXCLUDED(mu_);
  // Jobs by state, counted by the store (metrics).
  absl::StatusOr<std::map<v1::JobState, int64_t>> CountJobsByState() ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<v1::Job> CancelJob(const std::string& id) ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status WatchJob(const std::string& id, absl::Time deadline,
                        const std::function<bool(const v1::JobEvent&)>& emit, const std::function<bool()>& cancelled)
      ABSL_LOCKS_EXCLUDED(mu_);

  // For serving. The ranks, sequence number and abort of the next forward of job `job_id`, waiting
  // until `wait_until` while its group is being placed again (then UNAVAILABLE, saying why);
  // FAILED_PRECONDITION when it no longer serves, UNAVAILABLE once stopping.
  absl::StatusOr<ForwardTarget> NextForward(const std::string& job_id, absl::Time wait_until) override
      ABSL_LOCKS_EXCLUDED(mu_);
  // A forward failed on placement `generation` of the job's group: LoseGroupLocked.
  void LoseGroup(const std::string& job_id, int64_t generation, const std::string& cause,
                 const std::string& unreachable_worker) override ABSL_LOCKS_EXCLUDED(mu_);
  // Calls `use` under the lock with the runtime of `job_id` when it serves or its group is being
  // placed again (requests then wait for it), else with null and the stored job (recovering filled
  // in) to say why not; returns what `use` returns. UNAVAILABLE, without calling it, once stopping
  // (no batch queue may be made then).
  absl::Status WithServingRuntime(const std::string& job_id,
                                  const std::function<absl::Status(const std::shared_ptr<JobRuntime>& serving,
                                                                   const absl::StatusOr<v1::Job>& job)>& use)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Each job's restarts in a row and whether it is degraded (as Job.restarts and Job.degraded say),
  // and the groups lost since start: the recovery metrics (recovery_metrics.h).
  RecoveryMetrics Recovery() ABSL_LOCKS_EXCLUDED(mu_);
  // Calls `visit` under the lock for every job with a runtime here (the jobs that have not ended).
  void ForEachRuntime(const std::function<void(const std::string& job_id, JobRuntime& runtime)>& visit)
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct PendingJob {
    std::string job_id;
    std::string reason;  // its pending_reason as stored
  };
  struct Load;  // one job's load in progress, passed along LoadJob's steps

  Scheduler(const ClusterOptions& options, std::unique_ptr<jobs::JobStore> store, WorkerPool* pool);

  // Builds the runtimes of the stored jobs (RecoverStoredJobs). Called once, before any worker
  // registers.
  absl::Status RecoverJobsLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A PENDING job stored while it recovered from a lost group (its reason says so) recovers again
  // here: Job.degraded and its requests' waiting hold across a coordinator restart. Returns the
  // failure cause when --max_restarts allows no restart (0): the caller ends the job.
  std::optional<std::string> ResumeRecoveryLocked(const std::string& stored_reason, JobRuntime& runtime)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // What the entry a worker replaced (it registers again from its address) means for its job: a
  // recovering job forgets its reports; a job it still holds unbroken is kept (returned: job and
  // rank, for the new entry); any other loses its group.
  std::optional<std::pair<std::string, int32_t>> SettleReplacedLocked(const v1::WorkerInfo& old,
                                                                      const v1::RegisterWorkerRequest& request)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The kept rank moves to the new entry `worker` (in the runtime and the store).
  void MoveRankLocked(const std::string& job_id, int32_t rank, v1::WorkerInfo* worker)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Takes in what a worker holds (SortHeldShards): reports for recovering jobs, the rest to unload.
  void TakeHeldShardsLocked(const v1::WorkerInfo& worker, const google::protobuf::RepeatedPtrField<v1::HeldShard>& held,
                            google::protobuf::RepeatedPtrField<std::string>* unload) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Applies the readoption decision to a recovering job: adopt, fail, or keep waiting.
  void DecideRecoveryLocked(const std::string& job_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The stored job with `recovering`, `degraded` and `restarts` filled in from `runtime` (may be null).
  void FillRuntimeFieldsLocked(v1::Job& job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The stored job with `recovering`, `degraded` and `restarts` filled in.
  absl::StatusOr<v1::Job> GetJobLocked(const std::string& id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  v1::JobEvent EventLocked(const v1::Job& job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Places the PENDING jobs that fit the idle workers (in submission order, but for those in a
  // restart's backoff) and starts their loads; records why the others wait.
  void ScheduleLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Assigns the placed workers and records the job PLANNED; false (nothing changed) when the store
  // refuses.
  bool PlanJobLocked(const std::string& job_id, JobRuntime& runtime, const std::vector<IdleWorker>& workers)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // LoadJob's steps: check the job may still load and record it LOADING; reserve the rendezvous
  // port; register the ranks' load contexts; load every rank; record it READY.
  void LoadJob(const std::string& job_id, int64_t generation) ABSL_LOCKS_EXCLUDED(mu_);
  std::optional<Load> BeginLoad(const std::string& job_id, int64_t generation) ABSL_LOCKS_EXCLUDED(mu_);
  std::vector<std::shared_ptr<grpc::ClientContext>> LoadContexts(const Load& load) ABSL_LOCKS_EXCLUDED(mu_);
  bool LoadShards(const Load& load, int32_t port, const std::string& secret,
                  const std::vector<std::shared_ptr<grpc::ClientContext>>& contexts) ABSL_LOCKS_EXCLUDED(mu_);
  void FinishLoad(const Load& load, bool all_loaded) ABSL_LOCKS_EXCLUDED(mu_);

  // Ends the job (FAILED or CANCELLED) here and in the store: its loads and forward are cut off, its
  // batch queue closed, its workers freed (the healthy ones told to unload), and the pool scheduled.
  void FailJobLocked(const std::string& job_id, const std::string& cause, v1::JobState state = v1::FAILED)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The job's group lost a worker (`cause` names it and says how): instead of ending the job, the
  // group is cut off (loads cancelled, forward aborted), its survivors unload (kept out of placement
  // until they have: WorkerPool::SetUnloading), and the job goes back to PENDING saying why, to be
  // placed again on idle workers after the restart's backoff (group_restarts.h). Past --max_restarts
  // the job FAILS naming every loss. `generation` must be the group's current placement (else this
  // is a late report of a loss already handled: nothing happens); `unreachable_worker` (may be "")
  // is out of placement until it heartbeats again.
  void LoseGroupLocked(const std::string& job_id, int64_t generation, const std::string& cause,
                       const std::string& unreachable_worker = "") ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // LoseGroupLocked for the job `worker` served, if any: "worker ID (rank R) at ADDR `why`".
  void LoseWorkersGroupLocked(const v1::WorkerInfo& worker, const std::string& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A worker told to unload (`unload`, from its registration or heartbeat answer) shards of jobs that
  // run here is kept out of placement until it reports none (WorkerPool::SetUnloading).
  void MarkUnloadingLocked(const std::string& worker_id, const google::protobuf::RepeatedPtrField<std::string>& unload)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Closes the job's JobServing (waiting requests fail with `why`) and returns it, to be released
  // off the lock: its destructor waits for the running batch, which may be the caller.
  std::shared_ptr<JobServing> CloseServingLocked(JobRuntime& runtime, const std::string& why)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A write the job database refused (full, read-only, I/O): said on stderr, once per distinct one.
  void StoreErrorLocked(const std::string& what, const absl::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // StoreErrorLocked when `status` is not OK: for writes whose refusal changes nothing else here.
  void RecordLocked(const absl::Status& status, const std::string& what) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void MonitorLoop() ABSL_LOCKS_EXCLUDED(mu_);
  // Deletes ended jobs older than options_.job_retention from the store, at most once per
  // retention_sweep_interval (sooner while a backlog remains).
  void SweepEndedJobsLocked(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const ClusterOptions options_;
  const std::unique_ptr<jobs::JobStore> store_;  // thread-safe on its own
  WorkerPool* const pool_;
  absl::Mutex mu_;
  absl::CondVar changed_;  // any job state or progress change
  std::map<std::string, std::shared_ptr<JobRuntime>> runtimes_ ABSL_GUARDED_BY(mu_);
  // The PENDING jobs in submission order: what scheduling looks at, instead of the job table.
  std::vector<PendingJob> pending_ ABSL_GUARDED_BY(mu_);
  int64_t next_job_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t groups_lost_ ABSL_GUARDED_BY(mu_) = 0;  // LoseGroupLocked's losses (not the late reports)
  // A planning the job database refused: the monitor schedules again until it is taken.
  bool schedule_retry_ ABSL_GUARDED_BY(mu_) = false;
  // The earliest end of a restart's backoff among the PENDING jobs (set by ScheduleLocked): the
  // monitor schedules again then.
  absl::Time next_backoff_end_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();
  absl::Time next_retention_sweep_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  std::string last_store_error_ ABSL_GUARDED_BY(mu_);  // the last one logged, not repeated
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool draining_ ABSL_GUARDED_BY(mu_) = false;  // Drain() was called
  ThreadGroup threads_;                         // loads, and batch queues released off the lock
  std::thread monitor_;
};

}  // namespace bertshard::server

#endif  // BERTSHARD_SERVER_SCHEDULER_H_
