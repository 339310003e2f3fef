#include "server/cluster.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/fault_point.h"
#include "common/grpc_auth.h"
#include "common/grpc_status.h"
#include "common/status_macros.h"
#include "grpcpp/grpcpp.h"
#include "planner/model_config.h"
#include "planner/planner.h"
#include "server/cluster_internal.h"
#include "server/rank_fanout.h"
#include "server/readoption.h"

namespace bertshard::server {
namespace {

void SetDeadline(grpc::ClientContext* context, absl::Time deadline) {
  context->set_deadline(absl::ToChronoTime(deadline));
}

}  // namespace

Cluster::Cluster(const ClusterOptions& options, std::unique_ptr<jobs::JobStore> store)
    : options_(options),
      store_(std::move(store)),
      incarnation_(absl::StrCat(absl::Hex(absl::ToUnixMillis(absl::Now()) & 0xffffffffff))) {}

absl::StatusOr<std::unique_ptr<Cluster>> Cluster::Create(const ClusterOptions& options) {
  ASSIGN_OR_RETURN(auto store, jobs::JobStore::Open(options.database_path));
  auto cluster = std::unique_ptr<Cluster>(new Cluster(options, std::move(store)));
  {
    absl::MutexLock lock(&cluster->mu_);
    RETURN_IF_ERROR(cluster->RecoverJobsLocked());
  }
  cluster->monitor_ = std::thread([c = cluster.get()] { c->MonitorLoop(); });
  return cluster;
}

void Cluster::Drain() {
  absl::MutexLock lock(&mu_);
  draining_ = true;
  changed_.SignalAll();
}

Cluster::~Cluster() {
  std::vector<std::thread> threads;
  std::vector<std::shared_ptr<JobServing>> servings;
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    for (auto& [id, runtime] : runtimes_) {
      for (auto& context : runtime->load_contexts) context->TryCancel();
      if (runtime->job_serving != nullptr) {
        runtime->job_serving->Close("the coordinator is shutting down");
        servings.push_back(std::move(runtime->job_serving));
      }
    }
    threads.swap(threads_);
    changed_.SignalAll();
  }
  monitor_.join();
  for (auto& t : threads) t.join();  // no new ones start once stopping_ is set
  servings.clear();                  // off the lock: a running batch may still take it
}

