#include "server/scheduler.h"

#include <algorithm>
#include <cstdio>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/fault_point.h"
#include "common/grpc_auth.h"
#include "common/secure_random.h"
#include "common/status_macros.h"
#include "planner/planner.h"
#include "server/job_names.h"
#include "server/placement.h"
#include "server/replica_keys.h"
#include "server/shard_loading.h"
#include "server/smaller_shapes.h"

namespace bertshard::server {

Scheduler::Scheduler(const ClusterOptions& options, std::unique_ptr<jobs::JobStore> store, WorkerPool* pool)
    : options_(options), store_(std::move(store)), pool_(pool) {}

absl::StatusOr<std::unique_ptr<Scheduler>> Scheduler::Create(const ClusterOptions& options,
                                                             std::unique_ptr<jobs::JobStore> store, WorkerPool* pool) {
  auto scheduler = std::unique_ptr<Scheduler>(new Scheduler(options, std::move(store), pool));
  {
    absl::MutexLock lock(&scheduler->mu_);
    RETURN_IF_ERROR(scheduler->RecoverJobsLocked());
  }
  scheduler->monitor_ = std::thread([s = scheduler.get()] { s->MonitorLoop(); });
  return scheduler;
}

Scheduler::~Scheduler() { Stop(); }

void Scheduler::Stop() {
  std::vector<std::shared_ptr<JobServing>> servings;
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    for (auto& [id, runtime] : runtimes_) {
      for (auto& [replica, group] : runtime->groups) {
        for (auto& context : group->load_contexts) context->TryCancel();
      }
      if (auto serving = CloseServingLocked(*runtime, "the coordinator is shutting down")) {
        servings.push_back(std::move(serving));
      }
      for (auto& [version, draining] : runtime->draining) {
        if (draining != nullptr) draining->Close("the coordinator is shutting down");
        servings.push_back(std::move(draining));
      }
      runtime->draining.clear();
    }
    changed_.SignalAll();
  }
  if (monitor_.joinable()) monitor_.join();
  threads_.JoinAll();  // no load starts once stopping_ is set, and no batch queue is made
  servings.clear();    // off the lock: a running batch may still take it
}

void Scheduler::Drain() {
  absl::MutexLock lock(&mu_);
  draining_ = true;
  changed_.SignalAll();
}

