// File: server/cluster.h
// -----------------------------------------------------------------------------
// The coordinator's view of the cluster: the pool of worker daemons (registration, heartbeats,
// liveness) and the jobs they serve (plan, rank assignment, loading with progress, inference,
// cancellation, failure, re-adoption after a restart). Jobs and their plans persist in a
// JobStore. The gRPC layer talks to this one object. Implementation: cluster.cc (worker pool,
// scheduling and loading), cluster_recovery.cc (taking jobs back after a restart, with the rules
// of readoption.h); each READY job's requests are served by its JobServing (job_serving.h), which
// asks this object only for the job's ranks (ForwardTargets).
//
// Failure model: a worker silent for ClusterOptions::missed_heartbeats heartbeat intervals (3) is
// dead (so its jobs fail within 3 1/4 intervals of its last heartbeat; workers beat on a fixed
// schedule, so a healthy worker stalled for up to about two intervals keeps its job); a dead worker, any rank error, or
// a failed Forward call to any rank fails its job at once with a cause naming the worker and rank and what failed, and
// the surviving ranks are told to unload. Workers' collectives have timeouts, so no rank waits
// forever.
//
// Coordinator restarts end no job. Workers report the shards they hold (job, rank, world size,
// next sequence number) when they register and with every heartbeat. On start, jobs that were
// READY or LOADING wait up to `readopt_grace` for all their ranks (Job.recovering says which;
// Infer answers UNAVAILABLE meanwhile). All back, each rank once, unbroken and on the same next
// sequence: READY again with rank -> worker and the sequence rebuilt, so Infer answers as before.
// Otherwise FAILED with the true cause (see readoption.h), at once when a rank's worker comes back
// without it, and the ranks that did come back unload. PLANNED jobs (nothing loaded yet) go back to PENDING. Held
// shards of jobs this coordinator does not know, has ended, or placed on other workers are unloaded through the
// RegisterWorker and Heartbeat responses. A worker that registers again while its old entry still
// serves a job keeps the job when it reports holding that rank.
//
// Shutdown: Drain() (on SIGTERM, before in-flight calls drain) stops the liveness monitor and the
// scheduler, so that heartbeats the draining server no longer takes fail no job and nothing false
// is stored; in-flight inferences still finish or fail truthfully.
//
// Thread safety: thread-safe. Blocking calls (Infer, WatchJob) take a deadline.
#ifndef BERTSHARD_SERVER_CLUSTER_H_
#define BERTSHARD_SERVER_CLUSTER_H_

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "bertshard/v1/coordinator.grpc.pb.h"
#include "bertshard/v1/worker.grpc.pb.h"
#include "common/model_root.h"
#include "grpcpp/security/credentials.h"
#include "jobs/job_store.h"
#include "server/batch_queue.h"
#include "server/job_serving.h"
#include "server/placement.h"

namespace bertshard::server {

struct ClusterOptions {
  std::string database_path = ":memory:";
  absl::Duration heartbeat_interval = absl::Seconds(1);
  // A worker silent for this many heartbeat intervals is dead (its job fails). Workers beat on a
  // fixed schedule, so a healthy one is silent for one interval at most; the rest is the margin
  // for a loaded machine or a brief stall.
  int missed_heartbeats = 3;
  absl::Duration load_timeout = absl::Minutes(10);
  int collective_timeout_seconds = 60;  // rendezvous and collectives on the workers
  // How long one (batched) forward may take on the ranks before its job is failed: the callers'
  // own deadlines end their calls, never the forward (see Infer).
  absl::Duration forward_timeout = absl::Minutes(10);
  // After a start, how long READY and LOADING jobs from the database wait for their ranks to
  // come back (workers register again within about a heartbeat interval of the start).
  absl::Duration readopt_grace = absl::Seconds(10);
  // Dynamic batching of each job's Infer and Embed calls (see BatchQueue).
  BatchLimits batching;
  // Called for every merged forward, on the job's batch thread (metrics); may be null.
  BatchObserver batch_observer;
  // Where checkpoints may be read (--model_root); unconfined by default. Requests name their
  // checkpoint as workers will see it; the coordinator resolves it under its own root for what it
  // reads itself (config.json, the tokenizer and head files).
  common::ModelRoot model_root;
  // Jobs one client may have that have not ended (PENDING to READY); 0: no limit. Ended jobs do
  // not count, so cancelling one makes room.
  int max_jobs_per_client = 16;
  // Sent with every call to a worker (their --auth_token_file); empty: none.
  std::string worker_token;
  // The channels to the workers (TLS, common/grpc_tls.h); null: plaintext.
  std::shared_ptr<grpc::ChannelCredentials> worker_credentials;
};

class Cluster : private ForwardTargets {
 public:
  static absl::StatusOr<std::unique_ptr<Cluster>> Create(const ClusterOptions& options);
  ~Cluster() override;

  // `request` with its checkpoint resolved under the model root (common/model_root.h), for the
  // coordinator's own reads; INVALID_ARGUMENT when it is outside or not a checkpoint directory.
  absl::StatusOr<v1::PlanRequest> LocalRequest(const v1::PlanRequest& request) const;

  // The response lists the held jobs the worker must unload.
  v1::RegisterWorkerResponse RegisterWorker(const v1::RegisterWorkerRequest& request);
  // NOT_FOUND for a worker this coordinator does not know (it must register again). The response
  // lists the held jobs the worker must unload.
  absl::StatusOr<v1::HeartbeatResponse> Heartbeat(const v1::HeartbeatRequest& request);
  v1::ListWorkersResponse ListWorkers();
  // Per job that has a runtime here: Infer calls queued or running on it (metrics).
  std::map<std::string, int> InferQueueDepths();