v1::RegisterWorkerResponse Cluster::RegisterWorker(const v1::RegisterWorkerRequest& request) {
  absl::MutexLock lock(&mu_);
  // A worker registering again from the same address lost touch with us. It keeps a job it
  // still holds; any other job that relied on it fails.
  std::string kept_job;
  int32_t kept_rank = 0;
  for (auto it = workers_.begin(); it != workers_.end(); ++it) {
    if (it->second->info.address() != request.address()) continue;
    const std::string old_job = it->second->info.job_id();
    const std::string old_id = it->first;
    const int32_t old_rank = it->second->info.rank();
    it->second->info.set_healthy(false);
    it->second->info.clear_job_id();
    auto runtime = runtimes_.find(old_job);
    if (runtime != runtimes_.end() && runtime->second->recovery != nullptr) {
      // Its report counts again when it comes with this registration.
      auto& reports = runtime->second->recovery->reports;
      reports.erase(
          std::remove_if(reports.begin(), reports.end(), [&](const RankReport& r) { return r.worker_id == old_id; }),
          reports.end());
    } else if (!old_job.empty()) {
      const v1::HeldShard* shard = nullptr;
      for (const v1::HeldShard& h : request.held()) {
        if (h.job_id() == old_job && h.rank() == old_rank) shard = &h;
      }
      auto job = store_->Get(old_job);
      if (shard != nullptr && shard->broken().empty() && runtime != runtimes_.end() && job.ok() &&
          !TerminalState(job->state())) {
        kept_job = old_job;
        kept_rank = old_rank;
      } else {
        FailJobLocked(
            old_job,
            absl::StrCat(
                "worker ", old_id, " (rank ", old_rank, ") at ", request.address(), " registered again ",
                shard == nullptr ? "without its shard" : absl::StrCat("with its shard broken: ", shard->broken())));
      }
    }
    workers_.erase(old_id);
    break;
  }
  std::string id = request.previous_worker_id();
  // Ids carry this coordinator's incarnation: a worker still heartbeating with an id from before
  // a restart must get NOT_FOUND (and register again), not someone else's entry.
  if (id.empty() || workers_.count(id)) id = absl::StrCat("worker-", ++next_worker_, "-", incarnation_);
  auto worker = std::make_unique<Worker>();
  worker->info.set_worker_id(id);
  worker->info.set_address(request.address());
  worker->info.set_device(request.device().empty() ? "cpu" : request.device());
  worker->info.set_gpu_bus_id(request.gpu_bus_id());
  worker->info.set_free_memory_bytes(request.free_memory_bytes());
  worker->info.set_healthy(true);
  worker->last_heartbeat = absl::Now();
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(1 << 30);
  args.SetMaxSendMessageSize(1 << 30);
  auto channel = grpc::CreateCustomChannel(
      request.address(),
      options_.worker_credentials != nullptr ? options_.worker_credentials : grpc::InsecureChannelCredentials(), args);
  worker->stub = v1::Worker::NewStub(channel);
  worker->health = grpc::health::v1::Health::NewStub(channel);
  Worker* w = worker.get();
  workers_[id] = std::move(worker);
  if (!kept_job.empty()) {
    JobRuntime& runtime = *runtimes_.at(kept_job);
    w->info.set_job_id(kept_job);
    w->info.set_rank(kept_rank);
    const size_t r = static_cast<size_t>(kept_rank);
    if (r < runtime.rank_workers.size()) runtime.rank_workers[r] = id;
    if (r < runtime.progress.size()) runtime.progress[r].set_worker_id(id);
    auto job = store_->Get(kept_job);
    if (job.ok() && kept_rank < job->ranks_size()) {
      std::vector<v1::RankAssignment> ranks(job->ranks().begin(), job->ranks().end());
      ranks[r].set_worker_id(id);
      ranks[r].set_worker_address(request.address());
      RecordLocked(store_->SetRanks(kept_job, ranks).status(),
                   absl::StrCat("moving job ", kept_job, "'s rank ", r, " to worker ", id));
    }
  }
  v1::RegisterWorkerResponse response;
  TakeHeldShardsLocked(w, request.held(), response.mutable_unload_job_ids());
  ScheduleLocked();
  response.set_worker_id(id);
  response.set_heartbeat_interval_ms(static_cast<int32_t>(absl::ToInt64Milliseconds(options_.heartbeat_interval)));
  return response;
}

absl::StatusOr<v1::HeartbeatResponse> Cluster::Heartbeat(const v1::HeartbeatRequest& request) {
  absl::MutexLock lock(&mu_);
  auto it = workers_.find(request.worker_id());
  if (it == workers_.end()) {
    return absl::NotFoundError(absl::StrCat("unknown worker ", request.worker_id(), "; register again"));
  }
  v1::HeartbeatResponse response;
  if (request.leaving()) {
    // Out of the pool now: a job scheduled onto it in the heartbeats' grace period would fail.
    MarkUnhealthyLocked(it->first, *it->second, "is shutting down");
    ScheduleLocked();  // the pool is smaller: what waiting jobs say they wait for changes
    return response;
  }
  it->second->last_heartbeat = absl::Now();
  it->second->info.set_free_memory_bytes(request.free_memory_bytes());
  const bool was_idle = it->second->info.job_id().empty();
  TakeHeldShardsLocked(it->second.get(), request.held(), response.mutable_unload_job_ids());
  if (!it->second->info.healthy()) {
    it->second->info.set_healthy(true);  // back after a pause: its old job has already failed
    ScheduleLocked();
  } else if (was_idle && !it->second->info.job_id().empty()) {
    ScheduleLocked();  // taken back by a recovering job: out of the idle pool
  }
  return response;
}

