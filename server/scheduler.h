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

// One shape of a job: what its replicas load and what its requests are prepared for (plan,
// checkpoint, serving assets). A job has one; while a live update runs, also the one it moves to
// (JobRuntime::next). Shared, never changed once made.
struct JobShape {
  int32_t version = 0;      // Job.version: 0 as submitted, one more per update that switched over
  v1::PlanRequest request;  // Job.request: what the plan was made from
  v1::ShardPlan plan;
  std::string checkpoint;
  // Read through the checkpoint's descriptors, off the lock, before the shape serves: what its
  // requests are served with, whatever becomes of the files' names later.
  std::shared_ptr<const JobAssets> assets;
  std::string backend = "gloo";  // "gloo" (CPU workers) or "nccl" (one rank per GPU)
};

// One replica of a job: a TP x PP group of workers with the job's plan, placed, loaded and lost
// on its own (its workers know it by ReplicaKey(job id, replica): replica_keys.h). Fields are
// guarded by the Scheduler's lock.
struct GroupRuntime {
  GroupRuntime(int32_t replica, std::shared_ptr<const JobShape> shape, const RestartPolicy& policy)
      : replica(replica), shape(std::move(shape)), restarts(policy) {}
  enum class Phase {
    kPending,     // waiting for idle workers (first placement, or after a loss: restarts says)
    kPlanned,     // workers assigned; its load starts
    kLoading,     // its ranks load
    kReadopting,  // a restarted coordinator waits for its ranks to come back (recovery)
    kServing,     // loaded and answering
  };
  const int32_t replica;
  const std::shared_ptr<const JobShape> shape;  // what it loads: the job's shape, or an update's
  Phase phase = Phase::kPending;
  // While pending: what it waits for (ReplicaStatus.reason); `pending_note` is said before it
  // (why it is pending again: "recovering: lost ...", "the coordinator restarted before loading").
  std::string reason;
  std::string pending_note;
  // The placement: rank r's worker (RankAssignment.replica set), empty while pending.
  std::vector<v1::RankAssignment> ranks;
  std::vector<v1::RankProgress> progress;
  std::vector<std::shared_ptr<grpc::ClientContext>> load_contexts;
  // The next forward's number. Advanced only by the forward that leases the group (one at a time,
  // so every rank sees one order), set by recovery before it serves again, and 0 on every new
  // placement (a fresh load numbers from 0).
  int64_t next_sequence = 0;
  // Ends the forward in flight when the group is lost elsewhere (LoseGroupLocked) or the job fails,
  // instead of letting it wait for the surviving ranks' collective timeout. A new one for each
  // placement: the old one stays aborted.
  std::shared_ptr<ForwardAbort> forward_abort = std::make_shared<ForwardAbort>();
  // Which placement this is: advanced when the group is placed and when it is lost, so that a load
  // or a forward's failure from an earlier placement finds it changed and does nothing.
  // Unique among all placements of this coordinator (a replica scaled away and added again must
  // not meet its predecessor's loads): Scheduler::generations_.
  int64_t generation = 0;
  int64_t lost_from = 0;  // the placement the last loss ended
  // Losses in a row, backoff and the --max_restarts limit (group_restarts.h).
  GroupRestarts restarts;
  // Set while kReadopting: which of its ranks came back after a coordinator restart.
  std::unique_ptr<JobRecovery> recovery;
  // A forward holds the group (NextForward to EndForward): one at a time.
  bool forwarding = false;
  absl::Time idle_since = absl::InfinitePast();  // the forward that leased it last ended then
  int64_t forwards = 0;                          // run since it was placed
  // Its utilisation, for the autoscaler: when the forward in flight began, the time spent in
  // forwards that ended, and what of it (with the one in flight) the last sample counted.
  absl::Time forward_started = absl::InfinitePast();
  absl::Duration busy;
  absl::Duration busy_sampled;
  // Scaled away while a forward held it: dropped when that forward ends (ScaleJob).
  bool retiring = false;
  // Short of workers after a loss (ClusterOptions::smaller_shapes, scheduler_smaller.cc): the
  // smaller shape of `shape` it is placed, loaded and served in until it grows back; null: `shape`.
  // The replica keeps recovering meanwhile (restarts.recovering(): Job.degraded says so).
  std::shared_ptr<const JobShape> smaller;
  // While pending after a loss or to grow back (--smaller_shapes): the workers it kept, with the
  // ranks they had in `kept_from`, still assigned to it in the pool and holding their shards, for
  // its next placement to take what they hold (AssignKeptWorkers, LoadShardRequest.keep_held).
  std::vector<v1::RankAssignment> kept;
  std::shared_ptr<const JobShape> kept_from;
  // Its load in a smaller shape failed: it waits for its own shape until it serves in it again.
  bool smaller_refused = false;
  // Grows back to `shape` when its forward in flight ends (set only while one runs).
  bool growing_back = false;

