// File: server/cluster.h
// -----------------------------------------------------------------------------
// The coordinator's view of the cluster: the pool of worker daemons (registration, heartbeats,
// liveness) and the jobs they serve (plan, rank assignment, loading with progress, inference,
// cancellation, failure, re-adoption after a restart). Jobs and their plans persist in a
// JobStore. The gRPC layer talks to this one object, a front over the parts: worker_pool.h (the
// workers, their channels and liveness), scheduler.h (placement, loading, failing, the monitor),
// job_recovery.h (taking jobs back after a restart, with the rules of readoption.h). Each READY
// job's requests are served by its JobServing (job_serving.h: assets, input preparation, batch
// queue, decoding), which asks the scheduler only for the job's ranks (ForwardTargets).
//
// Failure model: a worker silent for ClusterOptions::missed_heartbeats heartbeat intervals (3) is
// dead (so its job's group is lost within 3 1/4 intervals of its last heartbeat; workers beat on a
// fixed schedule, so a healthy worker stalled for up to about two intervals keeps its job); a dead,
// leaving or re-registered worker, any rank error, or a failed Forward or load call to any rank
// loses its job's group at once with a reason naming the worker and rank and what failed: the
// surviving ranks are told to unload and the job is placed and loaded again on idle workers, with
// backoff (ClusterOptions::restarts, group_restarts.h), instead of failing; requests wait for the
// new group (the batch in flight is sent once more on it), UNAVAILABLE shortly before their
// deadline if none comes. With replicas (SubmitJobRequest.replicas: independent groups of the one
// plan, each on its own workers, behind the job's one id and queue; one forward at a time each,
// to the one idle the longest) only the replica that lost the worker is placed again: the job
// stays READY while another serves, Job.degraded says which is lost and why, and the batch in
// flight on the lost one is sent once more on another. Past --max_restarts losses in a row, or on a load refused for
// what it asks, the job FAILS. Workers' collectives have timeouts, so no rank waits forever.
//
// Coordinator restarts end no job. Workers report the shards they hold (job, rank, world size,
// next sequence number) when they register and with every heartbeat. On start, jobs that were
// READY or LOADING wait up to `readopt_grace` for all their ranks (Job.recovering says which;
// Infer answers UNAVAILABLE meanwhile). All back, each rank once, unbroken and on the same next
// sequence: READY again with rank -> worker and the sequence rebuilt, so Infer answers as before.
// Otherwise placed and loaded again (as for a lost worker, above) with the true cause (see
// readoption.h), at once when a rank's worker comes back without it, and the ranks that did come
// back unload. PLANNED jobs (nothing loaded yet) go back to PENDING. Held
// shards of jobs this coordinator does not know, has ended, or placed on other workers are unloaded through the
// RegisterWorker and Heartbeat responses. A worker that registers again while its old entry still
// serves a job keeps the job when it reports holding that rank.
//
// Shutdown: Drain() (on SIGTERM, before in-flight calls drain) stops the liveness monitor and the
// scheduler, so that heartbeats the draining server no longer takes fail no job and nothing false
// is stored; in-flight inferences still finish or fail truthfully.
//
// Thread safety: thread-safe (the parts' locks: scheduler.h, worker_pool.h). Blocking calls (Infer,
// WatchJob) take a deadline.
#ifndef BERTSHARD_SERVER_CLUSTER_H_
#define BERTSHARD_SERVER_CLUSTER_H_

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "bertshard/v1/coordinator.grpc.pb.h"
#include "bertshard/v1/worker.grpc.pb.h"
#include "jobs/job_store.h"
#include "server/cluster_options.h"
#include "server/job_serving.h"
#include "server/scheduler.h"
#include "server/worker_pool.h"

namespace bertshard::server {

class Cluster {
 public:
  static absl::StatusOr<std::unique_ptr<Cluster>> Create(const ClusterOptions& options);
  ~Cluster();

  // `request` with its checkpoint resolved under the model root (common/model_root.h), for the
  // coordinator's own reads; INVALID_ARGUMENT when it is outside or not a checkpoint directory.
  absl::StatusOr<v1::PlanRequest> LocalRequest(const v1::PlanRequest& request) const;

  // The response lists the held jobs the worker must unload.
  v1::RegisterWorkerResponse RegisterWorker(const v1::RegisterWorkerRequest& request);
  // NOT_FOUND for a worker this coordinator does not know (it must register again). The response
  // lists the held jobs the worker must unload.
  absl::StatusOr<v1::HeartbeatResponse> Heartbeat(const v1::HeartbeatRequest& request);
  v1::ListWorkersResponse ListWorkers();
  // Per job that has not ended: Infer calls queued or running on it (metrics).
  std::map<std::string, int> InferQueueDepths();
  // Per job that has not ended: its restarts in a row and whether it is degraded; and the groups
  // lost since start (metrics, recovery_metrics.h).
  RecoveryMetrics Recovery();

