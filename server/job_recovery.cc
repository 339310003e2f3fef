#include "server/job_recovery.h"

#include <algorithm>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "planner/model_config.h"
#include "planner/planner.h"
#include "server/placement.h"

namespace bertshard::server {

std::string JobRecovery::Describe(int world_size) const {
  std::vector<int> waiting;
  for (int r = 0; r < world_size; ++r) {
    bool back = false;
    for (const RankReport& report : reports) back |= report.shard.rank() == r;
    if (!back) waiting.push_back(r);
  }
  return absl::StrCat(
      "the coordinator restarted; waiting until ", absl::FormatTime(absl::RFC3339_sec, deadline, absl::UTCTimeZone()),
      " for rank", waiting.size() == 1 ? " " : "s ", absl::StrJoin(waiting, ", "), " of ", world_size, " to come back");
}

ReadoptionDecision JobRecovery::Decide(int world_size, absl::Time now, absl::Duration grace) const {
  ReadoptionInput in;
  in.world_size = world_size;
  in.was_loading = was_loading;
  in.previous = previous;
  in.reports = reports;
  in.lost = lost;
  in.grace_over = now >= deadline;
  in.grace = grace;
  return DecideReadoption(in);
}

void JobRecovery::ForgetWorker(const std::string& worker_id) {
  reports.erase(
      std::remove_if(reports.begin(), reports.end(), [&](const RankReport& r) { return r.worker_id == worker_id; }),
      reports.end());
}

absl::StatusOr<LocalCheckpoint> OpenLocalCheckpoint(const common::ModelRoot& root, const v1::PlanRequest& request) {
  LocalCheckpoint local;
  local.request = request;
  if (request.checkpoint().empty()) return local;
  ASSIGN_OR_RETURN(local.dir, common::CheckpointDir::Open(root, request.checkpoint()));
  RETURN_IF_ERROR(planner::ResolveCheckpoint(*local.dir, &local.request));
  // Read once, from the descriptor: the planner must not read config.json again by path.
  local.request.clear_checkpoint();
  return local;
}

absl::StatusOr<v1::PlanRequest> LocalPlanRequest(const common::ModelRoot& root, const v1::PlanRequest& request) {
  ASSIGN_OR_RETURN(LocalCheckpoint local, OpenLocalCheckpoint(root, request));
  return std::move(local.request);
}

std::string StoredRecovery(const v1::Job& job) {
  // The last PENDING entry is the latest placement's wait: a recovery's, or the first placement's.
  for (int i = job.history_size() - 1; i >= 0; --i) {
    const v1::StateChange& change = job.history(i);
    if (change.state() == v1::READY) return "";
    if (change.state() != v1::PENDING) continue;
    constexpr absl::string_view kPrefix = "recovering: lost ";
    const std::string& reason = change.reason();
    if (!absl::StartsWith(reason, kPrefix)) return "";
    // "recovering: lost CAUSE (restart K of at most N)[; what it waited for]": the cause may hold
    // parentheses; the count is the last.
    const size_t count = reason.rfind(" (restart ");
    const size_t end = count == std::string::npos ? std::string::npos : reason.find(')', count);
    if (count < kPrefix.size() || end == std::string::npos) return "";
    return reason.substr(0, end + 1);
  }
  return "";
}

absl::StatusOr<std::vector<RecoveredJob>> RecoverStoredJobs(
    jobs::JobStore& store, const common::ModelRoot& root, absl::Time deadline,
    const std::function<void(const absl::Status&, const std::string&)>& record) {
  // Only the jobs that have not ended (the index on state): the history is no work at start.
  ASSIGN_OR_RETURN(std::vector<v1::Job> jobs, store.ListActive());
  // A job this coordinator cannot take back: FAILED, saying why.
  const auto fail = [&](const v1::Job& job, absl::string_view why, const absl::Status& status) {
    record(store
               .Transition(job.id(), v1::FAILED,
                           absl::StrCat("the coordinator restarted and ", why, ": ", status.message()))
               .status(),
           absl::StrCat("failing job ", job.id()));
  };
  std::vector<RecoveredJob> recovered;
  for (v1::Job& job : jobs) {
    if (TerminalState(job.state())) continue;
    // The plan the workers loaded; jobs stored before plans were (schema 1) are planned again.
    absl::StatusOr<v1::ShardPlan> plan = absl::NotFoundError("");
    auto stored = store.GetPlan(job.id());
    if (stored.ok() && stored->has_value()) {
      plan = **std::move(stored);
    } else {
      absl::StatusOr<v1::PlanRequest> local = LocalPlanRequest(root, job.request());
      plan = local.ok() ? planner::Plan(*local) : absl::StatusOr<v1::ShardPlan>(local.status());
      if (plan.ok()) record(store.SetPlan(job.id(), *plan), absl::StrCat("storing job ", job.id(), "'s new plan"));
    }
    if (!plan.ok()) {
      fail(job, "cannot plan the job", plan.status());
      continue;
    }
    // Empty in jobs stored before backends: gloo, as they ran.
    const absl::StatusOr<std::string> backend = NormaliseBackend(job.backend());
    if (!backend.ok()) {
      fail(job, "cannot place the job", backend.status());
      continue;
    }
    RecoveredJob r;
    r.plan = *std::move(plan);
    r.backend = *backend;
    const absl::StatusOr<std::shared_ptr<const common::CheckpointDir>> dir =
        common::CheckpointDir::Open(root, job.request().checkpoint());
    r.assets = dir.ok() ? LoadJobAssets(r.plan, **dir) : RefusedJobAssets(dir.status());
    if (job.state() == v1::PLANNED) {
      // Nothing was loading yet: place it again. Refused, the job stays PLANNED in the database and
      // is not placed; the next restart tries again (said on stderr).
      // A job placed again after a lost group still recovers from it: the reason keeps saying so
      // (the scheduler resumes the recovery from it: Job.degraded, requests wait for the group).
      const std::string recovering = StoredRecovery(job);
      r.pending_note =
          absl::StrCat(recovering, recovering.empty() ? "" : "; ", "the coordinator restarted before loading");
      auto pending = store.TransitionWithRanks(
          job.id(), v1::PENDING,
          absl::StrCat(r.pending_note, "; ", PlaceRanks(r.backend, r.plan.world_size(), {}).waiting_for), {});
      record(pending.status(), absl::StrCat("putting job ", job.id(), " back to PENDING"));
      if (pending.ok()) job = *std::move(pending);
    } else if (job.state() == v1::LOADING || job.state() == v1::READY) {
      // Each replica that had ranks waits for them on its own (RankAssignment.replica: 0 in jobs
      // stored before replicas, which had one).
      for (const v1::RankAssignment& a : job.ranks()) {
        std::unique_ptr<JobRecovery>& recovery = r.recoveries[a.replica()];
        if (recovery == nullptr) {
          recovery = std::make_unique<JobRecovery>();
          recovery->deadline = deadline;
          recovery->was_loading = job.state() == v1::LOADING;
        }
        recovery->previous.push_back(a);
      }
    }
    r.job = std::move(job);
    recovered.push_back(std::move(r));
  }
  return recovered;
}

HeldShards SortHeldShards(const v1::WorkerInfo& worker, const google::protobuf::RepeatedPtrField<v1::HeldShard>& held,
                          const std::function<HeldJob(const std::string& job_id)>& known,
                          const std::map<std::string, JobRecovery*>& recovering) {
  HeldShards sorted;
  std::string serving_job = worker.job_id();
  int32_t serving_rank = worker.rank();
  for (const v1::HeldShard& h : held) {
    const HeldJob what = known(h.job_id());
    if (what == HeldJob::kStoreSilent) continue;  // says nothing about the job
    if (what == HeldJob::kUnknown) {
      sorted.unload.push_back(h.job_id());  // unknown or ended here
      continue;
    }
    if (serving_job == h.job_id() && serving_rank == h.rank()) continue;  // serving it
    // Placed again on this worker under another rank (a lost group, issue 22), and the report was
    // made before its old shard went: the worker holds one shard per job id, so an Unload now would
    // drop the new one once loaded. Its new load fails on the old shard instead (ALREADY_EXISTS),
    // which loses the group and unloads it.
    if (!worker.job_id().empty() && worker.job_id() == h.job_id()) continue;
    auto waiting = recovering.find(h.job_id());
    if (waiting != recovering.end() && serving_job.empty()) {
      waiting->second->reports.push_back({worker.worker_id(), worker.address(), h});
      serving_job = h.job_id();
      serving_rank = h.rank();
      sorted.taken_back.emplace(serving_job, serving_rank);
      sorted.decide.insert(h.job_id());
      continue;
    }
    sorted.unload.push_back(h.job_id());  // placed elsewhere (or the worker serves another job)
  }
  // Ranks of recovering jobs that this address held before the restart and holds no longer.
  for (const auto& [job_id, recovery] : recovering) {
    for (const v1::RankAssignment& a : recovery->previous) {
      if (a.worker_address() != worker.address()) continue;
      bool holds = false;
      for (const v1::HeldShard& h : held) holds |= h.job_id() == job_id && h.rank() == a.rank();
      if (!holds && recovery->lost.insert(a.rank()).second) sorted.decide.insert(job_id);
    }
  }
  return sorted;
}

}  // namespace bertshard::server
