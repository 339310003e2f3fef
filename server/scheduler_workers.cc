// The Scheduler's side that workers drive (scheduler.h): what a worker's arrival, heartbeat or
// loss means for its job: the jobs taken back after a restart and their re-adoption, ranks kept by
// a worker that registers again, and a lost worker losing its job's group (placed again after).
// One class split over two files to keep each readable; the lock and its rules are scheduler.h's.
#include <algorithm>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "server/replica_keys.h"
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
    auto shape = std::make_shared<JobShape>();
    shape->version = job.job.version();
    shape->request = job.job.request();
    shape->plan = std::move(job.plan);
    shape->checkpoint = job.job.request().checkpoint();
    shape->assets = std::move(job.assets);
    shape->backend = std::move(job.backend);
    runtime->shape = std::move(shape);
    runtime->submitted_by = job.job.submitted_by();
    runtime->name = job.job.name();
    // Jobs stored before replicas ran one.
    runtime->replicas = std::max(1, job.job.replicas());
    // Bounds stored under a larger --max_replicas than this coordinator's are brought under it.
    const int32_t max_bound = std::min(job.job.max_replicas(), options_.max_replicas);
    SetBoundsLocked(*runtime, std::min(job.job.min_replicas(), max_bound), max_bound);
    const std::string& id = job.job.id();
    // The replicas whose ranks were loading or serving may come back (readoption), under the
    // indices they had (a job scaled down may have gaps); the others are placed again, at the
    // lowest free indices.
    for (auto& [r, recovery] : job.recoveries) {
      auto& group = runtime->groups[r];
      group = std::make_unique<GroupRuntime>(r, runtime->shape, runtime->policy);
      group->phase = GroupRuntime::Phase::kReadopting;
      group->recovery = std::move(recovery);
      // Stored in a smaller shape (--smaller_shapes): its ranks come back in it.
      group->smaller = StoredSmallerShapeLocked(*runtime->shape, group->recovery->previous);
    }
    while (static_cast<int32_t>(runtime->groups.size()) < runtime->replicas) {
      GroupRuntime& group = AddGroupLocked(id, *runtime, runtime->FreeReplicaIndex());
      group.pending_note = job.pending_note;
      group.reason = job.job.pending_reason();
      if (job.job.state() == v1::PENDING) {
        if (std::optional<std::string> cause = ResumeRecoveryLocked(job.job.pending_reason(), group)) {
          given_up.emplace_back(id, *std::move(cause));
        }
      }
    }
    runtimes_[id] = runtime;
    if (job.job.has_update()) {
      // An update that was running goes on: its new shape read and planned again (here, before
      // anything is served, as the jobs' assets are), its replicas placed anew (those loaded before
      // the restart were not taken back: their workers unload them).
      const v1::JobUpdate& update = job.job.update();
      absl::StatusOr<std::shared_ptr<const JobShape>> next =
          ReadShape(update.request(), runtime->shape->backend, update.version());
      absl::Status started = next.status();
      if (next.ok()) started = StartUpdateLocked(id, *runtime, *std::move(next), update.started_unix_millis());
      if (!started.ok()) {
        RecordLocked(store_
                         ->SetUpdate(id, nullptr,
                                     absl::StrCat("version ", update.version(),
                                                  ": given up at a coordinator restart: ", started.message()))
                         .status(),
                     "giving up the update of " + id);
      }
    }
  }
  // Recovering under a --max_restarts that no longer allows it (0): ended, as a loss would be.
  for (const auto& [job_id, cause] : given_up) FailJobLocked(job_id, cause);
  return absl::OkStatus();
}