absl::StatusOr<v1::Job> Scheduler::SubmitJob(const v1::SubmitJobRequest& request, const std::string& client) {
  if (request.request().checkpoint().empty()) {
    return absl::InvalidArgumentError("SubmitJob needs request.checkpoint: the model directory the workers load");
  }
  ASSIGN_OR_RETURN(const std::string backend, NormaliseBackend(request.backend()));
  if (!request.name().empty()) RETURN_IF_ERROR(CheckJobName(request.name()));
  RETURN_IF_ERROR(CheckReplicaBounds(request.min_replicas(), request.max_replicas()));
  const int32_t replicas = request.replicas() != 0 ? request.replicas() : std::max(1, request.min_replicas());
  if (replicas < 1 || replicas > options_.max_replicas) {
    return absl::InvalidArgumentError(
        absl::StrCat("replicas must be 1..", options_.max_replicas, " (--max_replicas), not ", replicas));
  }
  if (request.max_replicas() > 0 && (replicas < request.min_replicas() || replicas > request.max_replicas())) {
    return absl::InvalidArgumentError(absl::StrCat("replicas ", replicas, " is outside the bounds ",
                                                   request.min_replicas(), "..", request.max_replicas()));
  }
  ASSIGN_OR_RETURN(std::shared_ptr<const JobShape> shape, ReadShape(request.request(), backend, 0));
  const v1::ShardPlan& plan = shape->plan;
  absl::MutexLock lock(&mu_);
  if (options_.max_jobs_per_client > 0) {
    // Every job that has not ended has a runtime here (taken back at start, or submitted since),
    // and only those (FailJobLocked erases it): a count over the live jobs, not the history.
    int active = 0;
    for (const auto& [id, runtime] : runtimes_) active += (runtime->submitted_by == client && !runtime->ended) ? 1 : 0;
    if (active >= options_.max_jobs_per_client) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "this client already has ", active, " jobs that have not ended (the limit, --max_jobs_per_client, is ",
          options_.max_jobs_per_client, "): cancel one first"));
    }
  }
  if (!request.name().empty()) {
    for (const auto& [id, runtime] : runtimes_) {
      if (runtime->name == request.name() && !runtime->ended) {
        return absl::AlreadyExistsError(absl::StrCat("job ", id, " is already named '", request.name(),
                                                     "' (names are unique among the jobs that have not ended)"));
      }
    }
  }
  // What the job would wait for now: for NCCL, GPUs that several workers report count once, and
  // the reason says so up front, not NCCL after every rank has loaded.
  const Placement now = PlaceRanks(backend, plan.world_size(), pool_->Idle());
  if (request.fail_if_no_workers()) {
    // Every replica at once, each on its own workers.
    const Placement all = PlaceRanks(backend, plan.world_size() * replicas, pool_->Idle());
    if (all.ranks.empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the job cannot start now: ",
          replicas == 1 ? all.waiting_for
                        : absl::StrCat(replicas, " replicas of ", plan.world_size(), " ranks: ", all.waiting_for)));
    }
  }
  v1::Job job;
  job.set_id(absl::StrCat("job-", absl::ToUnixMillis(absl::Now()), "-", ++next_job_));
  *job.mutable_request() = request.request();
  job.set_submitted_by(client);
  job.set_name(request.name());
  job.set_replicas(replicas);
  job.set_min_replicas(request.min_replicas());
  job.set_max_replicas(request.max_replicas());
  // The class the plan resolved (from the checkpoint's config.json when the request named none),
  // so that listings say what runs.
  job.mutable_request()->set_variant(plan.variant());
  job.set_backend(backend);
  job.set_pending_reason(now.ranks.empty() ? now.waiting_for : "placing its ranks");
  // Job and plan in one write: a full or read-only database refuses the job whole, with the
  // store's code (RESOURCE_EXHAUSTED, FAILED_PRECONDITION), and nothing has started yet.
  RETURN_IF_ERROR(store_->Create(job, &plan));
  auto runtime = std::make_shared<JobRuntime>(options_.restarts);
  runtime->shape = std::move(shape);
  runtime->submitted_by = client;
  runtime->name = request.name();
  runtime->replicas = replicas;
  SetBoundsLocked(*runtime, request.min_replicas(), request.max_replicas());
  runtimes_[job.id()] = runtime;
  for (int32_t r = 0; r < replicas; ++r) AddGroupLocked(job.id(), *runtime, r).reason = job.pending_reason();
  ScheduleLocked();
  changed_.SignalAll();
  return store_->Get(job.id());
}