  bool serving() const { return phase == Phase::kServing; }
  std::vector<std::string> WorkerIds() const;
};

// One job as this coordinator runs it, from its submission (or its recovery at start) until it
// ends: then it is erased (a load in flight keeps its pointer until it sees `ended`), so memory
// follows the live jobs, not the history. Fields are guarded by the Scheduler's lock.
struct JobRuntime {
  explicit JobRuntime(const RestartPolicy& policy) : policy(policy) {}
  const RestartPolicy policy;  // each replica's restarts
  // The shape the job serves (Job.request, Job.version), and while a live update runs the shape
  // it moves to (Job.update): its replicas load beside the old ones, and it becomes `shape` when
  // they serve (scheduler_updates.cc).
  std::shared_ptr<const JobShape> shape;
  std::shared_ptr<const JobShape> next;
  int64_t update_started_unix_millis = 0;
  // An update short of workers takes one old replica away at a time to make room: the new
  // replicas placed when it last did (another goes only once one more is placed).
  int room_made_at = -1;
  std::string submitted_by;  // counted against ClusterOptions::max_jobs_per_client until ended
  std::string name;          // SubmitJobRequest.name (job_names.h), unique among the live jobs; may be empty
  // FAILED or CANCELLED here (FailJobLocked), whether or not the store took the write: no load
  // starts or finishes for it after.
  bool ended = false;
  // The replicas wanted (Job.replicas) and those that exist: 0..replicas-1, and above that the
  // ones scaled away that still finish a forward (retiring).
  int32_t replicas = 1;
  std::map<int32_t, std::unique_ptr<GroupRuntime>> groups;
  // Autoscaling bounds (Job.min_replicas, Job.max_replicas; 0: none) and, with them, what decides.
  int32_t min_replicas = 0;
  int32_t max_replicas = 0;
  std::unique_ptr<ReplicaAutoscaler> autoscaler;
  // Since when fewer of its replicas serve than it wants (InfinitePast: all serve): an autoscaled
  // job gives up a replica that finds no workers for --autoscale_down_after.
  absl::Time unserved_since = absl::InfinitePast();
  // The job's request path (assets, batch queue, decoding); made on the first Infer/Embed call
  // (while a replica serves or one is being placed again), closed (and released off the lock) when
  // the job ends.
  std::shared_ptr<JobServing> job_serving;
  // The request paths of shapes an update switched away from, by version (null: none was made),
  // with that shape's replicas still there: they finish the requests those paths hold, and unload
  // once nothing else holds the path (scheduler_updates.cc).
  std::map<int32_t, std::shared_ptr<JobServing>> draining;

  GroupRuntime* Group(int32_t replica);  // null when there is none
  // Replicas that answer now (retiring ones excluded): of every shape, or of one version.
  int ServingGroups() const;
  int ServingGroups(int32_t version) const;
  // Whether a replica of the job's shape serves or is being placed again after a loss or a
  // restart (requests then wait for it rather than fail).
  bool Serving() const;
  bool Recovering(int32_t version) const;
  bool Recovering() const { return Recovering(shape->version); }
  bool Current(const GroupRuntime& group) const { return group.shape == shape; }
  // The lowest replica index no group holds.
  int32_t FreeReplicaIndex() const;
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
  // See Cluster::ScaleJob (scheduler_replicas.cc).
  absl::StatusOr<v1::Job> ScaleJob(const std::string& id, int32_t replicas, int32_t min_replicas = 0,
                                   int32_t max_replicas = 0) ABSL_LOCKS_EXCLUDED(mu_);
  // See Cluster::UpdateJob (scheduler_updates.cc).
  absl::StatusOr<v1::Job> UpdateJob(const v1::UpdateJobRequest& request) ABSL_LOCKS_EXCLUDED(mu_);
  // See Cluster::WatchJob.
  absl::Status WatchJob(const std::string& id, absl::Time deadline,
                        const std::function<bool(const v1::JobEvent&)>& emit, const std::function<bool()>& cancelled,
                        bool all_replicas = false) ABSL_LOCKS_EXCLUDED(mu_);

