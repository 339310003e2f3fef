// File: server/recovery_metrics.h
// -----------------------------------------------------------------------------
// The coordinator's recovery metrics on /metrics (issue 22): per job that has not ended, how many
// times in a row its group was lost (`bertshard_coordinator_job_restarts`) and whether it is being
// placed and loaded again after a loss (`bertshard_coordinator_job_degraded`, 0 or 1); and how many
// groups this coordinator has lost since it started (`bertshard_coordinator_groups_lost_total`), so
// that operators can alert on a job that recovers, or on one that keeps losing its workers; and
// its live updates (`bertshard_coordinator_job_version`, `_job_updating`). Read
// from the scheduler at each scrape (nothing to keep in step); a job's series go when it ends.
//
// Example:
//   ASSIGN_OR_RETURN(auto handles, RegisterRecoveryMetrics(&registry, [&] { return cluster->Recovery(); }));
//   // keep `handles` while the cluster lives: they unregister the collectors
//
// Failure model: errors are the registry's (a name taken: ALREADY_EXISTS).
//
// Thread safety: the collectors call `read` from the scrape's thread; `read` must be thread-safe.
#ifndef BERTSHARD_SERVER_RECOVERY_METRICS_H_
#define BERTSHARD_SERVER_RECOVERY_METRICS_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/metrics.h"

namespace bertshard::server {

// One job that has not ended, as its recovery stands.
struct JobRecoveryState {
  std::string job_id;
  int restarts = 0;        // Job.restarts: losses in a row of its group
  bool degraded = false;   // Job.degraded set: a replica is being placed and loaded again
  int replicas = 1;        // Job.replicas: wanted
  int replicas_ready = 0;  // serving now, of its shape
  int version = 0;         // Job.version: the shape it serves
  bool updating = false;   // a live update runs (Job.update set) or the old shape still drains
};

// One replica of a job that has not ended.
struct ReplicaState {
  std::string job_id;
  int32_t replica = 0;
  int forwards_in_flight = 0;  // 0 or 1
  int64_t forwards = 0;        // run since it was placed
};

struct RecoveryMetrics {
  std::vector<JobRecoveryState> jobs;  // every job that has not ended
  int64_t groups_lost = 0;             // groups lost since the coordinator started (give-ups included)
  // The workers every job's replicas need: those placed (or being taken back) and the world size
  // of each replica waiting for workers; what a worker autoscaler aims the pool at.
  int64_t workers_wanted = 0;
  std::vector<ReplicaState> replicas;  // every replica of the jobs that have not ended
};

absl::StatusOr<std::vector<common::MetricsRegistry::CollectorHandle>> RegisterRecoveryMetrics(
    common::MetricsRegistry* registry, std::function<RecoveryMetrics()> read);

}  // namespace bertshard::server

#endif  // BERTSHARD_SERVER_RECOVERY_METRICS_H_
