#include "server/recovery_metrics.h"

#include <functional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace bertshard::server {

absl::StatusOr<std::vector<common::MetricsRegistry::CollectorHandle>> RegisterRecoveryMetrics(
    common::MetricsRegistry* registry, std::function<RecoveryMetrics()> read) {
  using Field = std::function<double(const JobRecoveryState&)>;
  auto per_job = [read](Field field) {
    return [read, field]() -> absl::StatusOr<std::vector<common::Sample>> {
      std::vector<common::Sample> samples;
      for (const JobRecoveryState& job : read().jobs) samples.push_back({{job.job_id}, field(job)});
      return samples;
    };
  };
  auto lost = [read]() -> absl::StatusOr<std::vector<common::Sample>> {
    return std::vector<common::Sample>{{{}, static_cast<double>(read().groups_lost)}};
  };
  std::vector<common::MetricsRegistry::CollectorHandle> handles;
  ASSIGN_OR_RETURN(auto restarts,
                   registry->AddCollector(
                       common::MetricType::kGauge, "bertshard_coordinator_job_restarts",
                       "Losses in a row of the job's replica lost most (Job.restarts; 0 once it "
                       "served --restart_reset_after), per job that has not ended.",
                       {"job"}, per_job([](const JobRecoveryState& j) { return static_cast<double>(j.restarts); })));
  handles.push_back(std::move(restarts));
  ASSIGN_OR_RETURN(
      auto degraded,
      registry->AddCollector(common::MetricType::kGauge, "bertshard_coordinator_job_degraded",
                             "1 while a replica of the job is being placed and loaded again after a "
                             "lost worker (Job.degraded), else 0; per job that has not ended.",
                             {"job"}, per_job([](const JobRecoveryState& j) { return j.degraded ? 1.0 : 0.0; })));
  handles.push_back(std::move(degraded));
  ASSIGN_OR_RETURN(auto groups_lost,
                   registry->AddCollector(common::MetricType::kCounter, "bertshard_coordinator_groups_lost_total",
                                          "Job groups lost (a worker killed, silent, leaving, or failing a forward "
                                          "or load) since the coordinator started.",
                                          {}, lost));
  handles.push_back(std::move(groups_lost));
  ASSIGN_OR_RETURN(auto replicas,
                   registry->AddCollector(common::MetricType::kGauge, "bertshard_coordinator_job_replicas",
                                          "Replicas the job runs (Job.replicas), per job that has not ended.", {"job"},
                                          per_job([](const JobRecoveryState& j) { return j.replicas; })));
  handles.push_back(std::move(replicas));
  ASSIGN_OR_RETURN(auto ready,
                   registry->AddCollector(common::MetricType::kGauge, "bertshard_coordinator_job_replicas_ready",
                                          "Replicas of the job that serve now, per job that has not ended.", {"job"},
                                          per_job([](const JobRecoveryState& j) { return j.replicas_ready; })));
  handles.push_back(std::move(ready));
  ASSIGN_OR_RETURN(auto version,
                   registry->AddCollector(common::MetricType::kGauge, "bertshard_coordinator_job_version",
                                          "The shape the job serves (Job.version: 0 as submitted, one more per live "
                                          "update that switched over), per job that has not ended.",
                                          {"job"}, per_job([](const JobRecoveryState& j) { return j.version; })));
  handles.push_back(std::move(version));
  ASSIGN_OR_RETURN(auto updating, registry->AddCollector(
                                      common::MetricType::kGauge, "bertshard_coordinator_job_updating",
                                      "1 while a live update of the job runs or its old shape drains, per job "
                                      "that has not ended.",
                                      {"job"}, per_job([](const JobRecoveryState& j) { return j.updating ? 1 : 0; })));
  handles.push_back(std::move(updating));
  using ReplicaField = std::function<double(const ReplicaState&)>;
  auto per_replica = [read](ReplicaField field) {
    return [read, field]() -> absl::StatusOr<std::vector<common::Sample>> {
      std::vector<common::Sample> samples;
      for (const ReplicaState& r : read().replicas) {
        samples.push_back({{r.job_id, absl::StrCat(r.replica)}, field(r)});
      }
      return samples;
    };
  };
  ASSIGN_OR_RETURN(auto in_flight,
                   registry->AddCollector(
                       common::MetricType::kGauge, "bertshard_coordinator_replica_forwards_in_flight",
                       "Forwards running on the replica now (0 or 1: one at a time), per replica "
                       "of each job that has not ended.",
                       {"job", "replica"}, per_replica([](const ReplicaState& r) { return r.forwards_in_flight; })));
  handles.push_back(std::move(in_flight));
  ASSIGN_OR_RETURN(
      auto forwards,
      registry->AddCollector(common::MetricType::kCounter, "bertshard_coordinator_replica_forwards_total",
                             "Forwards the replica ran since it was last placed (a new placement starts "
                             "again at 0, as a counter reset), per replica of each job that has not ended.",
                             {"job", "replica"},
                             per_replica([](const ReplicaState& r) { return static_cast<double>(r.forwards); })));
  handles.push_back(std::move(forwards));
  auto wanted = [read]() -> absl::StatusOr<std::vector<common::Sample>> {
    return std::vector<common::Sample>{{{}, static_cast<double>(read().workers_wanted)}};
  };
  ASSIGN_OR_RETURN(auto workers_wanted,
                   registry->AddCollector(common::MetricType::kGauge, "bertshard_coordinator_workers_wanted",
                                          "Workers that every job's replicas need: those placed, and the world size "
                                          "of each replica waiting for workers (a worker autoscaler's target).",
                                          {}, wanted));
  handles.push_back(std::move(workers_wanted));
  return handles;
}

}  // namespace bertshard::server