std::optional<std::string> Scheduler::ResumeRecoveryLocked(const std::string& stored_reason, GroupRuntime& group) {
  // The reason LoseGroupLocked stored: "recovering: lost CAUSE (restart K of at most N)", then
  // "; " and what it waited for. The cause may hold parentheses; the restart count is the last.
  constexpr absl::string_view kPrefix = "recovering: lost ";
  if (!absl::StartsWith(stored_reason, kPrefix)) return std::nullopt;
  const size_t count = stored_reason.rfind(" (restart ");
  if (count == std::string::npos || count < kPrefix.size()) return std::nullopt;
  const std::string cause = stored_reason.substr(kPrefix.size(), count - kPrefix.size());
  // The count starts again here.
  const GroupRestarts::Decision decision = group.restarts.Lost(cause, absl::Now());
  if (decision.give_up) return decision.cause;
  group.pending_note = absl::StrCat("recovering: ", group.restarts.Describe());
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
  // old.job_id() is the key of the replica it served (replica_keys.h).
  const FoundGroup found = FindGroupLocked(old.job_id());
  if (found.group != nullptr && found.group->recovery != nullptr) {
    found.group->recovery->ForgetWorker(old.worker_id());  // they count again with this registration
    return std::nullopt;
  }
  if (old.job_id().empty()) return std::nullopt;
  const v1::HeldShard* shard = nullptr;
  for (const v1::HeldShard& h : request.held()) {
    if (h.job_id() == old.job_id() && h.rank() == old.rank()) shard = &h;
  }
  if (found.group == nullptr || found.runtime->ended) return std::nullopt;
  if (shard != nullptr && shard->broken().empty()) return std::make_pair(old.job_id(), old.rank());
  LoseGroupLocked(
      found.job_id, found.group->replica, found.group->generation,
      absl::StrCat("worker ", old.worker_id(), " (rank ", old.rank(), ") at ", request.address(), " registered again ",
                   shard == nullptr ? "without its shard" : absl::StrCat("with its shard broken: ", shard->broken())));
  return std::nullopt;
}

void Scheduler::MoveRankLocked(const std::string& key, int32_t rank, v1::WorkerInfo* worker) {
  pool_->Assign(worker->worker_id(), key, rank);
  worker->set_job_id(key);
  worker->set_rank(rank);
  const FoundGroup found = FindGroupLocked(key);
  if (found.group == nullptr) return;
  const size_t r = static_cast<size_t>(rank);
  if (r < found.group->ranks.size()) {
    found.group->ranks[r].set_worker_id(worker->worker_id());
    found.group->ranks[r].set_worker_address(worker->address());
  }
  if (r < found.group->progress.size()) found.group->progress[r].set_worker_id(worker->worker_id());
  // A worker kept for the replica's next placement (scheduler_smaller.cc) is kept under its new id.
  for (v1::RankAssignment& a : found.group->kept) {
    if (a.rank() != rank) continue;
    a.set_worker_id(worker->worker_id());
    a.set_worker_address(worker->address());
  }
  RecordLocked(RecordJobLocked(found.job_id, *found.runtime, ""),
               absl::StrCat("moving job ", found.job_id, "'s rank ", r, " to worker ", worker->worker_id()));
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
  // By the replicas' keys: what the workers hold shards by.
  std::map<std::string, JobRecovery*> recovering;
  for (auto& [job_id, runtime] : runtimes_) {
    for (auto& [replica, group] : runtime->groups) {
      if (group->recovery != nullptr) recovering[ReplicaKey(job_id, replica)] = group->recovery.get();
    }
  }
  const auto known = [this](const std::string& key) {
    mu_.AssertHeld();
    const ReplicaOf of = ParseReplicaKey(key);
    auto job = store_->Get(of.job_id);
    if (!job.ok() && job.status().code() != absl::StatusCode::kNotFound) return HeldJob::kStoreSilent;
    // A replica scaled away (or never there) is unknown like an ended job: its shard goes.
    if (!job.ok() || TerminalState(job->state()) || FindGroupLocked(key).group == nullptr) return HeldJob::kUnknown;
    return HeldJob::kKnown;
  };
  HeldShards sorted = SortHeldShards(worker, held, known, recovering);
  for (std::string& job_id : sorted.unload) *unload->Add() = std::move(job_id);
  if (sorted.taken_back.has_value()) {
    pool_->Assign(worker.worker_id(), sorted.taken_back->first, sorted.taken_back->second);
  }
  for (const std::string& key : sorted.decide) DecideRecoveryLocked(key);
}