  // For serving. The ranks, sequence number and abort of the next forward of job `job_id`'s shape
  // `version` on its replica idle the longest, which it holds until EndForward (one forward at a time per replica);
  // waits until `wait_until` while every replica is busy or being placed again (then UNAVAILABLE,
  // saying why); FAILED_PRECONDITION when the job no longer serves, UNAVAILABLE once stopping.
  absl::StatusOr<ForwardTarget> NextForward(const std::string& job_id, int32_t version, absl::Time wait_until) override
      ABSL_LOCKS_EXCLUDED(mu_);
  void EndForward(const std::string& job_id, int32_t replica, int64_t generation) override ABSL_LOCKS_EXCLUDED(mu_);
  // A forward failed on placement `generation` of the job's replica: LoseGroupLocked.
  void LoseGroup(const std::string& job_id, int32_t replica, int64_t generation, const std::string& cause,
                 const std::string& unreachable_worker) override ABSL_LOCKS_EXCLUDED(mu_);
  // Calls `use` under the lock with the runtime of `job_id` when its shape serves or a replica is being
  // placed again (requests then wait for it), else with null and the stored job (recovering filled
  // in) to say why not; returns what `use` returns. UNAVAILABLE, without calling it, once stopping
  // (no batch queue may be made then).
  absl::Status WithServingRuntime(const std::string& job_id,
                                  const std::function<absl::Status(const std::shared_ptr<JobRuntime>& serving,
                                                                   const absl::StatusOr<v1::Job>& job)>& use)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Each job's restarts in a row and whether it is degraded (as Job.restarts and Job.degraded say),
  // its replicas, and the groups lost since start: the recovery metrics (recovery_metrics.h).
  RecoveryMetrics Recovery() ABSL_LOCKS_EXCLUDED(mu_);
  // Calls `visit` under the lock for every job with a runtime here (the jobs that have not ended).
  void ForEachRuntime(const std::function<void(const std::string& job_id, JobRuntime& runtime)>& visit)
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // A replica waiting for workers.
  struct PendingGroup {
    std::string job_id;
    int32_t replica = 0;
  };
  struct Load;  // one replica's load in progress, passed along LoadGroup's steps
  // A job's runtime and one of its replicas, found by the replica's key on its workers.
  struct FoundGroup {
    std::shared_ptr<JobRuntime> runtime;
    GroupRuntime* group = nullptr;
    std::string job_id;
  };

  Scheduler(const ClusterOptions& options, std::unique_ptr<jobs::JobStore> store, WorkerPool* pool);

