// File: server/cluster.h
// -----------------------------------------------------------------------------
// The coordinator's view of the cluster: the pool of worker daemons (registration, heartbeats,
// liveness) and the jobs they serve (plan, rank assignment, loading with progress, inference,
// cancellation, failure). Jobs persist in a JobStore, so a restarted coordinator still lists
// them; jobs that had workers when it stopped are marked FAILED, and workers register again.
//
// Failure model: a worker silent for 1.5 heartbeat intervals is dead (so its jobs fail within
// two intervals of its last heartbeat); a dead worker or any rank
// error fails its job with a cause naming the worker and rank, and the surviving ranks are told
// to unload. Workers' collectives have timeouts, so no rank waits forever.
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
#include "jobs/job_store.h"

namespace bertshard::server {

struct ClusterOptions {
  std::string database_path = ":memory:";
  absl::Duration heartbeat_interval = absl::Seconds(1);
  absl::Duration load_timeout = absl::Minutes(10);
  int collective_timeout_seconds = 60;  // rendezvous and collectives on the workers
};

class Cluster {
 public:
  static absl::StatusOr<std::unique_ptr<Cluster>> Create(const ClusterOptions& options);
  ~Cluster();

  v1::RegisterWorkerResponse RegisterWorker(const v1::RegisterWorkerRequest& request);
  // NOT_FOUND for a worker this coordinator does not know (it must register again).
  absl::Status Heartbeat(const v1::HeartbeatRequest& request);
  v1::ListWorkersResponse ListWorkers();

  absl::StatusOr<v1::Job> SubmitJob(const v1::SubmitJobRequest& request);
  absl::StatusOr<v1::Job> GetJob(const std::string& id);
  absl::StatusOr<std::vector<v1::Job>> ListJobs();
  absl::StatusOr<v1::Job> CancelJob(const std::string& id);
  // Calls `emit` with the job's state and load progress whenever they change, until the job is
  // READY, FAILED or CANCELLED, `emit` returns false, `cancelled` turns true (checked at least
  // every half second), or the deadline passes.
  absl::Status WatchJob(const std::string& id, absl::Time deadline, const std::function<bool(const v1::JobEvent&)>& emit,
                        const std::function<bool()>& cancelled);
  // Requests on a job run one at a time in arrival order. A request whose caller went away
  // (`cancelled`) while it waited is dropped; once its forward has started on the ranks it runs to
  // the end (stopping some ranks mid-forward would desynchronise them).
  absl::StatusOr<v1::InferResponse> Infer(const v1::InferRequest& request, absl::Time deadline,
                                          const std::function<bool()>& cancelled = nullptr);

 private:
  struct Worker;
  struct JobRuntime;
  explicit Cluster(const ClusterOptions& options, std::unique_ptr<jobs::JobStore> store);

  void ScheduleLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void LoadJob(std::string job_id);
  // `job_id` by value: callers pass fields this clears (a worker's job_id).
  void FailJobLocked(std::string job_id, const std::string& cause, v1::JobState state = v1::FAILED)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void MonitorLoop();
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
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_ ABSL_GUARDED_BY(mu_);
  std::thread monitor_;
};

}  // namespace bertshard::server

#endif  // BERTSHARD_SERVER_CLUSTER_H_