void Scheduler::DecideRecoveryLocked(const std::string& key) {
  const FoundGroup found = FindGroupLocked(key);
  if (found.group == nullptr || found.group->recovery == nullptr) return;
  GroupRuntime& group = *found.group;
  const ReadoptionDecision decision = group.recovery->Decide(
      (group.smaller != nullptr ? group.smaller : group.shape)->plan.world_size(), absl::Now(), options_.readopt_grace);
  switch (decision.outcome) {
    case ReadoptionDecision::Outcome::kWait:
      changed_.SignalAll();  // Job.recovering changed
      return;
    case ReadoptionDecision::Outcome::kFail:
      // Not the end of the job: the replica's ranks that came back unload, and it is placed and
      // loaded again (issue 22, item 5), like any replica that lost a worker.
      LoseGroupLocked(found.job_id, group.replica, group.generation, decision.cause);
      return;
    case ReadoptionDecision::Outcome::kAdopt:
      break;
    default:
      return;
  }
  const bool was_loading = group.recovery->was_loading;
  group.recovery.reset();
  group.next_sequence = decision.next_sequence;
  group.ranks.clear();
  group.progress.clear();
  // Every reporting worker is in the pool: one that registers again takes its reports back.
  for (size_t r = 0; r < decision.rank_workers.size(); ++r) {
    std::optional<v1::WorkerInfo> worker = pool_->Find(decision.rank_workers[r]);
    v1::RankAssignment a;
    a.set_rank(static_cast<int32_t>(r));
    a.set_worker_id(decision.rank_workers[r]);
    a.set_worker_address(worker.has_value() ? worker->address() : "");
    a.set_replica(group.replica);
    MarkSmallerLocked(group, a);
    group.ranks.push_back(a);
    v1::RankProgress p;
    p.set_rank(a.rank());
    p.set_worker_id(a.worker_id());
    p.set_replica(group.replica);
    p.mutable_progress()->set_phase(v1::LoadProgress::READY);
    group.progress.push_back(p);
  }
  group.phase = GroupRuntime::Phase::kServing;
  const absl::Status recorded = RecordJobLocked(
      found.job_id, *found.runtime,
      was_loading
          ? absl::StrCat("all ", decision.rank_workers.size(), " ranks had loaded when the coordinator restarted")
          : "");
  if (!recorded.ok()) {
    // Serving a replica the database does not know of would be lost at the next restart.
    StoreErrorLocked(absl::StrCat("taking back job ", found.job_id), recorded);
    group.phase = GroupRuntime::Phase::kLoading;
    LoseGroupLocked(found.job_id, group.replica, group.generation,
                    absl::StrCat("the job database could not record its ranks: ", recorded.message()));
    return;
  }
  if (group.smaller == nullptr) {
    group.restarts.Served(absl::Now());
  } else if (group.restarts
                 .Lost("workers before the coordinator restarted (taken back in its smaller shape)", absl::Now())
                 .give_up) {
    // In a smaller shape it still recovers (degraded, and growing back when it can), whatever
    // this coordinator's --max_restarts: it serves.
    group.restarts.KeepTrying(absl::Now());
  }
  group.idle_since = absl::Now();
  UpdateLanesLocked(*found.runtime);
  changed_.SignalAll();
}

void Scheduler::LoseWorkersGroupLocked(const v1::WorkerInfo& worker, const std::string& why) {
  if (worker.job_id().empty()) return;
  const FoundGroup found = FindGroupLocked(worker.job_id());
  if (found.group == nullptr) return;
  // Only the placement it is in: a second silent worker of a replica already placed again (on
  // spares) must not lose the new placement too.
  const auto& ranks = found.group->ranks;
  const bool in_it = std::any_of(ranks.begin(), ranks.end(),
                                 [&](const v1::RankAssignment& a) { return a.worker_id() == worker.worker_id(); });
  if (!in_it && found.group->phase != GroupRuntime::Phase::kReadopting) return;
  LoseGroupLocked(
      found.job_id, found.group->replica, found.group->generation,
      absl::StrCat("worker ", worker.worker_id(), " (rank ", worker.rank(), ") at ", worker.address(), " ", why));
}