void Scheduler::ScheduleLocked() {
  if (stopping_ || draining_) return;
  std::vector<PendingGroup> still_pending;
  std::vector<size_t> waiting;    // into still_pending: those no placement fits now, or in backoff
  std::set<std::string> changed;  // jobs whose replicas were placed: recorded once each below
  const absl::Time now = absl::Now();
  next_backoff_end_ = absl::InfiniteFuture();
  const auto backing_off = [now](const GroupRuntime& group) {
    return group.restarts.recovering() && now < group.restarts.not_before();
  };
  for (PendingGroup& pending : pending_) {
    auto runtime = runtimes_.find(pending.job_id);
    if (runtime == runtimes_.end()) continue;
    GroupRuntime* group = runtime->second->Group(pending.replica);
    if (group == nullptr || group->phase != GroupRuntime::Phase::kPending) continue;
    if (backing_off(*group)) {
      // Lost again soon after its last placement: it waits out its backoff (the monitor schedules
      // again when it is over), leaving the workers to the replicas behind it meanwhile.
      next_backoff_end_ = std::min(next_backoff_end_, group->restarts.not_before());
      waiting.push_back(still_pending.size());
      still_pending.push_back(std::move(pending));
      continue;
    }
    const std::vector<IdleWorker> free_workers = pool_->Idle();
    std::vector<IdleWorker> workers;
    if (group->kept.empty()) {
      const Placement placement = PlaceRanks(group->shape->backend, group->shape->plan.world_size(), free_workers);
      for (size_t i : placement.ranks) workers.push_back(free_workers[i]);
    } else {
      workers = PlaceKeepingLocked(*group, *group->shape, free_workers);
    }
    // Too few for its shape: a recovering replica may take a smaller one (sets group->smaller).
    if (workers.empty()) workers = PlaceSmallerLocked(*runtime->second, *group, free_workers);
    if (workers.empty()) {
      waiting.push_back(still_pending.size());
      still_pending.push_back(std::move(pending));
      continue;
    }
    if (!PlanGroupLocked(pending.job_id, *runtime->second, *group, workers)) {
      group->smaller.reset();
      // Its kept workers stay its own (PlanGroupLocked let every worker go).
      for (const v1::RankAssignment& a : group->kept) {
        pool_->Assign(a.worker_id(), ReplicaKey(pending.job_id, group->replica), a.rank());
      }
      still_pending.push_back(std::move(pending));  // PENDING as stored; the monitor tries again
      continue;
    }
    // The kept workers the placement did not take go back to the pool.
    for (const v1::RankAssignment& a : group->kept) {
      const bool taken = std::any_of(workers.begin(), workers.end(),
                                     [&](const IdleWorker& w) { return w.worker_id == a.worker_id(); });
      if (!taken) ReleaseWorkerLocked(a.worker_id(), ReplicaKey(pending.job_id, group->replica));
    }
    group->kept.clear();
    group->kept_from.reset();
    threads_.Start([this, id = pending.job_id, replica = pending.replica, generation = group->generation] {
      LoadGroup(id, replica, generation);
    });
  }
  pending_ = std::move(still_pending);
  // Why the others wait, against the pool as the replicas placed above left it; written only when
  // it changed (a worker came or went, reported a GPU another holds).
  const std::vector<IdleWorker> free_workers = pool_->Idle();
  for (size_t i : waiting) {
    const PendingGroup& pending = pending_[i];
    JobRuntime& runtime = *runtimes_.at(pending.job_id);
    GroupRuntime& group = *runtime.Group(pending.replica);
    const std::string why =
        backing_off(group)
            ? absl::StrCat("placing it again from ",
                           absl::FormatTime("%H:%M:%E3S UTC", group.restarts.not_before(), absl::UTCTimeZone()),
                           " (backoff: ", group.restarts.restarts(), " losses in a row)")
            : PlaceRanks(group.shape->backend, group.shape->plan.world_size(), free_workers).waiting_for;
    std::string reason = group.pending_note.empty() ? why : absl::StrCat(group.pending_note, "; ", why);
    int kept = 0;
    for (const v1::RankAssignment& a : group.kept) kept += HealthyWorkerLocked(a.worker_id()).has_value() ? 1 : 0;
    if (kept > 0) absl::StrAppend(&reason, " (", kept, " of its own workers kept for it)");
    if (group.reason == reason) continue;
    group.reason = reason;
    changed.insert(pending.job_id);
  }
  for (const std::string& job_id : changed) {
    RecordLocked(RecordJobLocked(job_id, *runtimes_.at(job_id), ""), "recording the pending reason of " + job_id);
  }
  GrowBackWhereRoomLocked();  // queues replicas again: after `waiting`'s indices into pending_ are used
  changed_.SignalAll();
}

bool Scheduler::PlanGroupLocked(const std::string& job_id, JobRuntime& runtime, GroupRuntime& group,
                                const std::vector<IdleWorker>& workers) {
  const std::string key = ReplicaKey(job_id, group.replica);
  group.generation = ++generations_;  // a load of an earlier placement, still winding down, is not this one
  group.next_sequence = 0;
  group.forwards = 0;
  group.ranks.clear();
  group.progress.clear();
  for (size_t r = 0; r < workers.size(); ++r) {
    pool_->Assign(workers[r].worker_id, key, static_cast<int32_t>(r));
    v1::RankAssignment a;
    a.set_rank(static_cast<int32_t>(r));
    a.set_worker_id(workers[r].worker_id);
    a.set_worker_address(workers[r].address);
    a.set_replica(group.replica);
    MarkSmallerLocked(group, a);
    group.ranks.push_back(a);
    v1::RankProgress p;
    p.set_rank(a.rank());
    p.set_worker_id(a.worker_id());
    p.set_replica(group.replica);
    group.progress.push_back(p);
  }
  group.phase = GroupRuntime::Phase::kPlanned;
  std::string assigned = runtime.replicas == 1
                             ? absl::StrCat(workers.size(), " workers assigned")
                             : absl::StrCat(workers.size(), " workers assigned to replica ", group.replica);
  if (group.smaller != nullptr) {
    absl::StrAppend(&assigned, " in a smaller shape, ", ShapeText(group.smaller->request), " (too few idle for ",
                    group.shape->plan.world_size(), ")");
  }
  const absl::Status recorded = RecordJobLocked(job_id, runtime, assigned);
  if (recorded.ok()) return true;
  // Not recorded, so not started: the replica stays PENDING as stored, with no ranks, its workers
  // stay free, and the monitor tries again every quarter interval until the database takes it (a
  // restarted coordinator would see the same).
  StoreErrorLocked(absl::StrCat("planning job ", job_id), recorded);
  for (const IdleWorker& w : workers) pool_->Unassign(w.worker_id);
  group.phase = GroupRuntime::Phase::kPending;
  group.ranks.clear();
  group.progress.clear();
  schedule_retry_ = true;
  return false;
}

