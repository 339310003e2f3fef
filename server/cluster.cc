#include "server/cluster.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"

namespace bertshard::server {

Cluster::Cluster(const ClusterOptions& options, std::unique_ptr<WorkerPool> pool)
    : options_(options), pool_(std::move(pool)) {}

absl::StatusOr<std::unique_ptr<Cluster>> Cluster::Create(const ClusterOptions& options) {
  ASSIGN_OR_RETURN(auto store, jobs::JobStore::Open(options.database_path));
  // Ids carry this coordinator's incarnation (worker_pool.h).
  auto pool =
      std::make_unique<WorkerPool>(options, absl::StrCat(absl::Hex(absl::ToUnixMillis(absl::Now()) & 0xffffffffff)));
  auto cluster = std::unique_ptr<Cluster>(new Cluster(options, std::move(pool)));
  ASSIGN_OR_RETURN(cluster->scheduler_, Scheduler::Create(options, std::move(store), cluster->pool_.get()));
  return cluster;
}

// Closes every batch queue, then joins the background threads (Scheduler::Stop).
Cluster::~Cluster() {
  if (scheduler_ != nullptr) scheduler_->Stop();
}

void Cluster::Drain() { scheduler_->Drain(); }

v1::RegisterWorkerResponse Cluster::RegisterWorker(const v1::RegisterWorkerRequest& request) {
  return scheduler_->RegisterWorker(request);
}

absl::StatusOr<v1::HeartbeatResponse> Cluster::Heartbeat(const v1::HeartbeatRequest& request) {
  return scheduler_->Heartbeat(request);
}

v1::ListWorkersResponse Cluster::ListWorkers() { return pool_->List(); }

absl::StatusOr<v1::PlanRequest> Cluster::LocalRequest(const v1::PlanRequest& request) const {
  return LocalPlanRequest(options_.model_root, request);
}

absl::StatusOr<v1::Job> Cluster::SubmitJob(const v1::SubmitJobRequest& request, const std::string& client) {
  return scheduler_->SubmitJob(request, client);
}

absl::StatusOr<v1::Job> Cluster::GetJob(const std::string& id) { return scheduler_->GetJob(id); }

absl::StatusOr<jobs::JobStore::Page> Cluster::ListJobs(int page_size, const std::string& page_token) {
  return scheduler_->ListJobs(page_size, page_token);
}

absl::StatusOr<std::map<v1::JobState, int64_t>> Cluster::CountJobsByState() { return scheduler_->CountJobsByState(); }

absl::StatusOr<v1::Job> Cluster::CancelJob(const std::string& id) { return scheduler_->CancelJob(id); }

absl::StatusOr<v1::Job> Cluster::ScaleJob(const std::string& job, int32_t replicas, int32_t min_replicas,
                                          int32_t max_replicas) {
  ASSIGN_OR_RETURN(const std::string id, ResolveJob(job));
  return scheduler_->ScaleJob(id, replicas, min_replicas, max_replicas);
}

absl::StatusOr<v1::Job> Cluster::UpdateJob(v1::UpdateJobRequest request) {
  ASSIGN_OR_RETURN(const std::string id, ResolveJob(request.job_id()));
  request.set_job_id(id);
  return scheduler_->UpdateJob(request);
}

absl::Status Cluster::WatchJob(const std::string& id, absl::Time deadline,
                               const std::function<bool(const v1::JobEvent&)>& emit,
                               const std::function<bool()>& cancelled, bool all_replicas) {
  return scheduler_->WatchJob(id, deadline, emit, cancelled, all_replicas);
}

std::map<std::string, int> Cluster::InferQueueDepths() {
  std::map<std::string, int> depths;
  scheduler_->ForEachRuntime([&](const std::string& id, JobRuntime& runtime) {
    depths[id] = runtime.job_serving == nullptr ? 0 : runtime.job_serving->calls();
    // A live update's old shape still answers what was queued for it.
    for (const auto& [version, draining] : runtime.draining) depths[id] += draining == nullptr ? 0 : draining->calls();
  });
  return depths;
}

RecoveryMetrics Cluster::Recovery() { return scheduler_->Recovery(); }

namespace {

// READY, and not waiting for its ranks after a restart.
absl::Status CheckServing(const v1::Job& job) {
  if (!job.recovering().empty()) {
    return absl::UnavailableError(absl::StrCat("job ", job.id(), " is recovering (", job.recovering(), "); retry"));
  }
  if (!job.degraded().empty()) {
    return absl::UnavailableError(absl::StrCat("job ", job.id(), " is recovering (", job.degraded(), "); retry"));
  }
  if (job.state() != v1::READY) {
    return absl::FailedPreconditionError(
        absl::StrCat("job ", job.id(), " is ", v1::JobState_Name(job.state()), "; inference needs READY"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::shared_ptr<JobServing>> Cluster::ServingFor(const std::string& job_id) {
  std::shared_ptr<JobServing> serving;
  RETURN_IF_ERROR(scheduler_->WithServingRuntime(
      job_id, [&](const std::shared_ptr<JobRuntime>& found, const absl::StatusOr<v1::Job>& job) -> absl::Status {
        if (found == nullptr) {
          // Not serving: the stored job says why (unknown, recovering, or its state).
          RETURN_IF_ERROR(job.status());
          RETURN_IF_ERROR(CheckServing(*job));
          return absl::UnavailableError(absl::StrCat("job ", job_id, " is not serving yet; retry"));
        }
        JobRuntime& runtime = *found;
        if (runtime.job_serving == nullptr) {
          JobServingOptions serving_options;
          serving_options.batching = options_.batching;
          serving_options.batch_observer = options_.batch_observer;
          serving_options.forward_timeout = options_.forward_timeout;
          // The assets read when the job was submitted (or taken back), through the checkpoint's
          // descriptors: never looked up by path again, so no later change to the directory can
          // turn a serving job's requests away, and no request waits on a file.
          // A live update that switched over has its new shape here: its requests are prepared for it
          // and go to its replicas only (the old path finishes its own).
          serving_options.version = runtime.shape->version;
          std::shared_ptr<const JobAssets> assets =
              runtime.shape->assets != nullptr
                  ? runtime.shape->assets
                  : RefusedJobAssets(absl::InternalError("the job's assets were not read"));
          runtime.job_serving = std::make_shared<JobServing>(job_id, runtime.shape->plan, std::move(assets),
                                                             scheduler_.get(), serving_options);
          // Then the scheduler's.
          runtime.job_serving->SetConcurrency(std::max(1, runtime.ServingGroups(runtime.shape->version)));
        }
        serving = runtime.job_serving;
        return absl::OkStatus();
      }));
  return serving;
}

absl::StatusOr<v1::InferResponse> Cluster::Infer(const v1::InferRequest& request, absl::Time deadline,
                                                 const std::function<bool()>& cancelled, const Caller& caller) {
  ASSIGN_OR_RETURN(std::shared_ptr<JobServing> serving, ServingFor(IdOf(request.job_id())));
  return serving->Infer(request, deadline, cancelled, caller);
}

absl::StatusOr<v1::EmbedResponse> Cluster::Embed(const v1::EmbedRequest& request, absl::Time deadline,
                                                 const std::function<bool()>& cancelled, const Caller& caller) {
  ASSIGN_OR_RETURN(std::shared_ptr<JobServing> serving, ServingFor(IdOf(request.job_id())));
  return serving->Embed(request, deadline, cancelled, caller);
}

absl::StatusOr<v1::RerankResponse> Cluster::Rerank(const v1::RerankRequest& request, absl::Time deadline,
                                                   const std::function<bool()>& cancelled, const Caller& caller) {
  ASSIGN_OR_RETURN(std::shared_ptr<JobServing> serving, ServingFor(IdOf(request.job_id())));
  return serving->Rerank(request, deadline, cancelled, caller);
}

std::string Cluster::IdOf(const std::string& job) {
  if (job.empty()) return job;
  absl::StatusOr<std::string> id = ResolveJob(job);
  return id.ok() ? *id : job;  // unknown: ServingFor says so in its own words
}

absl::StatusOr<std::string> Cluster::ResolveJob(const std::string& job, const std::string& fallback) {
  if (job.empty() && !fallback.empty()) return ResolveJob(fallback);
  std::string by_id, by_name;
  std::vector<std::string> serving;  // names, else ids, of the jobs that serve
  std::string only;                  // the id of the last of them (the only one when there is one)
  scheduler_->ForEachRuntime([&](const std::string& id, JobRuntime& runtime) {
    if (runtime.ended) return;
    if (id == job) by_id = id;
    if (!runtime.name.empty() && runtime.name == job) by_name = id;
    if (runtime.ServingGroups() > 0) {
      serving.push_back(runtime.name.empty() ? id : runtime.name);
      only = id;
    }
  });
  if (!by_id.empty()) return by_id;
  if (!by_name.empty()) return by_name;
  if (!job.empty()) {
    // An ended job is known to the store alone: say what became of it rather than "no such job".
    if (const absl::StatusOr<v1::Job> stored = scheduler_->GetJob(job); stored.ok()) return stored->id();
    return absl::NotFoundError(absl::StrCat("no job has the id or name '", job, "'"));
  }
  // From the one walk: a second could see another set of jobs and refuse with "1 jobs are serving".
  if (serving.size() == 1) return only;
  return absl::FailedPreconditionError(
      serving.empty() ? std::string("no job is serving, so a request must name one (an id or a job's name)")
                      : absl::StrCat(serving.size(), " jobs are serving (", absl::StrJoin(serving, ", "),
                                     "): name one (an id or a job's name), or start the coordinator with "
                                     "--default_job"));
}

std::vector<Cluster::ServingJob> Cluster::ServingJobs() {
  std::vector<ServingJob> jobs;
  scheduler_->ForEachRuntime([&](const std::string& id, JobRuntime& runtime) {
    if (runtime.ServingGroups() == 0 || runtime.ended) return;
    jobs.push_back({id, runtime.name, runtime.shape->plan,
                    runtime.shape->assets != nullptr
                        ? runtime.shape->assets
                        : RefusedJobAssets(absl::InternalError("the job's assets were not read"))});
  });
  return jobs;
}

absl::StatusOr<std::vector<TokenPiece>> Cluster::Tokenize(const std::string& job_id, absl::string_view text,
                                                          bool add_special_tokens) {
  ASSIGN_OR_RETURN(std::shared_ptr<JobServing> serving, ServingFor(job_id));
  return serving->Tokenize(text, add_special_tokens);
}

absl::StatusOr<std::string> Cluster::Decode(const std::string& job_id, const std::vector<int64_t>& ids) {
  ASSIGN_OR_RETURN(std::shared_ptr<JobServing> serving, ServingFor(job_id));
  return serving->Decode(ids);
}

}  // namespace bertshard::server
