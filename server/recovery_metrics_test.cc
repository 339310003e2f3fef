#include "server/recovery_metrics.h"

#include <string>

#include "absl/strings/match.h"
#include "absl/synchronization/mutex.h"
#include "gtest/gtest.h"

namespace bertshard::server {
namespace {

// What the scheduler says, set by the test; read at each Render as a scrape would.
class FakeRecovery {
 public:
  void Set(RecoveryMetrics metrics) {
    absl::MutexLock lock(&mu_);
    metrics_ = std::move(metrics);
  }
  RecoveryMetrics Read() {
    absl::MutexLock lock(&mu_);
    return metrics_;
  }

 private:
  absl::Mutex mu_;
  RecoveryMetrics metrics_ ABSL_GUARDED_BY(mu_);
};

// Each job's restarts and degraded (0/1), and the groups lost; a job's series go once it is no
// longer listed (it ended), and the collectors go with their handles.
TEST(RecoveryMetrics, ExportsEachLiveJobsRecoveryAndTheGroupsLost) {
  common::MetricsRegistry registry;
  FakeRecovery recovery;
  recovery.Set({{{"job-1", 2, true}, {"job-2", 0, false}}, 3});
  {
    auto handles = RegisterRecoveryMetrics(&registry, [&recovery] { return recovery.Read(); });
    ASSERT_TRUE(handles.ok()) << handles.status();
    std::string text = registry.Render();
    EXPECT_TRUE(absl::StrContains(text, "# TYPE bertshard_coordinator_job_restarts gauge\n")) << text;
    EXPECT_TRUE(absl::StrContains(text, "bertshard_coordinator_job_restarts{job=\"job-1\"} 2\n")) << text;
    EXPECT_TRUE(absl::StrContains(text, "bertshard_coordinator_job_restarts{job=\"job-2\"} 0\n")) << text;
    EXPECT_TRUE(absl::StrContains(text, "# TYPE bertshard_coordinator_job_degraded gauge\n")) << text;
    EXPECT_TRUE(absl::StrContains(text, "bertshard_coordinator_job_degraded{job=\"job-1\"} 1\n")) << text;
    EXPECT_TRUE(absl::StrContains(text, "bertshard_coordinator_job_degraded{job=\"job-2\"} 0\n")) << text;
    EXPECT_TRUE(absl::StrContains(text, "# TYPE bertshard_coordinator_groups_lost_total counter\n")) << text;
    EXPECT_TRUE(absl::StrContains(text, "bertshard_coordinator_groups_lost_total 3\n")) << text;

    recovery.Set({{{"job-2", 1, true}}, 4});  // job-1 ended; job-2 lost its group
    text = registry.Render();
    EXPECT_FALSE(absl::StrContains(text, "job-1")) << text;
    EXPECT_TRUE(absl::StrContains(text, "bertshard_coordinator_job_degraded{job=\"job-2\"} 1\n")) << text;
    EXPECT_TRUE(absl::StrContains(text, "bertshard_coordinator_groups_lost_total 4\n")) << text;
    // Registered twice: the names are taken.
    EXPECT_EQ(RegisterRecoveryMetrics(&registry, [] { return RecoveryMetrics(); }).status().code(),
              absl::StatusCode::kAlreadyExists);
  }
  EXPECT_FALSE(absl::StrContains(registry.Render(), "bertshard_coordinator_job_restarts"));
}

// Each job's replicas wanted and ready, its shape's version and whether it is being updated, each replica's forwards,
// and the workers wanted (what a worker autoscaler aims at).
TEST(RecoveryMetrics, ExportsReplicasAndTheWorkersTheyNeed) {
  common::MetricsRegistry registry;
  FakeRecovery recovery;
  RecoveryMetrics metrics;
  metrics.jobs.push_back({"job-1", 1, true, 3, 2, 4, true});
  metrics.replicas = {{"job-1", 0, 1, 40}, {"job-1", 1, 0, 38}, {"job-1", 2, 0, 0}};
  metrics.workers_wanted = 12;
  recovery.Set(metrics);
  auto handles = RegisterRecoveryMetrics(&registry, [&recovery] { return recovery.Read(); });
  ASSERT_TRUE(handles.ok()) << handles.status();
  const std::string text = registry.Render();
  for (const char* line : {
           "# TYPE bertshard_coordinator_job_replicas gauge\n",
           "bertshard_coordinator_job_replicas{job=\"job-1\"} 3\n",
           "bertshard_coordinator_job_replicas_ready{job=\"job-1\"} 2\n",
           "bertshard_coordinator_job_version{job=\"job-1\"} 4\n",
           "bertshard_coordinator_job_updating{job=\"job-1\"} 1\n",
           "bertshard_coordinator_replica_forwards_in_flight{job=\"job-1\",replica=\"0\"} 1\n",
           "bertshard_coordinator_replica_forwards_in_flight{job=\"job-1\",replica=\"2\"} 0\n",
           "# TYPE bertshard_coordinator_replica_forwards_total counter\n",
           "bertshard_coordinator_replica_forwards_total{job=\"job-1\",replica=\"1\"} 38\n",
           "bertshard_coordinator_workers_wanted 12\n",
       }) {
    EXPECT_TRUE(absl::StrContains(text, line)) << line << " not in:\n" << text;
  }
}

}  // namespace
}  // namespace bertshard::server