struct Scheduler::Load {
  std::string job_id;
  int32_t replica = 0;
  std::string key;         // ReplicaKey(job_id, replica): what its workers know it by
  int64_t generation = 0;  // the replica's placement this load is for
  std::shared_ptr<JobRuntime> runtime;
  std::shared_ptr<const JobShape> shape;  // the replica's shape (the job's, or an update's)
  std::shared_ptr<const JobShape> runs;   // what it loads: `shape`, or a smaller one of it
  std::vector<RankStub> ranks;            // copied: a worker registering again may change the group's ranks
};

void Scheduler::LoadGroup(const std::string& job_id, int32_t replica, int64_t generation) {
  // The job is PLANNED here, and stays so until BeginLoad: fault tests hold it in that window.
  common::PausePoint("coordinator_planned");
  const std::optional<Load> load = BeginLoad(job_id, replica, generation);
  if (!load.has_value()) return;
  // A secret per load attempt, held only here and in the requests (never in the job store or a
  // log): the ranks prove it to the rendezvous, which refuses anyone else (worker/auth_store.h).
  const absl::StatusOr<std::string> secret = common::SecureRandomBytes(32);
  const absl::StatusOr<int32_t> port = secret.ok() ? ReserveRendezvousPort(load->ranks[0], load->key, *secret)
                                                   : absl::StatusOr<int32_t>(secret.status());
  if (!port.ok()) {
    absl::MutexLock lock(&mu_);
    // Stopping: the job stays LOADING for the next coordinator, which places it again.
    LoseGroupLocked(job_id, replica, generation, std::string(port.status().message()), "", /*keep_workers=*/false);
    return;
  }
  const std::vector<std::shared_ptr<grpc::ClientContext>> contexts = LoadContexts(*load);
  if (contexts.empty()) return;
  FinishLoad(*load, LoadShards(*load, *port, *secret, contexts));
}

std::optional<Scheduler::Load> Scheduler::BeginLoad(const std::string& job_id, int32_t replica, int64_t generation) {
  absl::MutexLock lock(&mu_);
  // Between planning and here (the PLANNED window) the job may have been cancelled or scaled down,
  // and a worker may have registered again under a new id: none of these may start a load.
  auto job = store_->Get(job_id);
  auto found = runtimes_.find(job_id);
  if (stopping_ || !job.ok() || TerminalState(job->state()) || found == runtimes_.end()) return std::nullopt;
  GroupRuntime* group = found->second->Group(replica);
  // Lost and placed again in that window: the later placement's own load runs.
  if (group == nullptr || group->generation != generation || group->phase != GroupRuntime::Phase::kPlanned) {
    return std::nullopt;
  }
  Load load{job_id,
            replica,
            ReplicaKey(job_id, replica),
            generation,
            found->second,
            group->shape,
            group->smaller != nullptr ? group->smaller : group->shape,
            {}};
  absl::StatusOr<std::vector<WorkerStub>> stubs = pool_->Stubs(group->WorkerIds());
  if (!stubs.ok()) {
    LoseGroupLocked(job_id, replica, generation,
                    absl::StrCat(stubs.status().message(), " before the job began loading"));
    return std::nullopt;
  }
  for (WorkerStub& s : *stubs) {
    load.ranks.push_back({s.worker_id, s.address, std::move(s.stub), options_.worker_token, std::move(s.health)});
  }
  group->phase = GroupRuntime::Phase::kLoading;
  if (absl::Status s = RecordJobLocked(job_id, *found->second, ""); !s.ok()) {
    // Nothing is loaded yet; a job the database cannot follow is not started.
    StoreErrorLocked(absl::StrCat("loading job ", job_id), s);
    FailJobLocked(job_id, absl::StrCat("the job database could not record the load: ", s.message()));
    return std::nullopt;
  }
  changed_.SignalAll();
  return load;
}

