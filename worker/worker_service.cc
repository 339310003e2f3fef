#include "worker/worker_service.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <chrono>
#include <cstdio>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/fault_point.h"
#include "common/grpc_auth.h"
#include "common/grpc_status.h"
#include "common/status_macros.h"
#include "model/bert_shard.h"
#include "model/gemm.h"
#include "worker/collectives_backend.h"
#include "worker/forward_outputs.h"
#include "worker/math_threads.h"
#include "worker/rendezvous.h"
#include "worker/shard_loader.h"

namespace bertshard::worker {
namespace {

// A job's children of the worker's metric families; all null without metrics. The series stay
// while any copy does (`hold`), then leave the families.
struct JobMetrics {
  common::Counter* loaded_bytes = nullptr;
  common::Histogram* forward_seconds = nullptr;
  common::Histogram* forward_rows = nullptr;
  std::shared_ptr<void> hold;
};

}  // namespace

struct WorkerMetrics::SeriesHolders {
  absl::Mutex mu;
  std::map<std::vector<std::string>, int> count ABSL_GUARDED_BY(mu);  // by {job, rank}
};

namespace {

// Called once the load request has been checked, as the load begins: a refused request makes no
// series. Two loads of one job and rank (one refused as a duplicate) share them.
absl::StatusOr<JobMetrics> MetricsForJob(const WorkerMetrics* metrics, const std::string& job_id, int rank) {
  JobMetrics job;
  if (metrics == nullptr) return job;
  const std::vector<std::string> labels = {job_id, std::to_string(rank)};
  absl::MutexLock lock(&metrics->holders->mu);
  ASSIGN_OR_RETURN(job.loaded_bytes, metrics->loaded_bytes->WithLabels(labels));
  ASSIGN_OR_RETURN(job.forward_seconds, metrics->forward_seconds->WithLabels(labels));
  ASSIGN_OR_RETURN(job.forward_rows, metrics->forward_rows->WithLabels(labels));
  ++metrics->holders->count[labels];
  // Released by the last copy: the failed load's, or the loaded shard's once unloaded and its last
  // forward done (no one records into the series after).
  job.hold = std::shared_ptr<void>(nullptr, [m = *metrics, labels](void*) {
    absl::MutexLock lock(&m.holders->mu);
    auto it = m.holders->count.find(labels);
    if (it == m.holders->count.end() || --it->second > 0) return;
    m.holders->count.erase(it);
    m.loaded_bytes->Remove(labels);
    m.forward_seconds->Remove(labels);
    m.forward_rows->Remove(labels);
  });
  return job;
}

}  // namespace

absl::StatusOr<WorkerMetrics> WorkerMetrics::Register(common::MetricsRegistry* registry) {
  WorkerMetrics metrics;
  metrics.holders = std::make_shared<SeriesHolders>();
  ASSIGN_OR_RETURN(
      metrics.loaded_bytes,
      registry->AddCounter("bertshard_worker_loaded_bytes_total",
                           "Parameter bytes (as fp32) loaded into shards, by job and rank.", {"job", "rank"}));
  // Seconds: a tiny test model's forward takes ~1 ms, BERT-large's on CPU tens of seconds.
  ASSIGN_OR_RETURN(
      metrics.forward_seconds,
      registry->AddHistogram("bertshard_worker_forward_duration_seconds",
                             "Time of successful forwards of a shard (this rank's part, "
                             "collectives included), by job and rank.",
                             {"job", "rank"},
                             {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120}));
  ASSIGN_OR_RETURN(metrics.forward_rows,
                   registry->AddHistogram("bertshard_worker_forward_rows",
                                          "Rows (sequences) per successful forward: the batch size, by job and "
                                          "rank.",
                                          {"job", "rank"}, {1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024}));
  return metrics;
}

struct WorkerService::LoadedJob {
  std::unique_ptr<model::BertShard> shard;
  std::unique_ptr<model::Collectives> comm;
  absl::Mutex mu;  // one forward at a time
  int64_t next_sequence ABSL_GUARDED_BY(mu) = 0;
  // After a failed forward the process groups may be desynchronised: the job must be unloaded.
  std::string broken ABSL_GUARDED_BY(mu);
  int threads = 1;
  int rank = 0;
  int world_size = 0;
  std::string checkpoint;  // LoadShardRequest.checkpoint: a later load of the key may keep its tensors
  JobMetrics metrics;
};

WorkerService::WorkerService(WorkerServiceOptions options)
    : options_(options),
      // Served on the advertised host only (loopback when there is none: single-host use).
      reserved_stores_(std::make_unique<ReservedStores>(options.port_reservation_ttl,
                                                        options.bind_host.empty() ? "127.0.0.1" : options.bind_host)) {}
WorkerService::~WorkerService() = default;

int WorkerService::loaded_jobs() {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(jobs_.size());
}

std::vector<v1::HeldShard> WorkerService::HeldShards() {
  std::vector<std::pair<std::string, std::shared_ptr<LoadedJob>>> jobs;
  {
    absl::MutexLock lock(&mu_);
    jobs.assign(jobs_.begin(), jobs_.end());
  }
  std::vector<v1::HeldShard> held;
  for (const auto& [id, job] : jobs) {
    v1::HeldShard h;
    h.set_job_id(id);
    h.set_rank(job->rank);
    h.set_world_size(job->world_size);
    // A forward holds job->mu for seconds; heartbeats must not wait for it.
    if (job->mu.TryLock()) {
      h.set_next_sequence(job->next_sequence);
      h.set_broken(job->broken);
      job->mu.Unlock();
    } else {
      h.set_forward_running(true);
    }
    held.push_back(std::move(h));
  }
  return held;
}

bool WorkerService::UnloadJob(const std::string& job_id) {
  common::PausePoint("worker_unload");
  std::shared_ptr<LoadedJob> job;
  {
    absl::MutexLock lock(&mu_);
    auto it = jobs_.find(job_id);
    if (it != jobs_.end()) {
      job = std::move(it->second);
      jobs_.erase(it);
    }
    // A load of it still running is not kept when it ends (LoadShard).
    if (auto loading = loading_.find(job_id); loading != loading_.end()) ++loading->second.unloads;
  }
  return job != nullptr;  // the shard is freed when the last in-flight forward lets go of it
}

absl::StatusOr<common::MetricsRegistry::CollectorHandle> WorkerService::ExportLoadedShards(
    common::MetricsRegistry* registry) {
  return registry->AddCollector(common::MetricType::kGauge, "bertshard_worker_shards_loaded",
                                "Shards (ranks of jobs) this worker holds now.", {},
                                [this]() -> absl::StatusOr<std::vector<common::Sample>> {
                                  return std::vector<common::Sample>{{{}, static_cast<double>(loaded_jobs())}};
                                });
}

model::GemmPath WorkerService::GemmPathFor(const v1::ShardPlan& plan, int rank, const std::string& job_id,
                                           int threads) {
  if (options_.gemm.has_value()) return *options_.gemm;
  const auto key = std::make_tuple(threads, plan.config().hidden_size(), plan.config().intermediate_size(),
                                   plan.shard_config().tensor_parallel_size());
  {
    absl::MutexLock lock(&gemm_mu_);
    if (auto it = gemm_choices_.find(key); it != gemm_choices_.end()) return it->second.path;
  }
  // Measured outside the lock (~0.1-0.3 s); two first loads of one shape may both measure.
  const model::GemmChoice choice = model::PickGemmPathForPlan(plan);
  std::fprintf(
      stderr,
      "shard-worker: job %s rank %d: --gemm=auto picked %s (blas %.1f, onednn %.1f GFLOP/s; %d LibTorch threads)\n",
      job_id.c_str(), rank, std::string(model::GemmPathName(choice.path)).c_str(), choice.blas_gflops,
      choice.onednn_gflops, threads);
  absl::MutexLock lock(&gemm_mu_);
  return gemm_choices_.emplace(key, choice).first->second.path;
}

grpc::Status WorkerService::Authorize(const grpc::ServerContext& context) const {
  // Every worker RPC is the coordinator's and changes or spends what the worker holds.
  return common::CheckAccess(context, common::AuthConfig{options_.token, ""}, common::Access::kAdmin);
}

absl::Status WorkerService::CheckLoadRequest(const v1::LoadShardRequest& request) const {
  const v1::ShardPlan& plan = request.plan();
  if (request.job_id().empty()) return absl::InvalidArgumentError("job_id is required");
  if (absl::Status s = CheckRendezvousSecret(request.rendezvous_secret()); !s.ok()) return s;
  if (request.rank() < 0 || request.rank() >= plan.world_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", request.rank(), " is outside the plan's world of ", plan.world_size()));
  }
  // The coordinator places gloo jobs on CPU workers and nccl jobs on GPU workers; a load that
  // asks a worker for the other kind is refused before anything is read.
  const bool on_gpu = options_.gpu >= 0;
  const std::string backend = request.backend().empty() ? "gloo" : request.backend();
  if (backend != (on_gpu ? "nccl" : "gloo")) {
    return absl::InvalidArgumentError(absl::StrCat(
        "backend '", backend, "' is not served by this worker: it serves ",
        on_gpu ? absl::StrCat("nccl on cuda:", options_.gpu) : "gloo on the CPU",
        on_gpu ? " (shard-worker --device=cpu serves gloo)" : " (shard-worker --device=cuda:N serves nccl)"));
  }
  return CheckBackend(backend);  // a GPU worker built without NCCL
}

absl::StatusOr<std::shared_ptr<WorkerService::LoadedJob>> WorkerService::LoadJob(
    const v1::LoadShardRequest& request, grpc::ServerContext& context, grpc::ServerWriter<v1::LoadProgress>& writer,
    v1::LoadProgress& progress, const std::shared_ptr<LoadedJob>& held) {
  const v1::ShardPlan& plan = request.plan();
  ShardLoadOptions options;
  options.checkpoint = request.checkpoint();
  options.model_root = options_.model_root;
  CollectivesOptions& collectives = options.collectives;
  collectives.backend = options_.gpu >= 0 ? "nccl" : "gloo";
  collectives.rendezvous.master_addr = request.master_addr().empty() ? "127.0.0.1" : request.master_addr();
  collectives.rendezvous.master_port = request.master_port();
  collectives.rendezvous.timeout =
      std::chrono::seconds(request.timeout_seconds() > 0 ? request.timeout_seconds() : 120);
  collectives.rendezvous.secret = request.rendezvous_secret();
  // Rank 0 takes over the store its ReservePort hosted on master_port at once, so that no expiry
  // closes it while the shard loads (and it goes with this call if the load fails). None here (a
  // port chosen some other way, or a reservation that expired): the rendezvous hosts one on
  // master_port.
  if (request.rank() == 0) {
    collectives.rendezvous.store =
        reserved_stores_->Claim(request.job_id(), request.master_port(), request.rendezvous_secret());
  }
  collectives.bind_host = options_.bind_host;
  collectives.gpu = options_.gpu;

  auto job = std::make_shared<LoadedJob>();
  ASSIGN_OR_RETURN(job->metrics, MetricsForJob(options_.metrics, request.job_id(), request.rank()));
  job->threads = request.threads() > 0 ? request.threads() : options_.default_threads;
  job->rank = request.rank();
  job->world_size = plan.world_size();
  job->checkpoint = request.checkpoint();
  // Out of jobs_ already; a forward that took it before may still come, and finds it broken. One
  // running now (stuck in a collective with a peer that is gone, say) is not waited for beyond a
  // moment (a heartbeat's report takes the lock briefly too): the new load reads everything
  // instead, rather than keep its own group's rendezvous waiting. Its groups are gone with its
  // replica; its tensors are the new load's to take.
  bool held_locked = false;
  for (int attempt = 0; held != nullptr && held->checkpoint == request.checkpoint() && attempt < 50; ++attempt) {
    if ((held_locked = held->mu.TryLock())) break;
    absl::SleepFor(absl::Milliseconds(10));
  }
  if (held_locked) {
    held->broken = "replaced by a new load of its job id";
    held->comm.reset();
    held->mu.Unlock();
    options.load.donor = held->shard.get();
  }
  SetMathThreads(job->threads);
  if (options_.gpu >= 0) {
    options.load.device = c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(options_.gpu));
  } else {
    options.load.gemm = GemmPathFor(plan, request.rank(), request.job_id(), job->threads);  // after SetMathThreads
  }
  progress.set_phase(v1::LoadProgress::LOADING);
  int64_t bytes_counted = 0;
  options.load.progress = [&](int loaded, int total, int64_t bytes, int64_t total_bytes) {
    // Counted as read, so a slow load shows on the counter and a failed one still counts.
    if (job->metrics.loaded_bytes != nullptr) {
      job->metrics.loaded_bytes->Increment(static_cast<double>(bytes - bytes_counted));
      bytes_counted = bytes;
    }
    if (context.IsCancelled()) return false;
    progress.set_tensors_loaded(loaded);
    progress.set_tensors_total(total);
    progress.set_bytes_loaded(bytes);
    progress.set_bytes_total(total_bytes);
    return writer.Write(progress);
  };
  options.loaded = [&](const model::BertShard&) {
    progress.set_phase(v1::LoadProgress::CONNECTING);
    writer.Write(progress);
    common::PausePoint("worker_rendezvous");  // loaded, before joining the job's process groups
  };
  common::PausePoint("worker_load");  // fault tests stop a worker here, before it reads a tensor
  ASSIGN_OR_RETURN(LoadedShard loaded, LoadAndConnect(plan, request.rank(), options));
  progress.set_bytes_kept(loaded.shard->kept_bytes());
  progress.set_checkpoint_bytes_read(static_cast<int64_t>(loaded.checkpoint_bytes_read));
  job->shard = std::move(loaded.shard);
  job->comm = std::move(loaded.collectives.comm);
  return job;
}

