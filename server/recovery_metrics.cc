#include "server/recovery_metrics.h"

#include <utility>

#include "common/status_macros.h"

namespace bertshard::server {

absl::StatusOr<std::vector<common::MetricsRegistry::CollectorHandle>> RegisterRecoveryMetrics(
    common::MetricsRegistry* registry, std::function<RecoveryMetrics()> read) {
  auto per_job = [read](bool degraded) {
    return [read, degraded]() -> absl::StatusOr<std::vector<common::Sample>> {
      std::vector<common::Sample> samples;
      for (const JobRecoveryState& job : read().jobs) {
        samples.push_back({{job.job_id}, degraded ? (job.degraded ? 1.0 : 0.0) : static_cast<double>(job.restarts)});
      }
      return samples;
    };
  };
  auto lost = [read]() -> absl::StatusOr<std::vector<common::Sample>> {
    return std::vector<common::Sample>{{{}, static_cast<double>(read().groups_lost)}};
  };
  std::vector<common::MetricsRegistry::CollectorHandle> handles;
  ASSIGN_OR_RETURN(auto restarts,
                   registry->AddCollector(common::MetricType::kGauge, "bertshard_coordinator_job_restarts",
                                          "Losses in a row of the job's group (Job.restarts; 0 once it served "
                                          "--restart_reset_after), per job that has not ended.",
                                          {"job"}, per_job(false)));
  handles.push_back(std::move(restarts));
  ASSIGN_OR_RETURN(auto degraded,
                   registry->AddCollector(common::MetricType::kGauge, "bertshard_coordinator_job_degraded",
                                          "1 while the job's group is being placed and loaded again after a lost "
                                          "worker (Job.degraded), else 0; per job that has not ended.",
                                          {"job"}, per_job(true)));
  handles.push_back(std::move(degraded));
  ASSIGN_OR_RETURN(auto groups_lost,
                   registry->AddCollector(common::MetricType::kCounter, "bertshard_coordinator_groups_lost_total",
                                          "Job groups lost (a worker killed, silent, leaving, or failing a forward "
                                          "or load) since the coordinator started.",
                                          {}, lost));
  handles.push_back(std::move(groups_lost));
  return handles;
}

}  // namespace bertshard::server