std::vector<std::shared_ptr<grpc::ClientContext>> Scheduler::LoadContexts(const Load& load) {
  // Every rank's load context is registered at once, and only while the job has not ended: a
  // cancel or failure while the port was being reserved found no context to cancel, and must not
  // be followed by loads of the ended job on workers that are idle again or serve another job
  // (tests/cluster_cancel_test.cc, CancelPendingAndLoadingJobs). Stopping: nothing would cancel
  // loads started now; the job stays LOADING for the next coordinator.
  std::vector<std::shared_ptr<grpc::ClientContext>> contexts;
  absl::MutexLock lock(&mu_);
  GroupRuntime* group = load.runtime->Group(load.replica);
  if (stopping_ || load.runtime->ended || group == nullptr || group->generation != load.generation) return contexts;
  for (const RankStub& rank : load.ranks) {
    auto context = std::make_shared<grpc::ClientContext>();
    context->set_deadline(absl::ToChronoTime(absl::Now() + options_.load_timeout));
    common::AttachToken(context.get(), rank.token);
    group->load_contexts.push_back(context);
    contexts.push_back(std::move(context));
  }
  return contexts;
}

bool Scheduler::LoadShards(const Load& load, int32_t port, const std::string& secret,
                           const std::vector<std::shared_ptr<grpc::ClientContext>>& contexts) {
  v1::LoadShardRequest request;
  request.set_job_id(load.key);
  *request.mutable_plan() = load.runs->plan;
  request.set_checkpoint(load.runs->checkpoint);
  request.set_backend(load.runs->backend);
  request.set_master_addr(HostOf(load.ranks[0].address));
  request.set_master_port(port);
  request.set_rendezvous_secret(secret);
  request.set_timeout_seconds(options_.collective_timeout_seconds);
  // A worker the replica kept takes what it holds of it (scheduler_smaller.cc); others hold nothing.
  request.set_keep_held(options_.smaller_shapes);
  return LoadShardsOnRanks(
      load.ranks, request, contexts,
      [&](size_t rank, const v1::LoadProgress& progress) {
        absl::MutexLock lock(&mu_);
        GroupRuntime* group = load.runtime->Group(load.replica);
        if (group == nullptr || group->generation != load.generation) return;  // the group was lost
        *group->progress[rank].mutable_progress() = progress;
        changed_.SignalAll();
      },
      [&](size_t /*rank*/, const absl::Status& failure) {
        absl::MutexLock lock(&mu_);
        // Stopping: see LoadContexts.
        if (stopping_ || load.runtime->ended) return;
        GroupRuntime* group = load.runtime->Group(load.replica);
        if (group == nullptr) return;  // scaled away meanwhile
        // Late news of an older group: its placement is long gone, and the job may serve again.
        const bool lost_by_this_load =
            group->lost_from == load.generation && group->phase == GroupRuntime::Phase::kPending;
        // With another replica serving, the job goes on; this replica is lost like any (a spare
        // without the checkpoint mounted says NOT_FOUND, another worker may have it).
        const bool others_serve = load.runtime->ServingGroups() > 0;
        const absl::optional<absl::Cord> unreachable = failure.GetPayload(kUnreachableWorkerPayload);
        if (load.runs != load.shape) {
          // (A later rank's failure of the same load finds it handled.)
          if (group->generation != load.generation) return;
          const std::string why =
              absl::StrCat(failure.message(), " (loading the smaller shape ", ShapeText(load.runs->request), ")");
          const std::string down = unreachable.has_value() ? std::string(*unreachable) : "";
          if (LoadCanNeverSucceed(failure) || failure.code() == absl::StatusCode::kResourceExhausted) {
            // Refused for what it is (the workers cannot hold it, say): the replica waits for its
            // own shape from now on; no restart is spent and the job does not end for it.
            GiveUpSmallerLocked(load.job_id, *load.runtime, *group, why, down);
          } else {
            // A worker lost in the load: a loss like any (it may come back smaller again).
            LoseGroupLocked(load.job_id, load.replica, load.generation, why, down, /*keep_workers=*/false);
          }
          return;
        }
        // Not NOT_FOUND: one worker without the new checkpoint mounted is lost like any (another may
        // have it); past --max_restarts that ends the update too (LoseGroupLocked).
        if (LoadCanNeverSucceed(failure) && failure.code() != absl::StatusCode::kNotFound &&
            load.shape == load.runtime->next && (group->generation == load.generation || lost_by_this_load)) {
          // An update to files or a shape the workers refuse: it ends, and the old shape serves on.
          AbortUpdateLocked(load.job_id, *load.runtime,
                            absl::StrCat("its new replica ", load.replica, " could not load: ", failure.message()));
          return;
        }
        if (LoadCanNeverSucceed(failure) && !others_serve &&
            (group->generation == load.generation || lost_by_this_load)) {
          // The checkpoint or the request is wrong: loading it again would meet the same refusal. So
          // even when another rank's failure of this load lost the group first (it is not placed
          // again yet), the job ends here.
          FailJobLocked(load.job_id, std::string(failure.message()));
          return;
        }
        // Its workers are not kept (--smaller_shapes): one of them may be what fails the load.
        LoseGroupLocked(load.job_id, load.replica, load.generation, std::string(failure.message()),  // late: nothing
                        unreachable.has_value() ? std::string(*unreachable) : "", /*keep_workers=*/false);
      });
}