grpc::Status WorkerService::LoadShard(grpc::ServerContext* context, const v1::LoadShardRequest* request,
                                      grpc::ServerWriter<v1::LoadProgress>* writer) {
  if (grpc::Status denied = Authorize(*context); !denied.ok()) return denied;
  if (absl::Status refused = CheckLoadRequest(*request); !refused.ok()) return common::ToGrpcStatus(refused);
  int64_t unloads_at_start = 0;
  std::shared_ptr<LoadedJob> held;  // the shard it replaces (keep_held), dropped when this call ends
  {
    absl::MutexLock lock(&mu_);
    if (auto it = jobs_.find(request->job_id()); it != jobs_.end()) {
      if (!request->keep_held()) {
        return {grpc::StatusCode::ALREADY_EXISTS, absl::StrCat("job ", request->job_id(), " is already loaded here")};
      }
      held = std::move(it->second);  // it serves no more: its replica is being placed anew
      jobs_.erase(it);
    }
    LoadsInProgress& loading = loading_[request->job_id()];
    ++loading.loads;
    unloads_at_start = loading.unloads;
  }
  absl::Cleanup done_loading = [this, &request] {
    absl::MutexLock lock(&mu_);
    auto it = loading_.find(request->job_id());
    if (--it->second.loads == 0) loading_.erase(it);
  };
  v1::LoadProgress progress;  // the last one says READY, with the counts of the load
  absl::StatusOr<std::shared_ptr<LoadedJob>> job = LoadJob(*request, *context, *writer, progress, held);
  held.reset();  // what the new shard did not take is freed here
  if (!job.ok()) return common::ToGrpcStatus(job.status());
  if (context->IsCancelled()) {
    // The coordinator gave up on this job while we joined its groups: do not keep it.
    return {grpc::StatusCode::CANCELLED, absl::StrCat("loading job ", request->job_id(), " was cancelled")};
  }
  {
    absl::MutexLock lock(&mu_);
    if (loading_[request->job_id()].unloads != unloads_at_start) {
      // Told to unload the job while this load ran (its group was lost; the coordinator's cancel
      // may not have reached us): kept, it would be a stale shard under a job id the coordinator
      // may place here again.
      return {grpc::StatusCode::CANCELLED,
              absl::StrCat("job ", request->job_id(), " was unloaded while it loaded here; not kept")};
    }
    if (!jobs_.emplace(request->job_id(), *job).second) {
      return {grpc::StatusCode::ALREADY_EXISTS, absl::StrCat("job ", request->job_id(), " was loaded concurrently")};
    }
  }
  progress.set_phase(v1::LoadProgress::READY);
  writer->Write(progress);
  return grpc::Status::OK;
}

