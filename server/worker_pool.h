// File: server/worker_pool.h
// -----------------------------------------------------------------------------
// The coordinator's pool of worker daemons: who registered from where with which device, the
// channel (stub) to each, when each last heartbeated, and which job and rank each serves. It
// knows nothing of jobs beyond those ids: what a worker's arrival, departure or silence means for
// its job is the scheduler's to decide, and the pool says what happened through return values
// (the entry a worker replaced, the workers that went silent, the info of one that leaves).
//
// Example:
//   WorkerPool pool(options, "18c2f1a");
//   v1::WorkerInfo added = pool.Add(request);             // id "worker-1-18c2f1a"
//   pool.Assign(added.worker_id(), "job-1", 0);
//   for (const WorkerDeparture& d : pool.TakeSilent(absl::Now())) FailTheJobOf(d);
//
// Failure model: registration always succeeds (a worker is reached lazily, through its channel);
// a heartbeat from an id the pool does not know is NOT_FOUND (the worker registers again). A
// worker silent for more than ClusterOptions::missed_heartbeats intervals is taken out of the
// placement pool by TakeSilent (unhealthy), and back in by its next heartbeat (MarkHealthy).
//
// Thread safety: thread-safe; one lock of its own, never held while calling out of the pool. The
// scheduler calls the pool under its own lock (scheduler before pool, never the other way), so
// that a decision about a worker and the job it serves is one step for the rest of the cluster.
#ifndef BERTSHARD_SERVER_WORKER_POOL_H_
#define BERTSHARD_SERVER_WORKER_POOL_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "bertshard/v1/coordinator.pb.h"
#include "bertshard/v1/worker.grpc.pb.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "server/cluster_options.h"
#include "server/placement.h"

namespace bertshard::server {

// The channel to one worker: its Worker service and its gRPC health service (same channel).
struct WorkerStub {
  std::string worker_id;
  std::string address;
  std::shared_ptr<v1::Worker::Stub> stub;
  std::shared_ptr<grpc::health::v1::Health::Stub> health;
};

// A worker that went silent, as it was then (its job and rank, for the job's failure cause).
struct WorkerDeparture {
  v1::WorkerInfo info;
  absl::Duration silent;  // since its last heartbeat
};

class WorkerPool {
 public:
  // `incarnation` goes into every id this pool makes, so that a worker heartbeating with an id from
  // before a coordinator restart is told NOT_FOUND, never matched to someone else's entry.
  WorkerPool(const ClusterOptions& options, std::string incarnation);
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  // Takes the entry registered from `address` out of the pool and returns it as it was (a worker
  // registering again lost touch with us); nullopt when there is none.
  std::optional<v1::WorkerInfo> RemoveByAddress(const std::string& address) ABSL_LOCKS_EXCLUDED(mu_);
  // Adds a healthy idle worker with a channel to its address: id `request.previous_worker_id()`
  // when that is free, else a new one. Returns its info.
  v1::WorkerInfo Add(const v1::RegisterWorkerRequest& request) ABSL_LOCKS_EXCLUDED(mu_);
  // A heartbeat: records its time and free memory and returns the worker's info as it was before
  // (healthy() false: it is back after a silence, see MarkHealthy). NOT_FOUND for an unknown id.
  absl::StatusOr<v1::WorkerInfo> Beat(const std::string& worker_id, int64_t free_memory_bytes) ABSL_LOCKS_EXCLUDED(mu_);
  std::optional<v1::WorkerInfo> Find(const std::string& worker_id) const ABSL_LOCKS_EXCLUDED(mu_);
  // Out of the placement pool (leaving, or silent); returns its info as it was, nullopt if unknown.
  std::optional<v1::WorkerInfo> MarkUnhealthy(const std::string& worker_id) ABSL_LOCKS_EXCLUDED(mu_);
  void MarkHealthy(const std::string& worker_id) ABSL_LOCKS_EXCLUDED(mu_);
  // Marks the healthy workers silent for more than missed_heartbeats intervals at `now` unhealthy,
  // all before returning them, so that nothing placed in answer to one takes another.
  std::vector<WorkerDeparture> TakeSilent(absl::Time now) ABSL_LOCKS_EXCLUDED(mu_);

  // The worker serves `job_id` as `rank`; false for an unknown id.
  bool Assign(const std::string& worker_id, const std::string& job_id, int32_t rank) ABSL_LOCKS_EXCLUDED(mu_);
  // The worker serves no job.
  void Unassign(const std::string& worker_id) ABSL_LOCKS_EXCLUDED(mu_);
  // Every worker serving `job_id` serves none now; returns the channels of the healthy ones
  // (which still hold a shard to drop).
  std::vector<WorkerStub> Release(const std::string& job_id) ABSL_LOCKS_EXCLUDED(mu_);

  // While a worker drops the shard of a job it no longer serves, it is kept out of placement: a job
  // placed again on that worker would otherwise have its new shard's load race the old one's
  // unload (ALREADY_EXISTS, or the new shard dropped). Cleared with false, or by a new entry for
  // its address. Unknown ids are ignored. Returns whether it was unloading before.
  bool SetUnloading(const std::string& worker_id, bool unloading) ABSL_LOCKS_EXCLUDED(mu_);
  // An Unload call the coordinator makes to the worker (its job's group was lost): the worker is
  // kept out of placement from Begin until End, whatever SetUnloading says meanwhile (a heartbeat
  // that does not list the shard is no proof it is gone: the call may not have reached it yet).
  // End with `unloaded` false (the call failed) leaves it SetUnloading(true), for a heartbeat to
  // clear. Unknown ids are ignored; End returns whether the worker may be placed now.
  void BeginUnloadCall(const std::string& worker_id) ABSL_LOCKS_EXCLUDED(mu_);
  bool EndUnloadCall(const std::string& worker_id, bool unloaded) ABSL_LOCKS_EXCLUDED(mu_);

  // The healthy workers without a job and not unloading (SetUnloading, BeginUnloadCall), in id order, with their
  // devices (for PlaceRanks).
  std::vector<IdleWorker> Idle() const ABSL_LOCKS_EXCLUDED(mu_);
  // The channels of `worker_ids`, in that order; NOT_FOUND naming the first that left the pool.
  absl::StatusOr<std::vector<WorkerStub>> Stubs(const std::vector<std::string>& worker_ids) const
      ABSL_LOCKS_EXCLUDED(mu_);
  v1::ListWorkersResponse List() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Worker {
    v1::WorkerInfo info;
    WorkerStub channel;
    absl::Time last_heartbeat;
    bool unloading = false;  // SetUnloading
    int unload_calls = 0;    // BeginUnloadCall .. EndUnloadCall
  };

  const ClusterOptions options_;
  const std::string incarnation_;
  mutable absl::Mutex mu_;
  std::map<std::string, Worker> workers_ ABSL_GUARDED_BY(mu_);
  int64_t next_worker_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace bertshard::server

#endif  // BERTSHARD_SERVER_WORKER_POOL_H_