void Scheduler::FinishLoad(const Load& load, bool all_loaded) {
  absl::MutexLock lock(&mu_);
  GroupRuntime* group = load.runtime->Group(load.replica);
  if (load.runtime->ended || group == nullptr || group->generation != load.generation) return;
  group->load_contexts.clear();
  if (!all_loaded) return;
  group->phase = GroupRuntime::Phase::kServing;
  if (absl::Status s = RecordJobLocked(load.job_id, *load.runtime, ""); !s.ok()) {
    // Serving a job the database still calls LOADING would be lost at the next restart.
    StoreErrorLocked(absl::StrCat("readying job ", load.job_id), s);
    FailJobLocked(load.job_id, absl::StrCat("the job database could not record it READY: ", s.message()));
    return;
  }
  // In a smaller shape it still recovers (degraded, and waiting to grow back).
  if (group->smaller == nullptr) {
    group->restarts.Served(absl::Now());
    group->smaller_refused = false;
  }
  group->pending_note.clear();
  group->reason.clear();
  group->idle_since = absl::Now();
  UpdateLanesLocked(*load.runtime);
  if (load.runtime->next != nullptr) AdvanceUpdateLocked(load.job_id, *load.runtime);  // may switch now
  changed_.SignalAll();  // batches waiting for a replica (NextForward) go on
}

void Scheduler::FailJobLocked(const std::string& job_id, const std::string& cause, v1::JobState state) {
  auto job = store_->Get(job_id);
  if (!job.ok() || TerminalState(job->state())) return;
  // An update that runs ends with the job (an ended job keeps no update to go on with).
  if (auto runtime = runtimes_.find(job_id); runtime != runtimes_.end() && runtime->second->next != nullptr) {
    RecordLocked(store_
                     ->SetUpdate(job_id, nullptr,
                                 absl::StrCat("version ", runtime->second->next->version, ": ended with the job (",
                                              v1::JobState_Name(state), ")"))
                     .status(),
                 absl::StrCat("ending the update of job ", job_id));
  }
  // Unrecorded, the job still ends here (its workers are freed); the database keeps its last
  // recorded state, which a restarted coordinator settles like any job it finds without ranks.
  if (absl::Status s = store_->Transition(job_id, state, cause).status(); !s.ok()) {
    StoreErrorLocked(absl::StrCat("ending job ", job_id, " as ", v1::JobState_Name(state), " (", cause, ")"), s);
  }
  pending_.erase(
      std::remove_if(pending_.begin(), pending_.end(), [&](const PendingGroup& p) { return p.job_id == job_id; }),
      pending_.end());
  auto runtime = runtimes_.find(job_id);
  std::vector<std::string> keys;
  if (runtime != runtimes_.end()) {
    for (const auto& [replica, group] : runtime->second->groups) keys.push_back(ReplicaKey(job_id, replica));
  }
  if (runtime != runtimes_.end()) {
    const std::string why = absl::StrCat("job ", job_id, " is ", v1::JobState_Name(state), ": ", cause);
    runtime->second->ended = true;
    for (auto& [replica, group] : runtime->second->groups) {
      for (auto& context : group->load_contexts) context->TryCancel();
      group->forward_abort->Abort(why);
      group->recovery.reset();
      group->phase = GroupRuntime::Phase::kPending;
    }
    if (auto serving = CloseServingLocked(*runtime->second, why)) {
      // (No JobServing exists once stopping_ is set: see WithServingRuntime.)
      threads_.Start([serving = std::move(serving)]() mutable { serving.reset(); });
    }
    for (auto& [version, draining] : runtime->second->draining) {
      if (draining == nullptr) continue;
      draining->Close(why);
      threads_.Start([serving = std::move(draining)]() mutable { serving.reset(); });
    }
    runtime->second->draining.clear();
    // An ended job keeps nothing here: what it was is in the store, and a load still running holds
    // the runtime (Load) only until it sees `ended`. Kept, 2,500 submit-and-cancel cycles grew the
    // coordinator by 200 MiB and its /metrics by a line per ended job.
    runtimes_.erase(runtime);
  }
  for (const std::string& key : keys) {
    for (const WorkerStub& w : pool_->Release(key)) {
      if (stopping_) break;
      UnloadInBackground(w.stub, key, options_.worker_token);  // survivors drop their shard
    }
  }
  changed_.SignalAll();
  ScheduleLocked();
}