v1::ListWorkersResponse Cluster::ListWorkers() {
  absl::MutexLock lock(&mu_);
  v1::ListWorkersResponse response;
  for (const auto& [id, w] : workers_) {
    v1::WorkerInfo* info = response.add_workers();
    *info = w->info;
    info->set_last_heartbeat_unix_millis(absl::ToUnixMillis(w->last_heartbeat));
  }
  return response;
}

absl::StatusOr<v1::PlanRequest> Cluster::LocalRequest(const v1::PlanRequest& request) const {
  v1::PlanRequest local = request;
  if (!request.checkpoint().empty()) {
    ASSIGN_OR_RETURN(std::string dir, options_.model_root.Resolve(request.checkpoint()));
    local.set_checkpoint(dir);
  }
  return local;
}

absl::StatusOr<v1::Job> Cluster::SubmitJob(const v1::SubmitJobRequest& request, const std::string& client) {
  if (request.request().checkpoint().empty()) {
    return absl::InvalidArgumentError("SubmitJob needs request.checkpoint: the model directory the workers load");
  }
  ASSIGN_OR_RETURN(const std::string backend, NormaliseBackend(request.backend()));
  ASSIGN_OR_RETURN(const v1::PlanRequest local, LocalRequest(request.request()));
  ASSIGN_OR_RETURN(v1::ShardPlan plan, planner::Plan(local));
  absl::MutexLock lock(&mu_);
  if (options_.max_jobs_per_client > 0) {
    ASSIGN_OR_RETURN(const std::vector<v1::Job> jobs, store_->List());
    int active = 0;
    for (const v1::Job& j : jobs) active += (j.submitted_by() == client && !TerminalState(j.state())) ? 1 : 0;
    if (active >= options_.max_jobs_per_client) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "this client already has ", active, " jobs that have not ended (the limit, --max_jobs_per_client, is ",
          options_.max_jobs_per_client, "): cancel one first"));
    }
  }
  // What the job would wait for now: for NCCL, GPUs that several workers report count once, and
  // the reason says so up front, not NCCL after every rank has loaded.
  const Placement now = PlaceRanks(backend, plan.world_size(), IdleWorkersLocked());
  if (now.ranks.empty() && request.fail_if_no_workers()) {
    return absl::FailedPreconditionError(absl::StrCat("the job cannot start now: ", now.waiting_for));
  }
  v1::Job job;
  job.set_id(absl::StrCat("job-", absl::ToUnixMillis(absl::Now()), "-", ++next_job_));
  *job.mutable_request() = request.request();
  job.set_submitted_by(client);
  // The class the plan resolved (from the checkpoint's config.json when the request named none),
  // so that listings say what runs.
  job.mutable_request()->set_variant(plan.variant());
  job.set_backend(backend);
  job.set_pending_reason(now.ranks.empty() ? now.waiting_for : "placing its ranks");
  // Job and plan in one write: a full or read-only database refuses the job whole, with the
  // store's code (RESOURCE_EXHAUSTED, FAILED_PRECONDITION), and nothing has started yet.
  RETURN_IF_ERROR(store_->Create(job, &plan));
  auto runtime = std::make_shared<JobRuntime>();
  runtime->plan = std::move(plan);
  runtime->checkpoint = request.request().checkpoint();
  runtime->backend = backend;
  runtimes_[job.id()] = runtime;
  ScheduleLocked();
  changed_.SignalAll();
  return store_->Get(job.id());
}

std::vector<IdleWorker> Cluster::IdleWorkersLocked() const {
  std::vector<IdleWorker> idle;
  for (const auto& [id, w] : workers_) {
    if (w->info.healthy() && w->info.job_id().empty()) {
      idle.push_back({id, w->info.address(), w->info.device(), w->info.gpu_bus_id()});
    }
  }
  return idle;
}

