// Cluster, part two: a restarted coordinator takes back the jobs its workers still hold (see
// cluster.h for the rules as users see them, readoption.h for the decision itself).
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "planner/planner.h"
#include "server/cluster.h"
#include "server/cluster_internal.h"
#include "server/placement.h"
#include "server/readoption.h"

namespace bertshard::server {

absl::Status Cluster::RecoverJobsLocked() {
  ASSIGN_OR_RETURN(std::vector<v1::Job> jobs, store_->List());
  const absl::Time deadline = absl::Now() + options_.readopt_grace;
  // A job this coordinator cannot take back: FAILED, saying why.
  const auto fail = [this](const v1::Job& job, absl::string_view why, const absl::Status& status) {
    RecordLocked(store_
                     ->Transition(job.id(), v1::FAILED,
                                  absl::StrCat("the coordinator restarted and ", why, ": ", status.message()))
                     .status(),
                 absl::StrCat("failing job ", job.id()));
  };
  for (const v1::Job& job : jobs) {
    if (TerminalState(job.state())) continue;
    // The plan the workers loaded; jobs stored before plans were (schema 1) are planned again.
    absl::StatusOr<v1::ShardPlan> plan = absl::NotFoundError("");
    auto stored = store_->GetPlan(job.id());
    if (stored.ok() && stored->has_value()) {
      plan = **std::move(stored);
    } else {
      absl::StatusOr<v1::PlanRequest> local = LocalRequest(job.request());
      plan = local.ok() ? planner::Plan(*local) : absl::StatusOr<v1::ShardPlan>(local.status());
      if (plan.ok())
        RecordLocked(store_->SetPlan(job.id(), *plan), absl::StrCat("storing job ", job.id(), "'s new plan"));
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
    auto runtime = std::make_shared<JobRuntime>();
    runtime->plan = *std::move(plan);
    runtime->checkpoint = job.request().checkpoint();
    runtime->backend = *backend;
    if (job.state() == v1::PLANNED) {
      // Nothing was loading yet: place it again.
      // Refused, the job stays PLANNED in the database and is not placed; the next restart
      // tries again (said on stderr).
      RecordLocked(store_->SetRanks(job.id(), {}).status(), absl::StrCat("clearing job ", job.id(), "'s ranks"));
      runtime->pending_note = "the coordinator restarted before loading";
      RecordLocked(
          store_
              ->Transition(job.id(), v1::PENDING,
                           absl::StrCat(runtime->pending_note, "; ",
                                        PlaceRanks(runtime->backend, runtime->plan.world_size(), {}).waiting_for))
              .status(),
          absl::StrCat("putting job ", job.id(), " back to PENDING"));
    } else if (job.state() == v1::LOADING || job.state() == v1::READY) {
      runtime->recovery = std::make_unique<Recovery>();
      runtime->recovery->deadline = deadline;
      runtime->recovery->was_loading = job.state() == v1::LOADING;
      runtime->recovery->previous.assign(job.ranks().begin(), job.ranks().end());
      runtime->rank_workers.assign(static_cast<size_t>(runtime->plan.world_size()), "");
    }
    runtimes_[job.id()] = runtime;
  }
  return absl::OkStatus();
}

void Cluster::TakeHeldShardsLocked(Worker* worker, const google::protobuf::RepeatedPtrField<v1::HeldShard>& held,
                                   google::protobuf::RepeatedPtrField<std::string>* unload) {
  std::set<std::string> decide;
  for (const v1::HeldShard& h : held) {
    auto job = store_->Get(h.job_id());
    // The database failing to answer says nothing about the job: decide at the next heartbeat.
    if (!job.ok() && job.status().code() != absl::StatusCode::kNotFound) continue;
    auto runtime = runtimes_.find(h.job_id());
    if (!job.ok() || TerminalState(job->state()) || runtime == runtimes_.end()) {
      *unload->Add() = h.job_id();  // unknown or ended here
      continue;
    }
    if (worker->info.job_id() == h.job_id() && worker->info.rank() == h.rank()) continue;  // serving it
    if (runtime->second->recovery != nullptr && worker->info.job_id().empty()) {
      runtime->second->recovery->reports.push_back({worker->info.worker_id(), worker->info.address(), h});
      worker->info.set_job_id(h.job_id());
      worker->info.set_rank(h.rank());
      decide.insert(h.job_id());
      continue;
    }
    *unload->Add() = h.job_id();  // placed elsewhere (or the worker serves another job)
  }
  // Ranks of recovering jobs that this address held before the restart and holds no longer.
  for (auto& [job_id, runtime] : runtimes_) {
    if (runtime->recovery == nullptr) continue;
    for (const v1::RankAssignment& a : runtime->recovery->previous) {
      if (a.worker_address() != worker->info.address()) continue;
      bool holds = false;
      for (const v1::HeldShard& h : held) holds |= h.job_id() == job_id && h.rank() == a.rank();
      if (!holds && runtime->recovery->lost.insert(a.rank()).second) decide.insert(job_id);
    }
  }
  for (const std::string& job_id : decide) DecideRecoveryLocked(job_id);
}

void Cluster::DecideRecoveryLocked(const std::string& job_id) {
  auto it = runtimes_.find(job_id);
  if (it == runtimes_.end() || it->second->recovery == nullptr) return;
  JobRuntime& runtime = *it->second;
  const Recovery& recovery = *runtime.recovery;
  ReadoptionInput in;
  in.world_size = runtime.plan.world_size();
  in.was_loading = recovery.was_loading;
  in.previous = recovery.previous;
  in.reports = recovery.reports;
  in.lost = recovery.lost;
  in.grace_over = absl::Now() >= recovery.deadline;
  in.grace = options_.readopt_grace;
  const ReadoptionDecision decision = DecideReadoption(in);
  switch (decision.outcome) {
    case ReadoptionDecision::Outcome::kWait:
      changed_.SignalAll();  // Job.recovering changed
      return;
    case ReadoptionDecision::Outcome::kFail:
      runtime.recovery.reset();
      FailJobLocked(job_id, decision.cause);  // the ranks that came back unload
      return;
    case ReadoptionDecision::Outcome::kAdopt:
      break;
    default:
      return;
  }
  runtime.recovery.reset();
  runtime.rank_workers = decision.rank_workers;
  runtime.next_sequence = decision.next_sequence;
  runtime.progress.clear();
  std::vector<v1::RankAssignment> ranks;
  for (size_t r = 0; r < runtime.rank_workers.size(); ++r) {
    const Worker& w = *workers_.at(runtime.rank_workers[r]);
    v1::RankAssignment a;
    a.set_rank(static_cast<int32_t>(r));
    a.set_worker_id(w.info.worker_id());
    a.set_worker_address(w.info.address());
    ranks.push_back(a);
    v1::RankProgress p;
    p.set_rank(static_cast<int32_t>(r));
    p.set_worker_id(w.info.worker_id());
    p.mutable_progress()->set_phase(v1::LoadProgress::READY);
    runtime.progress.push_back(p);
  }
  RecordLocked(store_->SetRanks(job_id, ranks).status(), absl::StrCat("recording job ", job_id, "'s ranks"));
  auto job = store_->Get(job_id);
  if (job.ok() && job->state() == v1::LOADING) {
    RecordLocked(
        store_
            ->Transition(job_id, v1::READY,
                         absl::StrCat("all ", ranks.size(), " ranks had loaded when the coordinator restarted"))
            .status(),
        absl::StrCat("readying job ", job_id));
  }
  job = store_->Get(job_id);
  runtime.serving = job.ok() && job->state() == v1::READY;
  changed_.SignalAll();
}

absl::StatusOr<v1::Job> Cluster::GetJobLocked(const std::string& id) {
  ASSIGN_OR_RETURN(v1::Job job, store_->Get(id));
  auto runtime = runtimes_.find(id);
  if (runtime == runtimes_.end() || runtime->second->recovery == nullptr) return job;
  const Recovery& recovery = *runtime->second->recovery;
  std::vector<int> waiting;
  for (int r = 0; r < runtime->second->plan.world_size(); ++r) {
    bool back = false;
    for (const RankReport& report : recovery.reports) back |= report.shard.rank() == r;
    if (!back) waiting.push_back(r);
  }
  job.set_recovering(absl::StrCat("the coordinator restarted; waiting until ",
                                  absl::FormatTime(absl::RFC3339_sec, recovery.deadline, absl::UTCTimeZone()),
                                  " for rank", waiting.size() == 1 ? " " : "s ", absl::StrJoin(waiting, ", "), " of ",
                                  runtime->second->plan.world_size(), " to come back"));
  return job;
}

}  // namespace bertshard::server