std::shared_ptr<JobServing> Scheduler::CloseServingLocked(JobRuntime& runtime, const std::string& why) {
  std::shared_ptr<JobServing> serving = std::move(runtime.job_serving);
  runtime.job_serving = nullptr;
  if (serving != nullptr) serving->Close(why);  // waiting requests fail now
  return serving;
}

void Scheduler::StoreErrorLocked(const std::string& what, const absl::Status& status) {
  // Once per distinct failure: a refusal retried every quarter interval would flood the log.
  std::string line = absl::StrCat("bertshard-coordinator: job database: ", what, ": ", status.ToString());
  if (line == last_store_error_) return;
  std::fprintf(stderr, "%s\n", line.c_str());
  last_store_error_ = std::move(line);
}

void Scheduler::RecordLocked(const absl::Status& status, const std::string& what) {
  if (!status.ok()) StoreErrorLocked(what, status);
}

void Scheduler::MonitorLoop() {
  absl::MutexLock lock(&mu_);
  while (!stopping_) {
    // Checked every quarter interval against `missed_heartbeats` intervals of silence: a dead
    // worker's jobs fail within missed_heartbeats + 1/4 intervals of its last heartbeat.
    // Sooner when a restart's backoff ends first.
    // Not while draining: nothing is scheduled then, so a backoff that has ended stays in
    // next_backoff_end_ and would make this wait return at once, again and again.
    absl::Duration pass = options_.heartbeat_interval / 4;
    // A shape switched away from unloads once nothing holds its request path: looked for often
    // while one drains (its workers are wanted by the new shape's replicas), not only each pass.
    for (const auto& [id, runtime] : runtimes_) {
      if (!runtime->draining.empty()) pass = std::min(pass, absl::Milliseconds(50));
      // Autoscaled jobs are sampled at least every quarter second.
      if (runtime->autoscaler != nullptr) pass = std::min(pass, absl::Milliseconds(250));
    }
    const absl::Time wake = absl::Now() + pass;
    changed_.WaitWithDeadline(&mu_, draining_ ? wake : std::min(wake, next_backoff_end_));
    if (stopping_) break;
    // A draining server takes no heartbeats: silence then says nothing about the workers.
    if (draining_) continue;
    if (schedule_retry_) {
      schedule_retry_ = false;  // set again by a planning the database refuses again
      ScheduleLocked();
    }
    const absl::Time now = absl::Now();
    // All the silent ones are out of the pool before any job fails: a job placed in answer to one
    // failure takes none of the others.
    const std::vector<WorkerDeparture> silent = pool_->TakeSilent(now);
    for (const WorkerDeparture& d : silent) {
      LoseWorkersGroupLocked(d.info,
                             absl::StrCat("stopped heartbeating (silent for ", absl::FormatDuration(d.silent), ")"));
    }
    if (!silent.empty()) ScheduleLocked();
    std::vector<std::string> overdue;  // replicas' keys
    for (const auto& [job_id, runtime] : runtimes_) {
      for (const auto& [replica, group] : runtime->groups) {
        if (group->recovery != nullptr && now >= group->recovery->deadline) {
          overdue.push_back(ReplicaKey(job_id, replica));
        }
      }
    }
    for (const std::string& key : overdue) DecideRecoveryLocked(key);
    if (now >= next_backoff_end_) ScheduleLocked();  // a restart's backoff is over
    AdvanceUpdatesLocked();
    AutoscaleLocked(now);
    SweepEndedJobsLocked(now);
  }
}