void Cluster::ScheduleLocked() {
  if (stopping_ || draining_) return;
  auto jobs = store_->List();
  if (!jobs.ok()) return;
  std::vector<const v1::Job*> waiting;  // still PENDING once every job that can start has
  for (const v1::Job& job : *jobs) {
    if (job.state() != v1::PENDING) continue;
    auto runtime = runtimes_.find(job.id());
    if (runtime == runtimes_.end()) continue;
    const int need = runtime->second->plan.world_size();
    const std::vector<IdleWorker> free_workers = IdleWorkersLocked();
    const Placement placement = PlaceRanks(runtime->second->backend, need, free_workers);
    if (placement.ranks.empty()) {
      waiting.push_back(&job);
      continue;
    }
    std::vector<Worker*> idle;
    for (size_t i : placement.ranks) idle.push_back(workers_.at(free_workers[i].worker_id).get());
    std::vector<v1::RankAssignment> ranks;
    runtime->second->rank_workers.clear();
    runtime->second->progress.clear();
    for (int r = 0; r < need; ++r) {
      idle[static_cast<size_t>(r)]->info.set_job_id(job.id());
      idle[static_cast<size_t>(r)]->info.set_rank(r);
      v1::RankAssignment a;
      a.set_rank(r);
      a.set_worker_id(idle[static_cast<size_t>(r)]->info.worker_id());
      a.set_worker_address(idle[static_cast<size_t>(r)]->info.address());
      ranks.push_back(a);
      runtime->second->rank_workers.push_back(a.worker_id());
      v1::RankProgress p;
      p.set_rank(r);
      p.set_worker_id(a.worker_id());
      runtime->second->progress.push_back(p);
    }
    absl::Status recorded = store_->SetRanks(job.id(), ranks).status();
    if (recorded.ok())
      recorded = store_->Transition(job.id(), v1::PLANNED, absl::StrCat(need, " workers assigned")).status();
    if (!recorded.ok()) {
      // Not recorded, so not started: the job stays PENDING as stored, with no ranks, its workers
      // stay free, and the monitor tries again every quarter interval until the database takes it
      // (a restarted coordinator would see the same).
      StoreErrorLocked(absl::StrCat("planning job ", job.id()), recorded);
      for (int r = 0; r < need; ++r) {
        idle[static_cast<size_t>(r)]->info.clear_job_id();
        idle[static_cast<size_t>(r)]->info.set_rank(0);
      }
      runtime->second->rank_workers.clear();
      runtime->second->progress.clear();
      schedule_retry_ = true;
      continue;
    }
    threads_.emplace_back([this, id = job.id()] { LoadJob(id); });
  }
  // Why the others wait, against the pool as the jobs placed above left it; written only when it
  // changed (a worker came or went, reported a GPU another holds).
  const std::vector<IdleWorker> free_workers = IdleWorkersLocked();
  for (const v1::Job* job : waiting) {
    const JobRuntime& runtime = *runtimes_.at(job->id());
    const std::string why = PlaceRanks(runtime.backend, runtime.plan.world_size(), free_workers).waiting_for;
    const std::string reason = runtime.pending_note.empty() ? why : absl::StrCat(runtime.pending_note, "; ", why);
    if (job->pending_reason() != reason) {
      RecordLocked(store_->SetPendingReason(job->id(), reason), "recording the pending reason of " + job->id());
    }
  }
  changed_.SignalAll();
}

