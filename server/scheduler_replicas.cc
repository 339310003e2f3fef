// The Scheduler's replicas (scheduler.h): how a job's state follows its replicas', which replica
// takes each forward, scaling a job up and down, and what a job shows of its replicas. One class
// split over three files to keep each readable; the lock and its rules are scheduler.h's.
#include <algorithm>
#include <cstdio>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "server/placement.h"
#include "server/replica_keys.h"
#include "server/scheduler.h"
#include "server/shard_loading.h"
#include "server/smaller_shapes.h"

namespace bertshard::server {

namespace {

// How far a replica has come: the job's state is its most advanced replica's.
int Advance(const GroupRuntime& group) {
  switch (group.phase) {
    case GroupRuntime::Phase::kPending:
      return 0;
    case GroupRuntime::Phase::kPlanned:
      return 1;
    case GroupRuntime::Phase::kLoading:
      return 2;
    case GroupRuntime::Phase::kReadopting:
      // What it was when the coordinator stopped, until its ranks come back or it is given up: a
      // READY job taken back is not rewritten LOADING meanwhile (nor taken for one at a second restart).
      return group.recovery != nullptr && !group.recovery->was_loading ? 3 : 2;
    case GroupRuntime::Phase::kServing:
      return 3;
  }
  return 0;
}

v1::JobState StateOf(int advance) {
  static constexpr v1::JobState kStates[] = {v1::PENDING, v1::PLANNED, v1::LOADING, v1::READY};
  return kStates[std::clamp(advance, 0, 3)];
}

bool SameRanks(const google::protobuf::RepeatedPtrField<v1::RankAssignment>& stored,
               const std::vector<v1::RankAssignment>& now) {
  if (stored.size() != static_cast<int>(now.size())) return false;
  for (size_t i = 0; i < now.size(); ++i) {
    if (stored[static_cast<int>(i)].SerializeAsString() != now[i].SerializeAsString()) return false;
  }
  return true;
}

}  // namespace

std::vector<std::string> GroupRuntime::WorkerIds() const {
  std::vector<std::string> ids;
  for (const v1::RankAssignment& a : ranks) ids.push_back(a.worker_id());
  return ids;
}

GroupRuntime* JobRuntime::Group(int32_t replica) {
  auto it = groups.find(replica);
  return it == groups.end() ? nullptr : it->second.get();
}

int JobRuntime::ServingGroups() const {
  int serving = 0;
  for (const auto& [replica, group] : groups) serving += (group->serving() && !group->retiring) ? 1 : 0;
  return serving;
}

int JobRuntime::ServingGroups(int32_t version) const {
  int serving = 0;
  for (const auto& [replica, group] : groups) {
    serving += (group->serving() && !group->retiring && group->shape->version == version) ? 1 : 0;
  }
  return serving;
}

bool JobRuntime::Recovering(int32_t version) const {
  for (const auto& [replica, group] : groups) {
    if (group->shape->version == version && group->restarts.recovering()) return true;
  }
  return false;
}

bool JobRuntime::Serving() const { return ServingGroups(shape->version) > 0 || Recovering(); }

int32_t JobRuntime::FreeReplicaIndex() const {
  int32_t r = 0;
  while (groups.count(r) > 0) ++r;
  return r;
}

Scheduler::FoundGroup Scheduler::FindGroupLocked(const std::string& key) {
  ReplicaOf of = ParseReplicaKey(key);
  auto it = runtimes_.find(of.job_id);
  if (it == runtimes_.end()) return {};
  GroupRuntime* group = it->second->Group(of.replica);
  if (group == nullptr) return {};
  return {it->second, group, std::move(of.job_id)};
}

GroupRuntime& Scheduler::AddGroupLocked(const std::string& job_id, JobRuntime& runtime, int32_t replica,
                                        std::shared_ptr<const JobShape> shape) {
  auto& slot = runtime.groups[replica];
  slot = std::make_unique<GroupRuntime>(replica, shape != nullptr ? std::move(shape) : runtime.shape, runtime.policy);
  QueueForPlacementLocked(job_id, replica, /*first=*/false);
  return *slot;
}

void Scheduler::QueueForPlacementLocked(const std::string& job_id, int32_t replica, bool first) {
  UnqueueLocked(job_id, replica);
  if (first) {
    pending_.insert(pending_.begin(), {job_id, replica});
  } else {
    pending_.push_back({job_id, replica});
  }
}

void Scheduler::UnqueueLocked(const std::string& job_id, int32_t replica) {
  pending_.erase(std::remove_if(pending_.begin(), pending_.end(),
                                [&](const PendingGroup& p) { return p.job_id == job_id && p.replica == replica; }),
                 pending_.end());
}

absl::Status Scheduler::RecordJobLocked(const std::string& job_id, const JobRuntime& runtime,
                                        const std::string& reason) {
  int advance = 0;
  std::vector<v1::RankAssignment> ranks;
  std::string pending_reason;
  for (const auto& [replica, group] : runtime.groups) {
    // Only the shape the store holds the plan of: an update's new replicas, or the old ones still
    // draining after it switched, are not taken back after a restart (the update starts again).
    if (!runtime.Current(*group)) continue;
    advance = std::max(advance, Advance(*group));
    if (group->phase == GroupRuntime::Phase::kReadopting && group->recovery != nullptr) {
      // Still where they were before the restart, until they come back or are given up: a second
      // restart meanwhile must find them too.
      ranks.insert(ranks.end(), group->recovery->previous.begin(), group->recovery->previous.end());
    } else {
      ranks.insert(ranks.end(), group->ranks.begin(), group->ranks.end());
    }
    if (group->phase == GroupRuntime::Phase::kPending && pending_reason.empty()) pending_reason = group->reason;
  }
  const v1::JobState state = StateOf(advance);
  ASSIGN_OR_RETURN(const v1::Job stored, store_->Get(job_id));
  if (stored.state() != state) {
    return store_->TransitionWithRanks(job_id, state, state == v1::PENDING ? pending_reason : reason, ranks).status();
  }
  if (!SameRanks(stored.ranks(), ranks)) RETURN_IF_ERROR(store_->SetRanks(job_id, ranks).status());
  if (state == v1::PENDING && stored.pending_reason() != pending_reason) {
    RETURN_IF_ERROR(store_->SetPendingReason(job_id, pending_reason));
  }
  return absl::OkStatus();
}

void Scheduler::UpdateLanesLocked(JobRuntime& runtime) {
  if (runtime.job_serving != nullptr) {
    runtime.job_serving->SetConcurrency(std::max(1, runtime.ServingGroups(runtime.shape->version)));
  }
  for (const auto& [version, serving] : runtime.draining) {
    if (serving != nullptr) serving->SetConcurrency(std::max(1, runtime.ServingGroups(version)));
  }
}

void Scheduler::UnloadGroupLocked(const std::string& key) {
  // The workers drop their shard before they may be placed again (WorkerPool::SetUnloading): a
  // load of the same key on one of them would race the unload.
  for (const WorkerStub& w : pool_->Release(key)) UnloadWorkerLocked(w, key);
}

void Scheduler::UnloadWorkerLocked(const WorkerStub& w, const std::string& key) {
  pool_->BeginUnloadCall(w.worker_id);
  threads_.Start([this, w, key] {
    // Failed: the worker is gone, or holds the shard still; it stays out of placement until a
    // heartbeat shows the shard gone (MarkUnloadingLocked).
    const bool unloaded = UnloadShard(*w.stub, key, options_.worker_token).ok();
    absl::MutexLock lock(&mu_);
    if (pool_->EndUnloadCall(w.worker_id, unloaded)) ScheduleLocked();
  });
}

void Scheduler::CutOffLocked(GroupRuntime& group, const std::string& why) {
  group.lost_from = group.generation;
  group.generation = ++generations_;
  for (auto& context : group.load_contexts) context->TryCancel();
  group.load_contexts.clear();
  group.forward_abort->Abort(why);
  group.forward_abort = std::make_shared<ForwardAbort>();
  group.phase = GroupRuntime::Phase::kPending;
  // The forward cut off was busy time too (the autoscaler's sample may have counted part of it).
  if (group.forwarding) group.busy += absl::Now() - group.forward_started;
  group.forwarding = false;
  group.growing_back = false;
}

void Scheduler::DropGroupLocked(const std::string& job_id, JobRuntime& runtime, int32_t replica) {
  auto it = runtime.groups.find(replica);
  if (it == runtime.groups.end()) return;
  GroupRuntime& group = *it->second;
  for (auto& context : group.load_contexts) context->TryCancel();
  group.forward_abort->Abort(absl::StrCat("replica ", replica, " of job ", job_id, " was scaled away"));
  UnqueueLocked(job_id, replica);
  UnloadGroupLocked(ReplicaKey(job_id, replica));
  // Its loads find no group under this replica (or a new one, with another generation) and stop.
  runtime.groups.erase(it);
  RecordLocked(RecordJobLocked(job_id, runtime, ""), absl::StrCat("recording job ", job_id, "'s replicas"));
  UpdateLanesLocked(runtime);
  changed_.SignalAll();
}

absl::Status Scheduler::CheckReplicaBounds(int32_t min_replicas, int32_t max_replicas) const {
  if (min_replicas == 0 && max_replicas == 0) return absl::OkStatus();
  if (min_replicas < 1 || min_replicas > max_replicas || max_replicas > options_.max_replicas) {
    return absl::InvalidArgumentError(
        absl::StrCat("replica bounds must be 1 <= min_replicas <= max_replicas <= ", options_.max_replicas,
                     " (--max_replicas), not ", min_replicas, "..", max_replicas));
  }
  return absl::OkStatus();
}

void Scheduler::SetBoundsLocked(JobRuntime& runtime, int32_t min_replicas, int32_t max_replicas) {
  runtime.min_replicas = min_replicas;
  runtime.max_replicas = max_replicas;
  if (max_replicas == 0) {
    runtime.autoscaler.reset();
  } else {
    runtime.autoscaler = std::make_unique<ReplicaAutoscaler>(options_.autoscale);
  }
}

absl::StatusOr<v1::Job> Scheduler::ScaleJob(const std::string& id, int32_t replicas, int32_t min_replicas,
                                            int32_t max_replicas) {
  RETURN_IF_ERROR(CheckReplicaBounds(min_replicas, max_replicas));
  const bool bounded = max_replicas > 0;
  if ((!bounded || replicas != 0) && (replicas < 1 || replicas > options_.max_replicas)) {
    return absl::InvalidArgumentError(
        absl::StrCat("replicas must be 1..", options_.max_replicas, " (--max_replicas), not ", replicas));
  }
  if (bounded && replicas != 0 && (replicas < min_replicas || replicas > max_replicas)) {
    return absl::InvalidArgumentError(
        absl::StrCat("replicas ", replicas, " is outside the bounds ", min_replicas, "..", max_replicas));
  }
  absl::MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(const v1::Job job, store_->Get(id));
  auto found = runtimes_.find(id);
  if (TerminalState(job.state()) || found == runtimes_.end()) {
    return absl::FailedPreconditionError(absl::StrCat("job ", id, " is ", v1::JobState_Name(job.state())));
  }
  JobRuntime& runtime = *found->second;
  // A job still on its way (or taken back after a restart) has replicas whose fate is not known
  // yet: scaling it would race their placement. READY is when its shape is settled.
  bool readopting = false;
  for (const auto& [replica, group] : runtime.groups) {
    readopting |= group->phase == GroupRuntime::Phase::kReadopting;
  }
  if (runtime.next != nullptr || !runtime.draining.empty()) {
    return absl::FailedPreconditionError(absl::StrCat("job ", id, " runs a live update (",
                                                      UpdateProgressLocked(runtime), "); scale it once it is done"));
  }
  if (job.state() != v1::READY || readopting) {
    return absl::FailedPreconditionError(absl::StrCat("job ", id, " is ", v1::JobState_Name(job.state()),
                                                      readopting ? " and taking its replicas back after a restart" : "",
                                                      "; scale it once it is READY"));
  }
  if (replicas == 0) replicas = std::clamp(runtime.replicas, min_replicas, max_replicas);
  // Stored first: a restart keeps what was asked for.
  RETURN_IF_ERROR(store_->SetReplicas(id, replicas, min_replicas, max_replicas).status());
  SetBoundsLocked(runtime, min_replicas, max_replicas);
  ScaleJobLocked(id, runtime, replicas);
  return GetJobLocked(id);
}

void Scheduler::ScaleJobLocked(const std::string& id, JobRuntime& runtime, int32_t replicas) {
  runtime.replicas = replicas;
  int32_t live = 0;
  for (const auto& [replica, group] : runtime.groups) live += group->retiring ? 0 : 1;
  // Growing: those scaled away that still finish a forward come back first, then new replicas
  // take the lowest free indices.
  for (auto& [replica, group] : runtime.groups) {
    if (live < replicas && group->retiring) {
      group->retiring = false;
      ++live;
    }
  }
  while (live < replicas) {
    AddGroupLocked(id, runtime, runtime.FreeReplicaIndex()).reason = "placing its ranks";
    ++live;
  }
  // Shrinking: those that do not serve go first (the highest index first), then serving ones, so
  // that what serves keeps serving; one running a forward finishes it first (EndForward drops it).
  std::vector<int32_t> order;
  for (int pass = 0; pass < 2; ++pass) {
    for (auto it = runtime.groups.rbegin(); it != runtime.groups.rend(); ++it) {
      if (!it->second->retiring && it->second->serving() == (pass == 1)) order.push_back(it->first);
    }
  }
  std::vector<int32_t> drop;
  for (int32_t replica : order) {
    if (live <= replicas) break;
    GroupRuntime& group = *runtime.Group(replica);
    if (group.forwarding) {
      group.retiring = true;
    } else {
      drop.push_back(replica);
    }
    --live;
  }
  for (int32_t replica : drop) DropGroupLocked(id, runtime, replica);
  RecordLocked(RecordJobLocked(id, runtime, ""), absl::StrCat("recording job ", id, "'s replicas"));
  UpdateLanesLocked(runtime);
  ScheduleLocked();
}

void Scheduler::AutoscaleLocked(absl::Time now) {
  // Every quarter second, not at every wake of the monitor (any change wakes it).
  if (now - last_autoscale_ < absl::Milliseconds(250)) return;
  last_autoscale_ = now;
  std::vector<std::pair<std::string, std::shared_ptr<JobRuntime>>> scaled;
  for (const auto& [id, runtime] : runtimes_) {
    if (runtime->autoscaler != nullptr && !runtime->ended) scaled.emplace_back(id, runtime);
  }
  for (auto& [id, runtime] : scaled) {
    // What the serving replicas were busy since the last sample: forwards that ended, and the part
    // of the one in flight run so far.
    absl::Duration busy;
    int serving = 0;
    bool settled = runtime->next == nullptr && runtime->draining.empty();
    for (auto& [replica, group] : runtime->groups) {
      settled &= group->phase != GroupRuntime::Phase::kReadopting;
      const absl::Duration total =
          group->busy + (group->forwarding ? now - group->forward_started : absl::ZeroDuration());
      if (group->serving() && !group->retiring && runtime->Current(*group)) {
        // (Not below 0: a forward cut off by a loss counted its part in flight, then nothing.)
        busy += std::max(absl::ZeroDuration(), total - group->busy_sampled);
        ++serving;
      }
      group->busy_sampled = total;
    }
    // An update or a restart changes the replicas under it: measured again after.
    if (!settled) {
      runtime->autoscaler->Reset();
      continue;
    }
    int32_t wanted = runtime->autoscaler->Observe(now, busy, serving, runtime->replicas, runtime->min_replicas,
                                                  runtime->max_replicas);
    // A replica it added (or one lost) that finds no workers for down_after is given up, down to
    // min: the pool's shortage is the workers autoscaler's to mend (workers_wanted), and waiting
    // for it would freeze this job's scaling.
    if (serving >= runtime->replicas) {
      runtime->unserved_since = absl::InfinitePast();
    } else if (runtime->unserved_since == absl::InfinitePast()) {
      runtime->unserved_since = now;
    } else if (now - runtime->unserved_since > options_.autoscale.down_after &&
               runtime->replicas > runtime->min_replicas) {
      bool waits = false;  // a replica still waits for workers (those loading are on their way)
      for (const auto& [replica, group] : runtime->groups) {
        waits |= runtime->Current(*group) && group->phase == GroupRuntime::Phase::kPending;
      }
      if (waits) {
        wanted = runtime->replicas - 1;
        runtime->unserved_since = now;
      }
    }
    if (wanted == runtime->replicas) continue;
    // One more only where idle workers can hold it now (else the workers_wanted metric does not ask
    // for more workers for what is only a wish); one fewer at any time.
    if (wanted > runtime->replicas &&
        PlaceRanks(runtime->shape->backend, runtime->shape->plan.world_size(), pool_->Idle()).ranks.empty()) {
      continue;
    }
    if (absl::Status s = store_->SetReplicas(id, wanted, runtime->min_replicas, runtime->max_replicas).status();
        !s.ok()) {
      StoreErrorLocked(absl::StrCat("autoscaling job ", id), s);
      continue;
    }
    std::fprintf(stderr, "bertshard-coordinator: job %s: %d -> %d replicas (utilisation %.2f, bounds %d..%d)\n",
                 id.c_str(), runtime->replicas, wanted, runtime->autoscaler->Utilisation(options_.autoscale.up_after),
                 runtime->min_replicas, runtime->max_replicas);
    ScaleJobLocked(id, *runtime, wanted);
  }
}

absl::StatusOr<ForwardTarget> Scheduler::NextForward(const std::string& job_id, int32_t version,
                                                     absl::Time wait_until) {
  absl::MutexLock lock(&mu_);
  while (true) {
    if (stopping_) return absl::UnavailableError("the coordinator is shutting down");
    auto it = runtimes_.find(job_id);
    if (it == runtimes_.end()) {
      // It ended while this batch waited (its queue is closed by now too).
      return absl::FailedPreconditionError(absl::StrCat("job ", job_id, " no longer serves"));
    }
    JobRuntime& runtime = *it->second;
    // The free replica idle the longest: every replica keeps busy under load, and a lone caller's
    // forwards go round them all (each stays warm, a bad one shows at once).
    GroupRuntime* chosen = nullptr;
    bool busy = false;
    for (auto& [replica, group] : runtime.groups) {
      // A request is answered wholly by the shape it was prepared for (a live update moves new
      // requests to the new shape; those already queued finish on the old).
      if (!group->serving() || group->retiring || group->shape->version != version) continue;
      if (group->forwarding) {
        busy = true;
        continue;
      }
      if (chosen == nullptr || group->idle_since < chosen->idle_since) chosen = group.get();
    }
    if (chosen != nullptr) {
      // A serving replica's workers are in the pool: one that registers again keeps the rank under
      // its new id (MoveRankLocked), and one that leaves loses the replica first.
      ASSIGN_OR_RETURN(std::vector<WorkerStub> stubs, pool_->Stubs(chosen->WorkerIds()));
      ForwardTarget target;
      for (WorkerStub& s : stubs) {
        target.ranks.push_back({s.worker_id, s.address, std::move(s.stub), options_.worker_token, std::move(s.health)});
      }
      chosen->forwarding = true;
      chosen->forward_started = absl::Now();
      target.sequence = chosen->next_sequence++;
      target.abort = chosen->forward_abort;
      target.replica = chosen->replica;
      target.generation = chosen->generation;
      target.shard_key = ReplicaKey(job_id, chosen->replica);
      const JobShape& serving = chosen->smaller != nullptr ? *chosen->smaller : *chosen->shape;
      target.pipeline_stages = std::max(1, serving.plan.shard_config().pp_size());
      return target;
    }
    if (!busy && !runtime.Recovering(version)) {
      return absl::FailedPreconditionError(absl::StrCat("job ", job_id, " does not serve now"));
    }
    if (absl::Now() >= wait_until) {
      if (busy) {
        return absl::UnavailableError(
            absl::StrCat("every replica of job ", job_id, " was busy until the requests' deadline; retry"));
      }
      std::vector<std::string> why;
      for (const auto& [replica, group] : runtime.groups) {
        if (group->shape->version == version && group->restarts.recovering()) {
          why.push_back(group->restarts.Describe());
        }
      }
      return absl::UnavailableError(absl::StrCat("job ", job_id, " has no replica serving (", absl::StrJoin(why, "; "),
                                                 ") and none came back before the requests' deadline; retry"));
    }
    // A replica comes back (FinishLoad) or ends its forward (EndForward): both signal.
    ++forward_waiters_;
    changed_.WaitWithDeadline(&mu_, wait_until);
    --forward_waiters_;
  }
}

void Scheduler::EndForward(const std::string& job_id, int32_t replica, int64_t generation) {
  absl::MutexLock lock(&mu_);
  auto it = runtimes_.find(job_id);
  if (it == runtimes_.end()) return;
  GroupRuntime* group = it->second->Group(replica);
  // Lost meanwhile (its placement is another now) or scaled away: nothing holds it.
  if (group == nullptr || group->generation != generation) return;
  group->forwarding = false;
  ++group->forwards;
  group->idle_since = absl::Now();
  group->busy += group->idle_since - group->forward_started;
  if (group->retiring) {
    DropGroupLocked(job_id, *it->second, replica);  // signals: the job's replicas changed
  } else if (group->growing_back) {
    group->growing_back = false;
    // The room it was marked for may be gone (another replica took the idle workers, an update began).
    if (RoomToGrowBackLocked(*it->second, *group, pool_->Idle())) {
      GrowBackLocked(job_id, *it->second, *group);  // signals
    } else {
      ScheduleLocked();  // another may grow back now; signals
    }
  } else if (forward_waiters_ > 0) {
    // Only a forward waiting for a free replica cares: every watcher woken at every forward would
    // read its job from the store under this lock, on the request path.
    changed_.SignalAll();
  }
}

void Scheduler::LoseGroup(const std::string& job_id, int32_t replica, int64_t generation, const std::string& cause,
                          const std::string& unreachable_worker) {
  absl::MutexLock lock(&mu_);
  LoseGroupLocked(job_id, replica, generation, cause, unreachable_worker);
}

absl::Status Scheduler::WithServingRuntime(const std::string& job_id,
                                           const std::function<absl::Status(const std::shared_ptr<JobRuntime>& serving,
                                                                            const absl::StatusOr<v1::Job>& job)>& use) {
  absl::MutexLock lock(&mu_);
  // Stop() takes every batch queue out as it sets stopping_; none may be made after.
  if (stopping_) return absl::UnavailableError("the coordinator is shutting down");
  auto found = runtimes_.find(job_id);
  // A replica being placed again: the requests queue and wait for it (NextForward).
  if (found != runtimes_.end() && found->second->Serving()) return use(found->second, v1::Job());
  return use(nullptr, GetJobLocked(job_id));
}

RecoveryMetrics Scheduler::Recovery() {
  absl::MutexLock lock(&mu_);
  RecoveryMetrics metrics;
  metrics.groups_lost = groups_lost_;
  for (const auto& [id, runtime] : runtimes_) {
    if (runtime->ended) continue;
    JobRecoveryState job{id, 0, runtime->Recovering()};
    for (const auto& [replica, group] : runtime->groups) {
      if (runtime->Current(*group)) job.restarts = std::max(job.restarts, group->restarts.restarts());
    }
    job.replicas = runtime->replicas;
    job.replicas_ready = runtime->ServingGroups(runtime->shape->version);
    job.version = runtime->shape->version;
    job.updating = runtime->next != nullptr || !runtime->draining.empty();
    metrics.jobs.push_back(job);
    // What the HPA scales the workers by: those placed, and those the waiting replicas need.
    for (const auto& [replica, group] : runtime->groups) {
      metrics.replicas.push_back({id, replica, group->forwarding ? 1 : 0, group->forwards});
      metrics.workers_wanted +=
          group->phase == GroupRuntime::Phase::kPending
              ? group->shape->plan.world_size()
              : static_cast<int64_t>(std::max<size_t>(
                    group->ranks.size(), group->recovery != nullptr ? group->recovery->previous.size() : 0));
    }
  }
  return metrics;
}

void Scheduler::FillRuntimeFieldsLocked(v1::Job& job) {
  auto found = runtimes_.find(job.id());
  if (found == runtimes_.end()) return;
  const JobRuntime& runtime = *found->second;
  const bool one = runtime.groups.size() == 1 && runtime.next == nullptr;
  const auto named = [one](int32_t replica, const std::string& what) {
    return one ? what : absl::StrCat("replica ", replica, ": ", what);
  };
  std::vector<std::string> recovering, degraded;
  int32_t restarts = 0;
  job.set_replicas(runtime.replicas);
  for (const auto& [replica, group] : runtime.groups) {
    v1::ReplicaStatus* status = job.add_replica_status();
    status->set_replica(replica);
    status->set_state(group->phase == GroupRuntime::Phase::kReadopting ? v1::LOADING : StateOf(Advance(*group)));
    if (group->phase == GroupRuntime::Phase::kReadopting && group->recovery != nullptr) {
      const std::string waiting =
          group->recovery->Describe((group->smaller != nullptr ? group->smaller : group->shape)->plan.world_size());
      if (runtime.Current(*group)) recovering.push_back(named(replica, waiting));
      status->set_reason(waiting);
      for (const v1::RankAssignment& a : group->recovery->previous) *status->add_ranks() = a;
    } else {
      for (const v1::RankAssignment& a : group->ranks) *status->add_ranks() = a;
      if (group->phase == GroupRuntime::Phase::kPending) status->set_reason(group->reason);
    }
    if (group->retiring) status->set_reason("scaled away: unloads once its forward ends");
    if (!runtime.Current(*group) && group->shape != runtime.next) {
      status->set_reason(absl::StrCat("version ", group->shape->version,
                                      ", switched away from: finishes the requests queued for it, then unloads"));
    }
    // Only the serving shape's losses degrade the job; an update's show in Job.update.progress.
    if (group->restarts.recovering() && runtime.Current(*group)) {
      degraded.push_back(
          named(replica, group->smaller == nullptr
                             ? group->restarts.Describe()
                             : absl::StrCat("serves in a smaller shape (", ShapeText(group->smaller->request),
                                            ") until ", group->shape->plan.world_size(),
                                            " workers can hold its own: ", group->restarts.Describe())));
    }
    if (group->smaller != nullptr) status->set_smaller_shape(ShapeText(group->smaller->request));
    for (const v1::RankProgress& p : group->progress) {
      status->set_load_bytes_kept(status->load_bytes_kept() + p.progress().bytes_kept());
      status->set_load_bytes_read(status->load_bytes_read() + p.progress().checkpoint_bytes_read());
    }
    status->set_version(group->shape->version);
    status->set_restarts(group->restarts.restarts());
    status->set_forwards_in_flight(group->forwarding ? 1 : 0);
    status->set_forwards(group->forwards);
    if (runtime.Current(*group)) restarts = std::max(restarts, status->restarts());
  }
  job.set_recovering(absl::StrJoin(recovering, "; "));
  job.set_degraded(absl::StrJoin(degraded, "; "));
  job.set_restarts(restarts);
  if (runtime.autoscaler != nullptr) job.set_utilisation(runtime.autoscaler->Utilisation(options_.autoscale.up_after));
  if (runtime.next != nullptr && job.has_update()) job.mutable_update()->set_progress(UpdateProgressLocked(runtime));
}

v1::JobEvent Scheduler::EventLocked(const v1::Job& job) {
  v1::JobEvent event;
  *event.mutable_job() = job;
  auto runtime = runtimes_.find(job.id());
  if (runtime != runtimes_.end()) {
    for (const auto& [replica, group] : runtime->second->groups) {
      for (const auto& p : group->progress) *event.add_ranks() = p;
    }
  }
  return event;
}

}  // namespace bertshard::server