void Scheduler::LoseGroupLocked(const std::string& job_id, int32_t replica, int64_t generation,
                                const std::string& cause, const std::string& unreachable_worker, bool keep_workers) {
  // Stopping: the job stays as stored; the next coordinator re-adopts it or places it again.
  if (stopping_) return;
  auto found = runtimes_.find(job_id);
  if (found == runtimes_.end() || found->second->ended) return;
  const std::shared_ptr<JobRuntime> runtime = found->second;
  GroupRuntime* group = runtime->Group(replica);
  // A late report of a loss already handled, or of a replica waiting for workers anyway.
  if (group == nullptr || group->generation != generation || group->phase == GroupRuntime::Phase::kPending) return;
  auto job = store_->Get(job_id);
  if (!job.ok() || TerminalState(job->state())) return;
  ++groups_lost_;
  // A worker that does not answer is not placed again before it heartbeats again.
  if (!unreachable_worker.empty()) pool_->MarkUnhealthy(unreachable_worker);
  if (group->retiring || (!runtime->Current(*group) && group->shape != runtime->next)) {
    // Scaled away and lost before its forward ended: gone as it would have gone. Or of a shape an
    // update switched away from: placing it again would take workers the new shape waits for, for
    // a shape that only drains (its queued requests go to its other replicas, or are UNAVAILABLE).
    DropGroupLocked(job_id, *runtime, replica);
    ScheduleLocked();
    return;
  }
  const GroupRestarts::Decision decision = group->restarts.Lost(cause, absl::Now());
  if (decision.give_up && group->shape == runtime->next) {
    // An update's replica that keeps losing workers: the update ends, the old shape serves on.
    AbortUpdateLocked(job_id, *runtime, absl::StrCat("its new replica ", replica, ": ", decision.cause));
    return;
  }
  // Past --max_restarts the job ends, unless other replicas serve: one replica's bad luck (a
  // worker that dies at every load) does not take down a job that answers; that replica keeps
  // trying, every --restart_backoff_max, and Job.degraded says so.
  const bool others_serve = runtime->ServingGroups() - (group->serving() ? 1 : 0) > 0;
  if (decision.give_up && !others_serve) {
    FailJobLocked(job_id, decision.cause);
    return;
  }
  if (decision.give_up) group->restarts.KeepTrying(absl::Now());
  const std::string what = runtime->groups.size() == 1
                               ? absl::StrCat("job ", job_id, " lost its group")
                               : absl::StrCat("replica ", replica, " of job ", job_id, " lost a worker");
  // The replica is cut off: nothing of this placement loads, finishes or answers after.
  CutOffLocked(*group, absl::StrCat(what, ": ", cause));
  group->recovery.reset();
  if (keep_workers && KeepsWorkersLocked(*runtime, *group)) {
    KeepWorkersLocked(job_id, *group);  // the healthy ones keep their shards for the next placement
  } else {
    group->kept.clear();
    UnloadGroupLocked(ReplicaKey(job_id, replica));
  }
  group->smaller.reset();  // placed again in its own shape where it fits
  group->ranks.clear();
  group->progress.clear();
  group->pending_note = absl::StrCat("recovering: ", group->restarts.Describe());
  group->reason = group->pending_note;
  // One write: a job stored PENDING with the lost replica's ranks would be taken for placed.
  const absl::Status recorded = RecordJobLocked(job_id, *runtime, group->pending_note);
  if (!recorded.ok()) {
    // A recovery the database cannot follow would be lost at the next restart.
    StoreErrorLocked(absl::StrCat("putting job ", job_id, " back to PENDING"), recorded);
    FailJobLocked(job_id,
                  absl::StrCat(cause, "; the job database could not record its recovery: ", recorded.message()));
    return;
  }
  // Ahead of the replicas that wait for their first placement: this one has callers waiting.
  QueueForPlacementLocked(job_id, replica, /*first=*/true);
  UpdateLanesLocked(*runtime);
  ScheduleLocked();  // signals changed_: Job.degraded, and NextForward waiters see the loss
}

void Scheduler::MarkUnloadingLocked(const std::string& worker_id,
                                    const google::protobuf::RepeatedPtrField<std::string>& unload) {
  // Only the shards of jobs that run here matter: those may be placed on this worker again.
  bool live = false;
  for (const std::string& key : unload) live |= runtimes_.count(ParseReplicaKey(key).job_id) > 0;
  // Done unloading: it may take a waiting job now (nothing else would schedule then).
  if (pool_->SetUnloading(worker_id, live) && !live) ScheduleLocked();
}

}  // namespace bertshard::server
