// The Scheduler's side that workers drive (scheduler.h): what a worker's arrival, heartbeat or
// loss means for its job: the jobs taken back after a restart and their re-adoption, ranks kept by
// a worker that registers again, and a lost worker losing its job's group (placed again after).
// One class split over two files to keep each readable; the lock and its rules are scheduler.h's.
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "server/scheduler.h"
#include "server/shard_loading.h"

namespace bertshard::server {

absl::Status Scheduler::RecoverJobsLocked() {
  std::vector<std::pair<std::string, std::string>> given_up;  // job id, failure cause
  ASSIGN_OR_RETURN(std::vector<RecoveredJob> jobs,
                   RecoverStoredJobs(*store_, options_.model_root, absl::Now() + options_.readopt_grace,
                                     [this](const absl::Status& status, const std::string& what) {
                                       mu_.AssertHeld();
                                       RecordLocked(status, what);
                                     }));
  for (RecoveredJob& job : jobs) {
    auto runtime = std::make_shared<JobRuntime>(options_.restarts);
    runtime->plan = std::move(job.plan);
    runtime->checkpoint = job.job.request().checkpoint();
    runtime->assets = std::move(job.assets);
    runtime->backend = std::move(job.backend);
    runtime->submitted_by = job.job.submitted_by();
    runtime->name = job.job.name();
    runtime->pending_note = std::move(job.pending_note);
    if (job.job.state() == v1::PENDING) {
      if (std::optional<std::string> cause = ResumeRecoveryLocked(job.job.pending_reason(), *runtime)) {
        given_up.emplace_back(job.job.id(), *std::move(cause));
      }
    }
    runtime->recovery = std::move(job.recovery);
    if (runtime->recovery != nullptr)
      runtime->group.rank_workers.assign(static_cast<size_t>(runtime->plan.world_size()), "");
    if (job.job.state() == v1::PENDING) pending_.push_back({job.job.id(), job.job.pending_reason()});
    runtimes_[job.job.id()] = std::move(runtime);
  }
  // Recovering under a --max_restarts that no longer allows it (0): ended, as a loss would be.
  for (const auto& [job_id, cause] : given_up) FailJobLocked(job_id, cause);
  return absl::OkStatus();
}

std::optional<std::string> Scheduler::ResumeRecoveryLocked(const std::string& stored_reason, JobRuntime& runtime) {
  // The reason LoseGroupLocked stored: "recovering: lost CAUSE (restart K of at most N)", then
  // "; " and what it waited for. The cause may hold parentheses; the restart count is the last.
  constexpr absl::string_view kPrefix = "recovering: lost ";
  if (!absl::StartsWith(stored_reason, kPrefix)) return std::nullopt;
  const size_t count = stored_reason.rfind(" (restart ");
  if (count == std::string::npos || count < kPrefix.size()) return std::nullopt;
  const std::string cause = stored_reason.substr(kPrefix.size(), count - kPrefix.size());
  // The count starts again here.
  const GroupRestarts::Decision decision = runtime.group.restarts.Lost(cause, absl::Now());
  if (decision.give_up) return decision.cause;
  runtime.pending_note = absl::StrCat("recovering: ", runtime.group.restarts.Describe());
  return std::nullopt;
}

v1::RegisterWorkerResponse Scheduler::RegisterWorker(const v1::RegisterWorkerRequest& request) {
  absl::MutexLock lock(&mu_);
  // A worker registering again from the same address lost touch with us. It keeps a job it
  // still holds; any other job that relied on it loses its group (and is placed again).
  std::optional<std::pair<std::string, int32_t>> kept;
  if (std::optional<v1::WorkerInfo> old = pool_->RemoveByAddress(request.address())) {
    kept = SettleReplacedLocked(*old, request);
  }
  v1::WorkerInfo worker = pool_->Add(request);
  if (kept.has_value()) MoveRankLocked(kept->first, kept->second, &worker);
  v1::RegisterWorkerResponse response;
  TakeHeldShardsLocked(worker, request.held(), response.mutable_unload_job_ids());
  MarkUnloadingLocked(worker.worker_id(), response.unload_job_ids());
  ScheduleLocked();
  response.set_worker_id(worker.worker_id());
  response.set_heartbeat_interval_ms(static_cast<int32_t>(absl::ToInt64Milliseconds(options_.heartbeat_interval)));
  return response;
}

std::optional<std::pair<std::string, int32_t>> Scheduler::SettleReplacedLocked(
    const v1::WorkerInfo& old, const v1::RegisterWorkerRequest& request) {
  auto runtime = runtimes_.find(old.job_id());
  if (runtime != runtimes_.end() && runtime->second->recovery != nullptr) {
    runtime->second->recovery->ForgetWorker(old.worker_id());  // they count again with this registration
    return std::nullopt;
  }
  if (old.job_id().empty()) return std::nullopt;
  const v1::HeldShard* shard = nullptr;
  for (const v1::HeldShard& h : request.held()) {
    if (h.job_id() == old.job_id() && h.rank() == old.rank()) shard = &h;
  }
  if (runtime == runtimes_.end() || runtime->second->ended) return std::nullopt;
  if (shard != nullptr && shard->broken().empty()) return std::make_pair(old.job_id(), old.rank());
  LoseGroupLocked(
      old.job_id(), runtime->second->group.generation,
      absl::StrCat("worker ", old.worker_id(), " (rank ", old.rank(), ") at ", request.address(), " registered again ",
                   shard == nullptr ? "without its shard" : absl::StrCat("with its shard broken: ", shard->broken())));
  return std::nullopt;
}

void Scheduler::MoveRankLocked(const std::string& job_id, int32_t rank, v1::WorkerInfo* worker) {
  pool_->Assign(worker->worker_id(), job_id, rank);
  worker->set_job_id(job_id);
  worker->set_rank(rank);
  JobRuntime& runtime = *runtimes_.at(job_id);
  const size_t r = static_cast<size_t>(rank);
  if (r < runtime.group.rank_workers.size()) runtime.group.rank_workers[r] = worker->worker_id();
  if (r < runtime.group.progress.size()) runtime.group.progress[r].set_worker_id(worker->worker_id());
  auto job = store_->Get(job_id);
  if (job.ok() && rank < job->ranks_size()) {
    std::vector<v1::RankAssignment> ranks(job->ranks().begin(), job->ranks().end());
    ranks[r].set_worker_id(worker->worker_id());
    ranks[r].set_worker_address(worker->address());
    RecordLocked(store_->SetRanks(job_id, ranks).status(),
                 absl::StrCat("moving job ", job_id, "'s rank ", r, " to worker ", worker->worker_id()));
  }
}

absl::StatusOr<v1::HeartbeatResponse> Scheduler::Heartbeat(const v1::HeartbeatRequest& request) {
  absl::MutexLock lock(&mu_);
  v1::HeartbeatResponse response;
  if (request.leaving()) {
    // Out of the pool now: a job scheduled onto it in the heartbeats' grace period would fail.
    std::optional<v1::WorkerInfo> worker = pool_->MarkUnhealthy(request.worker_id());
    if (!worker.has_value()) {
      return absl::NotFoundError(absl::StrCat("unknown worker ", request.worker_id(), "; register again"));
    }
    LoseWorkersGroupLocked(*worker, "is shutting down");
    ScheduleLocked();  // the pool is smaller: what waiting jobs say they wait for changes
    return response;
  }
  ASSIGN_OR_RETURN(const v1::WorkerInfo before, pool_->Beat(request.worker_id(), request.free_memory_bytes()));
  TakeHeldShardsLocked(before, request.held(), response.mutable_unload_job_ids());
  MarkUnloadingLocked(request.worker_id(), response.unload_job_ids());
  if (!before.healthy()) {
    pool_->MarkHealthy(request.worker_id());  // back after a pause: its old job's group was already lost
    ScheduleLocked();
  } else if (before.job_id().empty()) {
    std::optional<v1::WorkerInfo> now = pool_->Find(request.worker_id());
    if (now.has_value() && !now->job_id().empty()) ScheduleLocked();  // taken back by a recovering job
  }
  return response;
}

void Scheduler::TakeHeldShardsLocked(const v1::WorkerInfo& worker,
                                     const google::protobuf::RepeatedPtrField<v1::HeldShard>& held,
                                     google::protobuf::RepeatedPtrField<std::string>* unload) {
  std::map<std::string, JobRecovery*> recovering;
  for (auto& [job_id, runtime] : runtimes_) {
    if (runtime->recovery != nullptr) recovering[job_id] = runtime->recovery.get();
  }
  const auto known = [this](const std::string& job_id) {
    mu_.AssertHeld();
    auto job = store_->Get(job_id);
    if (!job.ok() && job.status().code() != absl::StatusCode::kNotFound) return HeldJob::kStoreSilent;
    if (!job.ok() || TerminalState(job->state()) || runtimes_.count(job_id) == 0) return HeldJob::kUnknown;
    return HeldJob::kKnown;
  };
  HeldShards sorted = SortHeldShards(worker, held, known, recovering);
  for (std::string& job_id : sorted.unload) *unload->Add() = std::move(job_id);
  if (sorted.taken_back.has_value()) {
    pool_->Assign(worker.worker_id(), sorted.taken_back->first, sorted.taken_back->second);
  }
  for (const std::string& job_id : sorted.decide) DecideRecoveryLocked(job_id);
}

void Scheduler::DecideRecoveryLocked(const std::string& job_id) {
  auto it = runtimes_.find(job_id);
  if (it == runtimes_.end() || it->second->recovery == nullptr) return;
  JobRuntime& runtime = *it->second;
  const ReadoptionDecision decision =
      runtime.recovery->Decide(runtime.plan.world_size(), absl::Now(), options_.readopt_grace);
  switch (decision.outcome) {
    case ReadoptionDecision::Outcome::kWait:
      changed_.SignalAll();  // Job.recovering changed
      return;
    case ReadoptionDecision::Outcome::kFail:
      // Not the end of the job: its ranks that came back unload, and it is placed and loaded
      // again (issue 22, item 5), like any group that lost a worker.
      runtime.recovery.reset();
      LoseGroupLocked(job_id, runtime.group.generation, decision.cause);
      return;
    case ReadoptionDecision::Outcome::kAdopt:
      break;
    default:
      return;
  }
  runtime.recovery.reset();
  runtime.group.rank_workers = decision.rank_workers;
  runtime.group.next_sequence = decision.next_sequence;
  // Every reporting worker is in the pool: one that registers again takes its reports back.
  Adoption adoption = RecordAdoption(
      *store_, job_id, runtime.group.rank_workers,
      [this](const std::string& id) {
        std::optional<v1::WorkerInfo> w = pool_->Find(id);
        return w.has_value() ? w->address() : std::string();
      },
      [this](const absl::Status& status, const std::string& what) {
        mu_.AssertHeld();
        RecordLocked(status, what);
      });
  runtime.group.progress = std::move(adoption.progress);
  runtime.group.serving = adoption.ready;
  if (adoption.ready) runtime.group.restarts.Served(absl::Now());
  changed_.SignalAll();
}

void Scheduler::LoseWorkersGroupLocked(const v1::WorkerInfo& worker, const std::string& why) {
  if (worker.job_id().empty()) return;
  auto runtime = runtimes_.find(worker.job_id());
  if (runtime == runtimes_.end()) return;
  LoseGroupLocked(
      worker.job_id(), runtime->second->group.generation,
      absl::StrCat("worker ", worker.worker_id(), " (rank ", worker.rank(), ") at ", worker.address(), " ", why));
}

void Scheduler::LoseGroupLocked(const std::string& job_id, int64_t generation, const std::string& cause,
                                const std::string& unreachable_worker) {
  // Stopping: the job stays as stored; the next coordinator re-adopts it or places it again.
  if (stopping_) return;
  auto found = runtimes_.find(job_id);
  if (found == runtimes_.end() || found->second->ended) return;
  const std::shared_ptr<JobRuntime> runtime = found->second;
  GroupRuntime& group = runtime->group;
  if (group.generation != generation) return;  // a late report of a loss already handled
  auto job = store_->Get(job_id);
  if (!job.ok() || TerminalState(job->state()) || job->state() == v1::PENDING) return;
  ++groups_lost_;
  const GroupRestarts::Decision decision = group.restarts.Lost(cause, absl::Now());
  if (decision.give_up) {
    FailJobLocked(job_id, decision.cause);
    return;
  }
  // The group is cut off: nothing of this placement loads, finishes or answers after.
  ++group.generation;
  for (auto& context : group.load_contexts) context->TryCancel();
  group.load_contexts.clear();
  group.forward_abort->Abort(absl::StrCat("job ", job_id, " lost its group: ", cause));
  group.forward_abort = std::make_shared<ForwardAbort>();
  group.serving = false;
  group.rank_workers.clear();
  group.progress.clear();
  // A worker that does not answer is not placed again before it heartbeats again.
  if (!unreachable_worker.empty()) pool_->MarkUnhealthy(unreachable_worker);
  // The survivors drop their shard before they may be placed again (WorkerPool::SetUnloading): the
  // job's next load on one of them would race the unload of the same job id.
  for (const WorkerStub& w : pool_->Release(job_id)) {
    pool_->BeginUnloadCall(w.worker_id);
    threads_.Start([this, w, job_id] {
      // Failed: the worker is gone, or holds the shard still; it stays out of placement until a
      // heartbeat shows the shard gone (MarkUnloadingLocked).
      const bool unloaded = UnloadShard(*w.stub, job_id, options_.worker_token).ok();
      absl::MutexLock lock(&mu_);
      if (pool_->EndUnloadCall(w.worker_id, unloaded)) ScheduleLocked();
    });
  }
  runtime->pending_note = absl::StrCat("recovering: ", group.restarts.Describe());
  // One write: a job stored PENDING with the lost group's ranks would be taken for placed.
  absl::StatusOr<v1::Job> pending = store_->TransitionWithRanks(job_id, v1::PENDING, runtime->pending_note, {});
  if (!pending.ok()) {
    // A recovery the database cannot follow would be lost at the next restart.
    StoreErrorLocked(absl::StrCat("putting job ", job_id, " back to PENDING"), pending.status());
    FailJobLocked(
        job_id, absl::StrCat(cause, "; the job database could not record its recovery: ", pending.status().message()));
    return;
  }
  // Ahead of the jobs that wait for their first placement: this one has callers waiting.
  pending_.insert(pending_.begin(), {job_id, pending->pending_reason()});
  ScheduleLocked();  // signals changed_: Job.degraded, and NextForward waiters see the loss
}

void Scheduler::MarkUnloadingLocked(const std::string& worker_id,
                                    const google::protobuf::RepeatedPtrField<std::string>& unload) {
  // Only the shards of jobs that run here matter: those may be placed on this worker again.
  bool live = false;
  for (const std::string& job_id : unload) live |= runtimes_.count(job_id) > 0;
  // Done unloading: it may take a waiting job now (nothing else would schedule then).
  if (pool_->SetUnloading(worker_id, live) && !live) ScheduleLocked();
}

}  // namespace bertshard::server