absl::StatusOr<v1::Job> Scheduler::GetJobLocked(const std::string& id) {
  ASSIGN_OR_RETURN(v1::Job job, store_->Get(id));
  FillRuntimeFieldsLocked(job);
  return job;
}

absl::StatusOr<v1::Job> Scheduler::GetJob(const std::string& id) {
  absl::MutexLock lock(&mu_);
  return GetJobLocked(id);
}

absl::StatusOr<jobs::JobStore::Page> Scheduler::ListJobs(int page_size, const std::string& page_token) {
  // One page, read before the lock that the serving path takes.
  ASSIGN_OR_RETURN(jobs::JobStore::Page page, store_->ListPage(page_size, page_token));
  absl::MutexLock lock(&mu_);
  for (v1::Job& job : page.jobs) FillRuntimeFieldsLocked(job);
  return page;
}

absl::StatusOr<std::map<v1::JobState, int64_t>> Scheduler::CountJobsByState() { return store_->CountByState(); }

void Scheduler::SweepEndedJobsLocked(absl::Time now) {
  if (options_.job_retention == absl::InfiniteDuration() || now < next_retention_sweep_) return;
  next_retention_sweep_ = now + options_.retention_sweep_interval;
  // In bounded batches, so that a first sweep over a long history holds the lock briefly each
  // time; what is left goes at the next sweeps.
  constexpr int kBatch = 500;
  absl::StatusOr<int> deleted = store_->DeleteEndedBefore(absl::ToUnixMillis(now - options_.job_retention), kBatch);
  RecordLocked(deleted.status(), "deleting ended jobs past --job_retention");
  if (deleted.ok() && *deleted == kBatch) next_retention_sweep_ = now;  // more to go: again next pass
}

absl::StatusOr<v1::Job> Scheduler::CancelJob(const std::string& id) {
  absl::MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(v1::Job job, store_->Get(id));
  if (TerminalState(job.state())) {
    return absl::FailedPreconditionError(absl::StrCat("job ", id, " is already ", v1::JobState_Name(job.state())));
  }
  FailJobLocked(id, "cancelled by request", v1::CANCELLED);
  return GetJobLocked(id);
}

absl::Status Scheduler::WatchJob(const std::string& id, absl::Time deadline,
                                 const std::function<bool(const v1::JobEvent&)>& emit,
                                 const std::function<bool()>& cancelled, bool all_replicas) {
  // Every replica the job wants READY, as Job.replica_status shows them.
  const auto every_replica = [](const v1::Job& job) {
    if (job.replica_status_size() < std::max(1, job.replicas())) return false;
    for (const v1::ReplicaStatus& r : job.replica_status()) {
      if (r.state() != v1::READY) return false;
    }
    return true;
  };
  std::string last;
  while (true) {
    v1::JobEvent event;
    {
      absl::MutexLock lock(&mu_);
      ASSIGN_OR_RETURN(v1::Job job, GetJobLocked(id));
      event = EventLocked(job);
      // Forwards run are no change to watch for (under load they change at every forward).
      v1::JobEvent compared = event;
      for (v1::ReplicaStatus& r : *compared.mutable_job()->mutable_replica_status()) {
        r.clear_forwards();
        r.clear_forwards_in_flight();
      }
      std::string now = compared.SerializeAsString();
      if (now == last) {
        if (absl::Now() >= deadline) {
          return absl::DeadlineExceededError(absl::StrCat("job ", id, " is still ", v1::JobState_Name(job.state())));
        }
        if (cancelled && cancelled()) return absl::CancelledError("watcher went away");
        changed_.WaitWithDeadline(&mu_, std::min(deadline, absl::Now() + absl::Milliseconds(500)));
        continue;
      }
      last = std::move(now);
    }
    if (!emit(event)) return absl::CancelledError("watcher went away");
    const v1::JobState s = event.job().state();
    if (TerminalState(s) || (s == v1::READY && event.job().recovering().empty() &&
                             (!all_replicas || (every_replica(event.job()) && !event.job().has_update())))) {
      return absl::OkStatus();
    }
  }
}

void Scheduler::ForEachRuntime(const std::function<void(const std::string& job_id, JobRuntime& runtime)>& visit) {
  absl::MutexLock lock(&mu_);
  for (auto& [id, runtime] : runtimes_) visit(id, *runtime);
}

}  // namespace bertshard::server