grpc::Status WorkerService::Forward(grpc::ServerContext* context, const v1::ForwardRequest* request,
                                    v1::ForwardResponse* response) {
  if (grpc::Status denied = Authorize(*context); !denied.ok()) return denied;
  std::shared_ptr<LoadedJob> job;
  {
    absl::MutexLock lock(&mu_);
    auto it = jobs_.find(request->job_id());
    if (it == jobs_.end()) {
      return {grpc::StatusCode::FAILED_PRECONDITION, absl::StrCat("job ", request->job_id(), " is not loaded here")};
    }
    job = it->second;
  }
  const v1::TokenInputs& in = request->inputs();
  const int64_t n = in.rows() * in.seq();
  absl::MutexLock lock(&job->mu);
  if (!job->broken.empty()) {
    return {grpc::StatusCode::FAILED_PRECONDITION,
            absl::StrCat("job ", request->job_id(), " failed earlier (", job->broken, "); unload it")};
  }
  if (request->sequence() != job->next_sequence) {
    return {grpc::StatusCode::FAILED_PRECONDITION,
            absl::StrCat("forward ", request->sequence(), " of job ", request->job_id(),
                         " arrived out of order; next is ", job->next_sequence)};
  }
  // A refused request takes its number like a forward that ran: every rank refuses it alike before
  // any collective, so the ranks stay in step and the coordinator keeps the group (it answers the
  // batch's callers with the refusal instead of losing the group).
  if (in.rows() < 1 || in.seq() < 1 || in.input_ids_size() != n || in.attention_mask_size() != n ||
      in.token_type_ids_size() != n) {
    ++job->next_sequence;
    return {grpc::StatusCode::INVALID_ARGUMENT,
            "inputs must hold rows x seq values in each of input_ids, attention_mask, token_type_ids"};
  }
  if (absl::Status s = request->has_want() ? CheckForwardWant(request->want()) : absl::OkStatus(); !s.ok()) {
    ++job->next_sequence;
    return common::ToGrpcStatus(s);
  }
  if (context->IsCancelled()) return {grpc::StatusCode::CANCELLED, "cancelled before the forward"};
  // Fault tests stop a worker here: its forward is under way (the job's lock held, the sequence
  // taken), and it runs to the end once let go, whatever became of the caller.
  common::PausePoint("worker_forward");
  auto tensor = [&](const google::protobuf::RepeatedField<int64_t>& values) {
    return at::tensor(std::vector<int64_t>(values.begin(), values.end()), at::kLong).view({in.rows(), in.seq()});
  };
  model::ModelInputs inputs{tensor(in.input_ids()), tensor(in.attention_mask()), tensor(in.token_type_ids()),
                            std::max<int64_t>(1, in.choices())};
  SetMathThreads(job->threads, job->shard->gemm_path() == model::GemmPath::kBlas);
  const auto start = std::chrono::steady_clock::now();
  model::ForwardOptions options;
  options.splade = request->want().has_sparse();
  auto outputs = job->shard->Forward(inputs, std::max(1, request->micro_batches()), job->comm.get(), options);
  ++job->next_sequence;
  if (!outputs.ok()) {
    // Bad inputs are refused by every rank alike before any collective; anything else leaves the
    // groups unusable.
    if (outputs.status().code() != absl::StatusCode::kInvalidArgument) {
      job->broken = std::string(outputs.status().message());
    }
    return common::ToGrpcStatus(outputs.status());
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  response->set_forward_seconds(seconds);
  // Before the answer goes out: whoever has the answer finds it counted.
  if (job->metrics.forward_seconds != nullptr) {
    job->metrics.forward_seconds->Observe(seconds);
    job->metrics.forward_rows->Observe(static_cast<double>(in.rows()));
  }
  if (options.splade) {
    // Every rank of the last stage answers for its own slice of the vocabulary.
    const auto weights = outputs->find("sparse_embedding");
    if (weights == outputs->end()) return grpc::Status::OK;  // a rank of another stage
    const at::Tensor w = weights->second.contiguous();
    const model::VocabSlice slice = job->shard->lm_vocab_slice();
    if (absl::Status s = AddSparseRows({w.data_ptr<float>(), static_cast<size_t>(w.numel())}, w.size(0), w.size(1),
                                       slice.first, response);
        !s.ok()) {
      return common::ToGrpcStatus(s);
    }
    return grpc::Status::OK;
  }
  if (job->comm->tp_rank() == 0) {
    for (const auto& [name, t] : *outputs) {
      v1::NamedTensor* out = response->add_outputs();
      out->set_name(name);
      const at::Tensor c = t.contiguous();
      for (int64_t d : c.sizes()) out->add_shape(d);
      out->mutable_values()->Add(c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
    }
  }
  if (request->has_want() && response->outputs_size() > 0) {
    // The rank holding the outputs sends back only what the coordinator wants of them.
    if (absl::Status s = ApplyForwardWant(in, request->want(), response); !s.ok()) return common::ToGrpcStatus(s);
  }
  return grpc::Status::OK;
}

grpc::Status WorkerService::ReservePort(grpc::ServerContext* context, const v1::ReservePortRequest* request,
                                        v1::ReservePortResponse* response) {
  if (grpc::Status denied = Authorize(*context); !denied.ok()) return denied;
  // Bound now, not found free for rank 0 to bind later: anything on this host (an outgoing
  // connection's ephemeral port, another job's reservation) could take it in between.
  auto port = reserved_stores_->Reserve(request->job_id(), request->rendezvous_secret());
  if (!port.ok()) return common::ToGrpcStatus(port.status());
  response->set_port(*port);
  return grpc::Status::OK;
}

grpc::Status WorkerService::Unload(grpc::ServerContext* context, const v1::UnloadRequest* request,
                                   v1::UnloadResponse* response) {
  if (grpc::Status denied = Authorize(*context); !denied.ok()) return denied;
  response->set_was_loaded(UnloadJob(request->job_id()));
  return grpc::Status::OK;
}

}  // namespace bertshard::worker