  FoundGroup FindGroupLocked(const std::string& key) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Adds replica `replica` of the job, PENDING, to be placed with `shape` (null: the job's).
  GroupRuntime& AddGroupLocked(const std::string& job_id, JobRuntime& runtime, int32_t replica,
                               std::shared_ptr<const JobShape> shape = nullptr) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void QueueForPlacementLocked(const std::string& job_id, int32_t replica, bool first)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void UnqueueLocked(const std::string& job_id, int32_t replica) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The job as its replicas stand, written to the store when it changed: its state (the most
  // advanced replica's: READY while any serves), every replica's ranks, and the pending reason of
  // its first waiting replica; `reason` goes into the history with a change of state.
  absl::Status RecordJobLocked(const std::string& job_id, const JobRuntime& runtime, const std::string& reason)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The batch queue runs as many forwards at once as replicas serve.
  void UpdateLanesLocked(JobRuntime& runtime) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The job's replicas become `replicas` (stored by the caller): ScaleJob's and the autoscaler's.
  void ScaleJobLocked(const std::string& id, JobRuntime& runtime, int32_t replicas) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Autoscaling bounds that may be set (INVALID_ARGUMENT otherwise); both 0: none.
  absl::Status CheckReplicaBounds(int32_t min_replicas, int32_t max_replicas) const;
  // Sets the job's bounds, with an autoscaler when they are set.
  void SetBoundsLocked(JobRuntime& runtime, int32_t min_replicas, int32_t max_replicas)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // One sample of every autoscaled job's utilisation, and the scaling it calls for (the monitor's).
  void AutoscaleLocked(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Takes the replica away now (ScaleJob): loads cancelled, workers unload and go back to the pool.
  void DropGroupLocked(const std::string& job_id, JobRuntime& runtime, int32_t replica)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The replica's workers go back to the pool after they unload (WorkerPool::SetUnloading: a load
  // of the same key on one of them would race the unload).
  void UnloadGroupLocked(const std::string& key) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Live updates (scheduler_updates.cc). The shape a request asks for, read and planned off the
  // lock: INVALID_ARGUMENT for what the planner or the checkpoint refuses.
  // Reads files only (under the lock only in Create, before anything is served).
  absl::StatusOr<std::shared_ptr<const JobShape>> ReadShape(const v1::PlanRequest& request, std::string backend,
                                                            int32_t version) const;
  // The update to `next` begins: stored, and its replicas added to be placed.
  absl::Status StartUpdateLocked(const std::string& job_id, JobRuntime& runtime, std::shared_ptr<const JobShape> next,
                                 int64_t started_unix_millis) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // What each update can do now: make room (an old replica taken away when the new ones cannot be
  // placed), switch over, and unload the shapes switched away from once drained. Called by the
  // monitor and when a replica comes to serve.
  void AdvanceUpdatesLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void AdvanceUpdateLocked(const std::string& job_id, JobRuntime& runtime) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool SwitchShapeLocked(const std::string& job_id, JobRuntime& runtime) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ends the running update without switching: its replicas go, the old shape serves on.
  void AbortUpdateLocked(const std::string& job_id, JobRuntime& runtime, const std::string& why)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::string UpdateProgressLocked(const JobRuntime& runtime) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Smaller shapes (ClusterOptions::smaller_shapes, scheduler_smaller.cc). Places the recovering
  // replica that its kept workers and the idle ones do not fit in the largest smaller shape they fit.
  // Returns the workers of its ranks, with `group.smaller` set; empty, changing nothing, when it
  // may not or none fits.
  std::vector<IdleWorker> PlaceSmallerLocked(const JobRuntime& runtime, GroupRuntime& group,
                                             const std::vector<IdleWorker>& idle) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The workers of a waiting replica's ranks for `plan`: its kept workers where they hold most of
  // a rank's tensors, idle ones for the rest; empty when they do not fit.
  std::vector<IdleWorker> PlaceKeepingLocked(const GroupRuntime& group, const JobShape& shape,
                                             const std::vector<IdleWorker>& idle) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Stores the replica's smaller shape, if it runs one, on its rank `a` (RankAssignment.smaller_*).
  static void MarkSmallerLocked(const GroupRuntime& group, v1::RankAssignment& a);
  // Back after a coordinator restart, a replica stored in a smaller shape (RankAssignment.smaller_*)
  // is re-adopted in it; null when none is stored or it cannot be planned (it is placed again).
  std::shared_ptr<const JobShape> StoredSmallerShapeLocked(const JobShape& own,
                                                           const std::vector<v1::RankAssignment>& stored) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether losing `group` keeps its healthy workers' shards (--smaller_shapes, the job's shape,
  // no update running).
  bool KeepsWorkersLocked(const JobRuntime& runtime, const GroupRuntime& group) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The replica keeps its healthy workers (GroupRuntime::kept); the others are released.
  void KeepWorkersLocked(const std::string& job_id, GroupRuntime& group) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Worker `worker_id` serves replica `key` no more: released, and told to drop its shard.
  void ReleaseWorkerLocked(const std::string& worker_id, const std::string& key) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Worker `w`, released from replica `key`, drops its shard: out of placement until its Unload
  // call has answered (WorkerPool::BeginUnloadCall), the pool scheduled then.
  void UnloadWorkerLocked(const WorkerStub& w, const std::string& key) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Worker `id` as a placement candidate, if it is in the pool and healthy.
  std::optional<IdleWorker> HealthyWorkerLocked(const std::string& id) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The replica's current placement ends (loads cancelled, the forward in flight aborted with
  // `why`, the generation advanced so that late news of it changes nothing) and it is pending;
  // its workers, ranks and shape are the caller's to settle.
  void CutOffLocked(GroupRuntime& group, const std::string& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A replica serving in a smaller shape whose own shape its workers and the idle ones fit again
  // grows back (at once, or when its forward in flight ends); one at a time.
  void GrowBackWhereRoomLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether `group` serves in a smaller shape and its own would fit its workers and the idle ones.
  bool RoomToGrowBackLocked(const JobRuntime& runtime, const GroupRuntime& group, const std::vector<IdleWorker>& idle)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Its load in a smaller shape failed: it is cut off (its workers unload), waits for its own
  // shape from now on, and no restart is spent on it (it recovers from the loss before).
  void GiveUpSmallerLocked(const std::string& job_id, JobRuntime& runtime, GroupRuntime& group,
                           const std::string& cause, const std::string& unreachable_worker)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The replica unloads and waits to be placed in its own shape, still recovering: its requests
  // wait for it (or go to the job's other replicas).
  void GrowBackLocked(const std::string& job_id, JobRuntime& runtime, GroupRuntime& group)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Builds the runtimes of the stored jobs (RecoverStoredJobs). Called once, before any worker
  // registers.
  absl::Status RecoverJobsLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A PENDING job stored while it recovered from a lost group (its reason says so) recovers again
  // here: Job.degraded and its requests' waiting hold across a coordinator restart. Returns the
  // failure cause when --max_restarts allows no restart (0): the caller ends the job.
  std::optional<std::string> ResumeRecoveryLocked(const std::string& stored_reason, GroupRuntime& group)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // What the entry a worker replaced (it registers again from its address) means for its replica:
  // a recovering one forgets its reports; one it still holds unbroken is kept (returned: the
  // replica's key and the rank, for the new entry); any other is lost.
  std::optional<std::pair<std::string, int32_t>> SettleReplacedLocked(const v1::WorkerInfo& old,
                                                                      const v1::RegisterWorkerRequest& request)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The kept rank of the replica `key` moves to the new entry `worker` (in the runtime and the store).
  void MoveRankLocked(const std::string& key, int32_t rank, v1::WorkerInfo* worker) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Takes in what a worker holds (SortHeldShards): reports for recovering replicas, the rest to unload.
  void TakeHeldShardsLocked(const v1::WorkerInfo& worker, const google::protobuf::RepeatedPtrField<v1::HeldShard>& held,
                            google::protobuf::RepeatedPtrField<std::string>* unload) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Applies the readoption decision to a recovering replica (by key): adopt, lose, or keep waiting.
  void DecideRecoveryLocked(const std::string& key) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The stored job with `recovering`, `degraded`, `restarts`, `replicas` and `replica_status`
  // filled in from its runtime, if it has one.
  void FillRuntimeFieldsLocked(v1::Job& job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<v1::Job> GetJobLocked(const std::string& id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  v1::JobEvent EventLocked(const v1::Job& job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Places the waiting replicas that fit the idle workers (in the order they joined, but for those
  // in a restart's backoff) and starts their loads; records why the others wait.
  void ScheduleLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Assigns the placed workers and records the replica PLANNED; false (nothing changed) when the
  // store refuses.
  bool PlanGroupLocked(const std::string& job_id, JobRuntime& runtime, GroupRuntime& group,
                       const std::vector<IdleWorker>& workers) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // LoadGroup's steps: check the replica may still load and record it LOADING; reserve the
  // rendezvous port; register the ranks' load contexts; load every rank; record it READY.
  void LoadGroup(const std::string& job_id, int32_t replica, int64_t generation) ABSL_LOCKS_EXCLUDED(mu_);
  std::optional<Load> BeginLoad(const std::string& job_id, int32_t replica, int64_t generation)
      ABSL_LOCKS_EXCLUDED(mu_);
  std::vector<std::shared_ptr<grpc::ClientContext>> LoadContexts(const Load& load) ABSL_LOCKS_EXCLUDED(mu_);
  bool LoadShards(const Load& load, int32_t port, const std::string& secret,
                  const std::vector<std::shared_ptr<grpc::ClientContext>>& contexts) ABSL_LOCKS_EXCLUDED(mu_);
  void FinishLoad(const Load& load, bool all_loaded) ABSL_LOCKS_EXCLUDED(mu_);

  // Ends the job (FAILED or CANCELLED) here and in the store: its loads and forwards are cut off,
  // its batch queue closed, its workers freed (the healthy ones told to unload), and the pool
  // scheduled.
  void FailJobLocked(const std::string& job_id, const std::string& cause, v1::JobState state = v1::FAILED)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The job's replica lost a worker (`cause` names it and says how): instead of ending the job, the
  // replica is cut off (loads cancelled, forward aborted), its survivors unload (kept out of
  // placement until they have: WorkerPool::SetUnloading), and it waits for workers again, saying
  // why, to be placed again after the restart's backoff (group_restarts.h); the job stays READY
  // while another replica serves. Past --max_restarts the job FAILS naming every loss.
  // `generation` must be the replica's current placement (else this is a late report of a loss
  // already handled: nothing happens); `unreachable_worker` (may be "") is out of placement until
  // it heartbeats again.
  // With --smaller_shapes its healthy workers are kept for its next placement instead
  // (KeepWorkersLocked), unless `keep_workers` is false (a loss in its load: one of them may be
  // what fails).
  void LoseGroupLocked(const std::string& job_id, int32_t replica, int64_t generation, const std::string& cause,
                       const std::string& unreachable_worker = "", bool keep_workers = true)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // LoseGroupLocked for the replica `worker` served, if any: "worker ID (rank R) at ADDR `why`".
  void LoseWorkersGroupLocked(const v1::WorkerInfo& worker, const std::string& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A worker told to unload (`unload`, from its registration or heartbeat answer) shards of jobs that
  // run here is kept out of placement until it reports none (WorkerPool::SetUnloading).
  void MarkUnloadingLocked(const std::string& worker_id, const google::protobuf::RepeatedPtrField<std::string>& unload)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Closes the job's JobServing (waiting requests fail with `why`) and returns it, to be released
  // off the lock: its destructor waits for the running batches, which may be the caller's.
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
  absl::CondVar changed_;  // any job state or progress change, and every forward's end
  std::map<std::string, std::shared_ptr<JobRuntime>> runtimes_ ABSL_GUARDED_BY(mu_);
  // The replicas waiting for workers, in the order they joined: what scheduling looks at, instead
  // of the job table.
  std::vector<PendingGroup> pending_ ABSL_GUARDED_BY(mu_);
  int64_t next_job_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t groups_lost_ ABSL_GUARDED_BY(mu_) = 0;  // LoseGroupLocked's losses (not the late reports)
  int64_t generations_ ABSL_GUARDED_BY(mu_) = 0;  // the last GroupRuntime::generation given
  int forward_waiters_ ABSL_GUARDED_BY(mu_) = 0;  // NextForward calls waiting for a free replica
  // A planning the job database refused: the monitor schedules again until it is taken.
  bool schedule_retry_ ABSL_GUARDED_BY(mu_) = false;
  // The earliest end of a restart's backoff among the waiting replicas (set by ScheduleLocked): the
  // monitor schedules again then.
  absl::Time next_backoff_end_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();
  absl::Time next_retention_sweep_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  std::string last_store_error_ ABSL_GUARDED_BY(mu_);  // the last one logged, not repeated
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool draining_ ABSL_GUARDED_BY(mu_) = false;                             // Drain() was called
  absl::Time last_autoscale_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();  // AutoscaleLocked's last sample
  ThreadGroup threads_;  // loads, and batch queues released off the lock
  std::thread monitor_;
};

}  // namespace bertshard::server

#endif  // BERTSHARD_SERVER_SCHEDULER_H_