void Cluster::FailJobLocked(std::string job_id, const std::string& cause, v1::JobState state) {
  auto job = store_->Get(job_id);
  if (!job.ok() || TerminalState(job->state())) return;
  // Unrecorded, the job still ends here (its workers are freed); the database keeps its last
  // recorded state, which a restarted coordinator settles like any job it finds without ranks.
  if (absl::Status s = store_->Transition(job_id, state, cause).status(); !s.ok()) {
    StoreErrorLocked(absl::StrCat("ending job ", job_id, " as ", v1::JobState_Name(state), " (", cause, ")"), s);
  }
  auto runtime = runtimes_.find(job_id);
  if (runtime != runtimes_.end()) {
    for (auto& context : runtime->second->load_contexts) context->TryCancel();
    runtime->second->forward_abort->Abort(absl::StrCat("job ", job_id, " is ", v1::JobState_Name(state), ": ", cause));
    runtime->second->recovery.reset();
    runtime->second->serving = false;
    if (auto serving = std::move(runtime->second->job_serving); serving != nullptr) {
      // Waiting requests fail now; the queue is destroyed off this lock (its destructor waits for
      // the running batch, which may be the caller of this very function).
      serving->Close(absl::StrCat("job ", job_id, " is ", v1::JobState_Name(state), ": ", cause));
      // (No JobServing exists once stopping_ is set: see ServingFor.)
      threads_.emplace_back([serving = std::move(serving)]() mutable { serving.reset(); });
    }
  }
  for (auto& [id, w] : workers_) {
    if (w->info.job_id() != job_id) continue;
    w->info.clear_job_id();
    w->info.set_rank(0);
    if (!w->info.healthy() || stopping_) continue;
    // Survivors drop their shard; a dead worker has nothing to drop. Detached: the call owns
    // what it uses (the stub keeps its channel) and ends by its deadline.
    std::thread([stub = w->stub, job_id, token = options_.worker_token] {
      grpc::ClientContext context;
      SetDeadline(&context, absl::Now() + absl::Seconds(10));
      common::AttachToken(&context, token);
      v1::UnloadRequest unload;
      unload.set_job_id(job_id);
      v1::UnloadResponse ignored;
      stub->Unload(&context, unload, &ignored);
    }).detach();
  }
  changed_.SignalAll();
  ScheduleLocked();
}