  // `client`: who submits (Job.submitted_by); RESOURCE_EXHAUSTED when it already has
  // ClusterOptions::max_jobs_per_client jobs that have not ended.
  absl::StatusOr<v1::Job> SubmitJob(const v1::SubmitJobRequest& request, const std::string& client = "");
  absl::StatusOr<v1::Job> GetJob(const std::string& id);
  // One page of the jobs, oldest first (jobs::JobStore::ListPage: INVALID_ARGUMENT for a bad token).
  absl::StatusOr<jobs::JobStore::Page> ListJobs(int page_size, const std::string& page_token = "");
  // Jobs by state (the store's count; states with none absent).
  absl::StatusOr<std::map<v1::JobState, int64_t>> CountJobsByState();
  absl::StatusOr<v1::Job> CancelJob(const std::string& id);
  // Grows or shrinks job `job` (its id or name) to `replicas` replicas (1..max_replicas, else
  // INVALID_ARGUMENT), stored at once: new replicas wait for idle workers and serve when READY; a
  // replica taken away that runs a forward finishes it first, then unloads. FAILED_PRECONDITION
  // for a job that is not READY (or still taking its replicas back after a restart); NOT_FOUND.
  // With bounds (1 <= min_replicas <= max_replicas; replicas 0: the count brought within them), the
  // job is autoscaled from then on (docs/service.md, "Autoscaling"); a count without bounds ends it.
  absl::StatusOr<v1::Job> ScaleJob(const std::string& job, int32_t replicas, int32_t min_replicas = 0,
                                   int32_t max_replicas = 0);
  // A live update of job `request.job_id` (its id or name) to `request.request`, the job's new
  // request whole (scheduler_updates.cc says how): returns at once, Job.update says where it
  // stands (WatchJob with all_replicas follows it to its end). INVALID_ARGUMENT for a shape or
  // checkpoint the planner refuses; FAILED_PRECONDITION for a job that is not READY, runs an
  // update already, or (with `abort`) runs none; NOT_FOUND.
  absl::StatusOr<v1::Job> UpdateJob(v1::UpdateJobRequest request);
  // Calls `emit` with the job's state and load progress whenever they change, until the job is
  // READY (and not recovering; with `all_replicas`, every replica it wants READY too), FAILED or
  // CANCELLED, `emit` returns false, `cancelled` turns true (checked at least every half second),
  // or the deadline passes.
  absl::Status WatchJob(const std::string& id, absl::Time deadline,
                        const std::function<bool(const v1::JobEvent&)>& emit, const std::function<bool()>& cancelled,
                        bool all_replicas = false);
  // Infer and Embed take the job by id or by name (request.job_id may be either).
  // Requests on a job are batched (ClusterOptions::batching): concurrent ones merge into one
  // forward, and forwards run one at a time. A request whose caller went away (`cancelled`) or
  // whose deadline passed while it waited is never sent; once its forward has started on the ranks
  // the forward runs to the end (stopping some ranks mid-forward would desynchronise them), and
  // the caller gets DEADLINE_EXCEEDED / CANCELLED at once.
  // UNAVAILABLE while the job is recovering after a restart (retry), or when no group answers the
  // request's batch before shortly ahead of its deadline (its group lost, and the one placed again
  // not READY in time, or failing too). `caller` names the client and connection for
  // the batcher's turns and shares (BatchQueue::Submit); RESOURCE_EXHAUSTED past a share.
  absl::StatusOr<v1::InferResponse> Infer(const v1::InferRequest& request, absl::Time deadline,
                                          const std::function<bool()>& cancelled = nullptr, const Caller& caller = {});
  // Sentence embeddings from a BertModel job, batched like Infer. FAILED_PRECONDITION for a job
  // whose model has no encoder output.
  absl::StatusOr<v1::EmbedResponse> Embed(const v1::EmbedRequest& request, absl::Time deadline,
                                          const std::function<bool()>& cancelled = nullptr, const Caller& caller = {});
  // Texts ranked against a query by a cross-encoder job (a BertForSequenceClassification with one
  // label), best first, batched like Infer. FAILED_PRECONDITION for any other model.
  absl::StatusOr<v1::RerankResponse> Rerank(const v1::RerankRequest& request, absl::Time deadline,
                                            const std::function<bool()>& cancelled = nullptr,
                                            const Caller& caller = {});

  // Which job a request means (HTTP's `model`, docs/http.md): `job` is a job id, else the name
  // (SubmitJobRequest.name) of a job that has not ended. Empty `job`: `fallback` (--default_job,
  // an id or name) when set, else the only serving job. NOT_FOUND for an id or name no live job
  // has; FAILED_PRECONDITION when none is named and not exactly one job serves (the message
  // lists the serving ones' names or ids).
  absl::StatusOr<std::string> ResolveJob(const std::string& job, const std::string& fallback = "");
  // The jobs that serve now (READY and not recovering), in id order.
  struct ServingJob {
    std::string id;
    std::string name;  // may be empty
    v1::ShardPlan plan;
    std::shared_ptr<const JobAssets> assets;  // never null
  };
  std::vector<ServingJob> ServingJobs();
  // A serving job's tokenizer alone (JobServing::Tokenize, ::Decode): no forward, no batching.
  absl::StatusOr<std::vector<TokenPiece>> Tokenize(const std::string& job_id, absl::string_view text,
                                                   bool add_special_tokens);
  absl::StatusOr<std::string> Decode(const std::string& job_id, const std::vector<int64_t>& ids);

  // The server is draining for shutdown: from now on no worker is declared dead and no job is
  // scheduled. Idempotent.
  void Drain();

 private:
  Cluster(const ClusterOptions& options, std::unique_ptr<WorkerPool> pool);

  // The id of the job `job` names (an id or a name, ResolveJob); `job` itself when none does.
  std::string IdOf(const std::string& job);
  // A READY job's JobServing (job_serving.h), made on first use under the scheduler's lock.
  absl::StatusOr<std::shared_ptr<JobServing>> ServingFor(const std::string& job_id);

  const ClusterOptions options_;
  // Declared in this order so that the scheduler (which uses the pool) goes first.
  const std::unique_ptr<WorkerPool> pool_;
  std::unique_ptr<Scheduler> scheduler_;
};

}  // namespace bertshard::server

#endif  // BERTSHARD_SERVER_CLUSTER_H_