  // `client`: who submits (Job.submitted_by); RESOURCE_EXHAUSTED when it already has
  // ClusterOptions::max_jobs_per_client jobs that have not ended.
  absl::StatusOr<v1::Job> SubmitJob(const v1::SubmitJobRequest& request, const std::string& client = "");
  absl::StatusOr<v1::Job> GetJob(const std::string& id);
  absl::StatusOr<std::vector<v1::Job>> ListJobs();
  absl::StatusOr<v1::Job> CancelJob(const std::string& id);
  // Calls `emit` with the job's state and load progress whenever they change, until the job is
  // READY (and not recovering), FAILED or CANCELLED, `emit` returns false, `cancelled` turns true (checked at least
  // every half second), or the deadline passes.
  absl::Status WatchJob(const std::string& id, absl::Time deadline,
                        const std::function<bool(const v1::JobEvent&)>& emit, const std::function<bool()>& cancelled);
  // Requests on a job are batched (ClusterOptions::batching): concurrent ones merge into one
  // forward, and forwards run one at a time. A request whose caller went away (`cancelled`) or
  // whose deadline passed while it waited is never sent; once its forward has started on the ranks
  // the forward runs to the end (stopping some ranks mid-forward would desynchronise them), and
  // the caller gets DEADLINE_EXCEEDED / CANCELLED at once.
  // UNAVAILABLE while the job is recovering after a restart (retry), or when a rank's Forward
  // call fails (the job fails with it, at once).
  absl::StatusOr<v1::InferResponse> Infer(const v1::InferRequest& request, absl::Time deadline,
                                          const std::function<bool()>& cancelled = nullptr);
  // Sentence embeddings from a BertModel job, batched like Infer. FAILED_PRECONDITION for a job
  // whose model has no encoder output.
  absl::StatusOr<v1::EmbedResponse> Embed(const v1::EmbedRequest& request, absl::Time deadline,
                                          const std::function<bool()>& cancelled = nullptr);

  // The server is draining for shutdown: from now on no worker is declared dead and no job is
  // scheduled. Idempotent.
  void Drain();

 private:
  struct Worker;
  struct Recovery;
  struct JobRuntime;
  explicit Cluster(const ClusterOptions& options, std::unique_ptr<jobs::JobStore> store);

  // Builds the runtimes of the stored jobs: PENDING as they are, PLANNED back to PENDING, READY
  // and LOADING recovering. Called once, before any worker registers.
  absl::Status RecoverJobsLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Takes in what a registering worker holds: reports for recovering jobs, the rest to unload.
  // Also marks the recovering ranks this worker's address held and no longer does as lost.
  void TakeHeldShardsLocked(Worker* worker, const google::protobuf::RepeatedPtrField<v1::HeldShard>& held,
                            google::protobuf::RepeatedPtrField<std::string>* unload) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Applies DecideReadoption to a recovering job: adopt, fail, or keep waiting.
  void DecideRecoveryLocked(const std::string& job_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The stored job with `recovering` filled in.
  absl::StatusOr<v1::Job> GetJobLocked(const std::string& id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ScheduleLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The healthy workers without a job, in the pool's order, with their devices (for PlaceRanks).
  std::vector<IdleWorker> IdleWorkersLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A write the job database refused (full, read-only, I/O): said on stderr. The
  // callers decide what the job does without it.
  void StoreErrorLocked(const std::string& what, const absl::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // StoreErrorLocked when `status` is not OK: for writes whose refusal changes nothing else here.
  void RecordLocked(const absl::Status& status, const std::string& what) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void LoadJob(std::string job_id);
  // `job_id` by value: callers pass fields this clears (a worker's job_id).
  // Takes worker `id` out of the pool and fails its job, if any: "worker ID (rank R) at ADDR `why`".
  void MarkUnhealthyLocked(const std::string& id, Worker& worker, const std::string& why)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FailJobLocked(std::string job_id, const std::string& cause, v1::JobState state = v1::FAILED)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void MonitorLoop();
  // A READY job's JobServing, made on first use.
  absl::StatusOr<std::shared_ptr<JobServing>> ServingFor(const std::string& job_id);
  // ForwardTargets, for the jobs' JobServings (on their batch threads).
  absl::StatusOr<ForwardTarget> NextForward(const std::string& job_id) override;
  void FailJob(const std::string& job_id, const std::string& cause) override;
  v1::JobEvent EventLocked(const v1::Job& job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const ClusterOptions options_;
  std::unique_ptr<jobs::JobStore> store_;
  const std::string incarnation_;  // distinguishes worker ids across coordinator restarts
  absl::Mutex mu_;
  absl::CondVar changed_;  // any job state or progress change
  std::map<std::string, std::unique_ptr<Worker>> workers_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::shared_ptr<JobRuntime>> runtimes_ ABSL_GUARDED_BY(mu_);
  int64_t next_worker_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t next_job_ ABSL_GUARDED_BY(mu_) = 0;
  // A planning the job database refused: the monitor schedules again until it is taken.
  bool schedule_retry_ ABSL_GUARDED_BY(mu_) = false;
  std::string last_store_error_ ABSL_GUARDED_BY(mu_);  // the last one logged, not repeated
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool draining_ ABSL_GUARDED_BY(mu_) = false;  // Drain() was called
  std::vector<std::thread> threads_ ABSL_GUARDED_BY(mu_);
  std::thread monitor_;
};

}  // namespace bertshard::server

#endif  // BERTSHARD_SERVER_CLUSTER_H_