void Cluster::LoadJob(std::string job_id) {
  // The job is PLANNED here, and stays so until the lock below: fault tests hold it in that window.
  common::PausePoint("coordinator_planned");
  std::shared_ptr<JobRuntime> runtime;
  std::vector<RankStub> ranks_stubs;  // copied: a worker registering again may change rank_workers
  std::string master_host;
  {
    absl::MutexLock lock(&mu_);
    // Between planning and here (the PLANNED window) the job may have been cancelled, and a worker
    // may have registered again under a new id: neither may start a load.
    auto job = store_->Get(job_id);
    auto found = runtimes_.find(job_id);
    if (stopping_ || !job.ok() || TerminalState(job->state()) || found == runtimes_.end()) return;
    runtime = found->second;
    for (const std::string& w : runtime->rank_workers) {
      auto worker = workers_.find(w);
      if (worker == workers_.end()) {
        FailJobLocked(job_id, absl::StrCat("worker ", w, " left the pool before the job began loading"));
        return;
      }
      ranks_stubs.push_back(
          {w, worker->second->info.address(), worker->second->stub, options_.worker_token, worker->second->health});
    }
    master_host = HostOf(ranks_stubs[0].address);
    if (absl::Status s = store_->Transition(job_id, v1::LOADING, "").status(); !s.ok()) {
      // Nothing is loaded yet; a job the database cannot follow is not started.
      StoreErrorLocked(absl::StrCat("loading job ", job_id), s);
      FailJobLocked(job_id, absl::StrCat("the job database could not record the load: ", s.message()));
      return;
    }
    changed_.SignalAll();
  }
  // Rank 0's worker hosts the rendezvous store now, on a port of its choosing, and keeps it for
  // rank 0's load (no port is found free and bound later).
  v1::ReservePortResponse port;
  {
    grpc::ClientContext context;
    SetDeadline(&context, absl::Now() + absl::Seconds(10));
    common::AttachToken(&context, ranks_stubs[0].token);
    v1::ReservePortRequest reserve;
    reserve.set_job_id(job_id);
    grpc::Status status = ranks_stubs[0].stub->ReservePort(&context, reserve, &port);
    if (!status.ok()) {
      absl::MutexLock lock(&mu_);
      // Stopping: the job stays LOADING for the next coordinator, which fails it with that cause.
      if (!stopping_) {
        FailJobLocked(job_id, absl::StrCat("worker ", ranks_stubs[0].worker_id, " (rank 0): ", status.error_message()));
      }
      return;
    }
  }
  std::vector<std::thread> ranks;
  std::vector<char> loaded(ranks_stubs.size(), 0);  // each written by its rank's thread only
  // Every rank's load context is registered at once, and only while the job has not ended: a
  // cancel or failure while the port was being reserved found no context to cancel, and must not
  // be followed by loads of the ended job on workers that are idle again or serve another job
  // (tests/cluster_behaviour_test.cc, CancelPendingAndLoadingJobs). Stopping: nothing would cancel
  // loads started now; the job stays LOADING for the next coordinator, as above.
  std::vector<std::shared_ptr<grpc::ClientContext>> contexts;
  {
    absl::MutexLock lock(&mu_);
    auto job = store_->Get(job_id);
    if (stopping_ || (job.ok() && TerminalState(job->state()))) return;
    for (size_t r = 0; r < ranks_stubs.size(); ++r) {
      auto context = std::make_shared<grpc::ClientContext>();
      SetDeadline(context.get(), absl::Now() + options_.load_timeout);
      common::AttachToken(context.get(), ranks_stubs[r].token);
      runtime->load_contexts.push_back(context);
      contexts.push_back(std::move(context));
    }
  }
  for (size_t r = 0; r < ranks_stubs.size(); ++r) {
    ranks.emplace_back([&, r, context = contexts[r]] {
      v1::LoadShardRequest load;
      load.set_job_id(job_id);
      *load.mutable_plan() = runtime->plan;
      load.set_rank(static_cast<int32_t>(r));
      load.set_checkpoint(runtime->checkpoint);
      load.set_backend(runtime->backend);
      load.set_master_addr(master_host);
      load.set_master_port(port.port());
      load.set_timeout_seconds(options_.collective_timeout_seconds);
      auto reader = ranks_stubs[r].stub->LoadShard(context.get(), load);
      v1::LoadProgress progress;
      while (reader->Read(&progress)) {
        absl::MutexLock lock(&mu_);
        *runtime->progress[r].mutable_progress() = progress;
        changed_.SignalAll();
      }
      grpc::Status status = reader->Finish();
      if (status.ok()) {
        loaded[r] = 1;
        return;
      }
      const std::string rank = absl::StrCat("worker ", ranks_stubs[r].worker_id, " (rank ", r, "): ");
      const std::string cause = status.error_code() == grpc::StatusCode::CANCELLED
                                    ? absl::StrCat(rank, "cancelled")
                                    : Blame(ranks_stubs, absl::StrCat(rank, status.error_message()));
      absl::MutexLock lock(&mu_);
      if (!stopping_) FailJobLocked(job_id, cause);  // stopping: see above
    });
  }
  for (auto& t : ranks) t.join();
  absl::MutexLock lock(&mu_);
  runtime->load_contexts.clear();
  if (std::count(loaded.begin(), loaded.end(), 1) != static_cast<long>(loaded.size())) return;
  auto job = store_->Get(job_id);
  if (!job.ok() || job->state() != v1::LOADING) return;
  if (absl::Status s = store_->Transition(job_id, v1::READY, "").status(); !s.ok()) {
    // Serving a job the database still calls LOADING would be lost at the next restart.
    StoreErrorLocked(absl::StrCat("readying job ", job_id), s);
    FailJobLocked(job_id, absl::StrCat("the job database could not record it READY: ", s.message()));
    return;
  }
  runtime->serving = true;
  changed_.SignalAll();
}

void Cluster::MarkUnhealthyLocked(const std::string& id, Worker& worker, const std::string& why) {
  worker.info.set_healthy(false);
  if (worker.info.job_id().empty()) return;
  FailJobLocked(worker.info.job_id(),
                absl::StrCat("worker ", id, " (rank ", worker.info.rank(), ") at ", worker.info.address(), " ", why));
}

