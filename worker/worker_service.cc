#include "worker/worker_service.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "checkpoint/checkpoint.h"
#include "common/free_port.h"
#include "common/grpc_status.h"
#include "model/bert_shard.h"
#include "worker/gloo_collectives.h"

namespace bertshard::worker {

struct WorkerService::LoadedJob {
  std::unique_ptr<model::BertShard> shard;
  std::unique_ptr<model::Collectives> comm;
  absl::Mutex mu;  // one forward at a time
  int64_t next_sequence ABSL_GUARDED_BY(mu) = 0;
  // After a failed forward the process groups may be desynchronised: the job must be unloaded.
  std::string broken ABSL_GUARDED_BY(mu);
  int threads = 1;
};

WorkerService::WorkerService(WorkerServiceOptions options) : options_(options) {}
WorkerService::~WorkerService() = default;

int WorkerService::loaded_jobs() {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(jobs_.size());
}

grpc::Status WorkerService::LoadShard(grpc::ServerContext* context, const v1::LoadShardRequest* request,
                                      grpc::ServerWriter<v1::LoadProgress>* writer) {
  const v1::ShardPlan& plan = request->plan();
  if (request->job_id().empty()) return {grpc::StatusCode::INVALID_ARGUMENT, "job_id is required"};
  if (request->rank() < 0 || request->rank() >= plan.world_size()) {
    return {grpc::StatusCode::INVALID_ARGUMENT,
            absl::StrCat("rank ", request->rank(), " is outside the plan's world of ", plan.world_size())};
  }
  if (!request->backend().empty() && request->backend() != "gloo") {
    return {grpc::StatusCode::INVALID_ARGUMENT,
            absl::StrCat("backend '", request->backend(), "' is not served by this worker (gloo)")};
  }
  {
    absl::MutexLock lock(&mu_);
    if (jobs_.count(request->job_id())) {
      return {grpc::StatusCode::ALREADY_EXISTS, absl::StrCat("job ", request->job_id(), " is already loaded here")};
    }
  }
  auto job = std::make_shared<LoadedJob>();
  job->threads = request->threads() > 0 ? request->threads() : options_.default_threads;
  at::set_num_threads(job->threads);
  auto ckpt = checkpoint::Checkpoint::Open(request->checkpoint());
  if (!ckpt.ok()) {
    absl::Status s = ckpt.status();
    // A path the worker cannot see is the request's fault.
    return common::ToGrpcStatus(s.code() == absl::StatusCode::kNotFound ? absl::InvalidArgumentError(s.message()) : s);
  }
  v1::LoadProgress progress;
  progress.set_phase(v1::LoadProgress::LOADING);
  auto report = [&](int loaded, int total, int64_t bytes, int64_t total_bytes) {
    if (context->IsCancelled()) return false;
    progress.set_tensors_loaded(loaded);
    progress.set_tensors_total(total);
    progress.set_bytes_loaded(bytes);
    progress.set_bytes_total(total_bytes);
    return writer->Write(progress);
  };
  auto shard = model::BertShard::Load(plan, request->rank(), **ckpt, c10::Device(c10::kCPU), report);
  if (!shard.ok()) return common::ToGrpcStatus(shard.status());
  job->shard = *std::move(shard);

  progress.set_phase(v1::LoadProgress::CONNECTING);
  writer->Write(progress);
  GlooOptions gloo;
  gloo.master_addr = request->master_addr().empty() ? "127.0.0.1" : request->master_addr();
  gloo.master_port = request->master_port();
  gloo.rank = request->rank();
  gloo.world_size = plan.world_size();
  gloo.tp_size = std::max(1, plan.shard_config().tensor_parallel_size());
  gloo.timeout = std::chrono::seconds(request->timeout_seconds() > 0 ? request->timeout_seconds() : 120);
  auto comm = GlooCollectives::Connect(gloo);
  if (!comm.ok()) return common::ToGrpcStatus(comm.status());
  job->comm = *std::move(comm);
  if (context->IsCancelled()) {
    // The coordinator gave up on this job while we joined its groups: do not keep it.
    return {grpc::StatusCode::CANCELLED, absl::StrCat("loading job ", request->job_id(), " was cancelled")};
  }
  {
    absl::MutexLock lock(&mu_);
    if (!jobs_.emplace(request->job_id(), job).second) {
      return {grpc::StatusCode::ALREADY_EXISTS, absl::StrCat("job ", request->job_id(), " was loaded concurrently")};
    }
  }
  progress.set_phase(v1::LoadProgress::READY);
  writer->Write(progress);
  return grpc::Status::OK;
}

grpc::Status WorkerService::Forward(grpc::ServerContext* context, const v1::ForwardRequest* request,
                                    v1::ForwardResponse* response) {
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
  if (in.rows() < 1 || in.seq() < 1 || in.input_ids_size() != n || in.attention_mask_size() != n ||
      in.token_type_ids_size() != n) {
    return {grpc::StatusCode::INVALID_ARGUMENT,
            "inputs must hold rows x seq values in each of input_ids, attention_mask, token_type_ids"};
  }
  absl::MutexLock lock(&job->mu);
  if (!job->broken.empty()) {
    return {grpc::StatusCode::FAILED_PRECONDITION, absl::StrCat("job ", request->job_id(), " failed earlier (",
                                                                job->broken, "); unload it")};
  }
  if (request->sequence() != job->next_sequence) {
    return {grpc::StatusCode::FAILED_PRECONDITION,
            absl::StrCat("forward ", request->sequence(), " of job ", request->job_id(), " arrived out of order; next is ",
                         job->next_sequence)};
  }
  if (context->IsCancelled()) return {grpc::StatusCode::CANCELLED, "cancelled before the forward"};
  auto tensor = [&](const google::protobuf::RepeatedField<int64_t>& values) {
    return at::tensor(std::vector<int64_t>(values.begin(), values.end()), at::kLong).view({in.rows(), in.seq()});
  };
  model::ModelInputs inputs{tensor(in.input_ids()), tensor(in.attention_mask()), tensor(in.token_type_ids()),
                            std::max<int64_t>(1, in.choices())};
  at::set_num_threads(job->threads);
  const auto start = std::chrono::steady_clock::now();
  auto outputs = job->shard->Forward(inputs, std::max(1, request->micro_batches()), job->comm.get());
  ++job->next_sequence;
  if (!outputs.ok()) {
    // Bad inputs are refused by every rank alike before any collective; anything else leaves the
    // groups unusable.
    if (outputs.status().code() != absl::StatusCode::kInvalidArgument) {
      job->broken = std::string(outputs.status().message());
    }
    return common::ToGrpcStatus(outputs.status());
  }
  response->set_forward_seconds(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  if (job->comm->tp_rank() == 0) {
    for (const auto& [name, t] : *outputs) {
      v1::NamedTensor* out = response->add_outputs();
      out->set_name(name);
      const at::Tensor c = t.contiguous();
      for (int64_t d : c.sizes()) out->add_shape(d);
      out->mutable_values()->Add(c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
    }
  }
  return grpc::Status::OK;
}

grpc::Status WorkerService::ReservePort(grpc::ServerContext*, const v1::ReservePortRequest*,
                                        v1::ReservePortResponse* response) {
  auto port = common::FindFreePort(/*loopback=*/false);
  if (!port.ok()) return common::ToGrpcStatus(port.status());
  response->set_port(*port);
  return grpc::Status::OK;
}

grpc::Status WorkerService::Unload(grpc::ServerContext*, const v1::UnloadRequest* request,
                                   v1::UnloadResponse* response) {
  std::shared_ptr<LoadedJob> job;
  {
    absl::MutexLock lock(&mu_);
    auto it = jobs_.find(request->job_id());
    if (it != jobs_.end()) {
      job = std::move(it->second);
      jobs_.erase(it);
    }
  }
  response->set_was_loaded(job != nullptr);
  return grpc::Status::OK;  // the shard is freed when the last in-flight forward lets go of it
}

}  // namespace bertshard::worker