void Cluster::StoreErrorLocked(const std::string& what, const absl::Status& status) {
  // Once per distinct failure: a refusal retried every quarter interval would flood the log.
  std::string line = absl::StrCat("bertshard-coordinator: job database: ", what, ": ", status.ToString());
  if (line == last_store_error_) return;
  std::fprintf(stderr, "%s\n", line.c_str());
  last_store_error_ = std::move(line);
}

void Cluster::RecordLocked(const absl::Status& status, const std::string& what) {
  if (!status.ok()) StoreErrorLocked(what, status);
}

void Cluster::MonitorLoop() {
  absl::MutexLock lock(&mu_);
  while (!stopping_) {
    // Checked every quarter interval against `missed_heartbeats` intervals of silence: a dead
    // worker's jobs fail within missed_heartbeats + 1/4 intervals of its last heartbeat.
    changed_.WaitWithTimeout(&mu_, options_.heartbeat_interval / 4);
    if (stopping_) break;
    // A draining server takes no heartbeats: silence then says nothing about the workers.
    if (draining_) continue;
    if (schedule_retry_) {
      schedule_retry_ = false;  // set again by a planning the database refuses again
      ScheduleLocked();
    }
    const absl::Time now = absl::Now();
    bool pool_shrank = false;
    for (auto& [id, w] : workers_) {
      if (!w->info.healthy() || now - w->last_heartbeat <= options_.heartbeat_interval * options_.missed_heartbeats) {
        continue;
      }
      MarkUnhealthyLocked(
          id, *w,
          absl::StrCat("stopped heartbeating (silent for ", absl::FormatDuration(now - w->last_heartbeat), ")"));
      pool_shrank = true;
    }
    // After the loop, not in it: a job placed now takes none of the workers it found silent.
    if (pool_shrank) ScheduleLocked();
    std::vector<std::string> overdue;
    for (const auto& [job_id, runtime] : runtimes_) {
      if (runtime->recovery != nullptr && now >= runtime->recovery->deadline) overdue.push_back(job_id);
    }
    for (const std::string& job_id : overdue) DecideRecoveryLocked(job_id);
  }
}

absl::StatusOr<v1::Job> Cluster::GetJob(const std::string& id) {
  absl::MutexLock lock(&mu_);
  return GetJobLocked(id);
}

absl::StatusOr<std::vector<v1::Job>> Cluster::ListJobs() {
  absl::MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(std::vector<v1::Job> jobs, store_->List());
  for (v1::Job& job : jobs) {
    auto runtime = runtimes_.find(job.id());
    if (runtime == runtimes_.end() || runtime->second->recovery == nullptr) continue;
    ASSIGN_OR_RETURN(job, GetJobLocked(job.id()));
  }
  return jobs;
}

absl::StatusOr<v1::Job> Cluster::CancelJob(const std::string& id) {
  absl::MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(v1::Job job, store_->Get(id));
  if (TerminalState(job.state())) {
    return absl::FailedPreconditionError(absl::StrCat("job ", id, " is already ", v1::JobState_Name(job.state())));
  }
  FailJobLocked(id, "cancelled by request", v1::CANCELLED);
  return GetJobLocked(id);
}

v1::JobEvent Cluster::EventLocked(const v1::Job& job) {
  v1::JobEvent event;
  *event.mutable_job() = job;
  auto runtime = runtimes_.find(job.id());
  if (runtime != runtimes_.end()) {
    for (const auto& p : runtime->second->progress) *event.add_ranks() = p;
  }
  return event;
}

absl::Status Cluster::WatchJob(const std::string& id, absl::Time deadline,
                               const std::function<bool(const v1::JobEvent&)>& emit,
                               const std::function<bool()>& cancelled) {
  std::string last;
  while (true) {
    v1::JobEvent event;
    {
      absl::MutexLock lock(&mu_);
      ASSIGN_OR_RETURN(v1::Job job, GetJobLocked(id));
      event = EventLocked(job);
      std::string now = event.SerializeAsString();
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
    if (TerminalState(s) || (s == v1::READY && event.job().recovering().empty())) return absl::OkStatus();
  }
}

std::map<std::string, int> Cluster::InferQueueDepths() {
  absl::MutexLock lock(&mu_);
  std::map<std::string, int> depths;
  for (const auto& [id, runtime] : runtimes_) {
    depths[id] = runtime->job_serving == nullptr ? 0 : runtime->job_serving->calls();
  }
  return depths;
}

namespace {

// READY, and not waiting for its ranks after a restart.
absl::Status CheckServing(const v1::Job& job) {
  if (!job.recovering().empty()) {
    return absl::UnavailableError(absl::StrCat("job ", job.id(), " is recovering (", job.recovering(), "); retry"));
  }
  if (job.state() != v1::READY) {
    return absl::FailedPreconditionError(
        absl::StrCat("job ", job.id(), " is ", v1::JobState_Name(job.state()), "; inference needs READY"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::shared_ptr<JobServing>> Cluster::ServingFor(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  // ~Cluster takes every JobServing out as it sets stopping_; none may be made after.
  if (stopping_) return absl::UnavailableError("the coordinator is shutting down");
  auto found = runtimes_.find(job_id);
  if (found == runtimes_.end() || !found->second->serving) {
    // Not serving: the stored job says why (unknown, recovering, or its state).
    ASSIGN_OR_RETURN(v1::Job job, GetJobLocked(job_id));
    RETURN_IF_ERROR(CheckServing(job));
    return absl::UnavailableError(absl::StrCat("job ", job_id, " is not serving yet; retry"));
  }
  JobRuntime& runtime = *found->second;
  if (runtime.job_serving == nullptr) {
    JobServingOptions serving_options;
    serving_options.batching = options_.batching;
    serving_options.batch_observer = options_.batch_observer;
    serving_options.forward_timeout = options_.forward_timeout;
    // The checkpoint as the coordinator reads it, resolved on the first request (off this lock).
    auto checkpoint_dir = [this, checkpoint = runtime.checkpoint] { return options_.model_root.Resolve(checkpoint); };
    runtime.job_serving = std::make_shared<JobServing>(job_id, runtime.plan, std::move(checkpoint_dir),
                                                       static_cast<ForwardTargets*>(this), serving_options);
  }
  return runtime.job_serving;
}

absl::StatusOr<ForwardTarget> Cluster::NextForward(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  auto found = runtimes_.find(job_id);
  if (found == runtimes_.end() || !found->second->serving) {
    return absl::FailedPreconditionError(absl::StrCat("job ", job_id, " no longer serves"));
  }
  JobRuntime& runtime = *found->second;
  ForwardTarget target;
  for (const std::string& w : runtime.rank_workers) {
    const Worker& worker = *workers_.at(w);
    target.ranks.push_back({w, worker.info.address(), worker.stub, options_.worker_token, worker.health});
  }
  // Advanced only here, on the job's batch thread (one forward at a time): one order on every rank.
  target.sequence = runtime.next_sequence++;
  target.abort = runtime.forward_abort;
  return target;
}

void Cluster::FailJob(const std::string& job_id, const std::string& cause) {
  absl::MutexLock lock(&mu_);
  FailJobLocked(job_id, cause);
}

absl::StatusOr<v1::InferResponse> Cluster::Infer(const v1::InferRequest& request, absl::Time deadline,
                                                 const std::function<bool()>& cancelled) {
  ASSIGN_OR_RETURN(std::shared_ptr<JobServing> serving, ServingFor(request.job_id()));
  return serving->Infer(request, deadline, cancelled);
}

absl::StatusOr<v1::EmbedResponse> Cluster::Embed(const v1::EmbedRequest& request, absl::Time deadline,
                                                 const std::function<bool()>& cancelled) {
  ASSIGN_OR_RETURN(std::shared_ptr<JobServing> serving, ServingFor(request.job_id()));
  return serving->Embed(request, deadline, cancelled);
}

}  // namespace bertshard::server
