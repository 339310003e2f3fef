#include "worker/rank_runner.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <sys/resource.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "bertshard/v1/plan.pb.h"
#include "checkpoint/safetensors.h"
#include "common/file.h"
#include "common/secure_random.h"
#include "common/status_macros.h"
#include "model/bert_shard.h"
#include "model/gemm.h"
#include "nlohmann/json.hpp"
#include "planner/model_config.h"
#include "worker/collectives_backend.h"
#include "worker/math_threads.h"
#include "worker/rendezvous.h"
#include "worker/shard_loader.h"

namespace bertshard::worker {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point since) { return std::chrono::duration<double>(Clock::now() - since).count(); }

// {"rows": R, "seq": L, "choices": C, "input_ids": [R*L], "attention_mask": [...], "token_type_ids": [...]}
absl::StatusOr<model::ModelInputs> ReadInputs(const std::string& path) {
  ASSIGN_OR_RETURN(std::string text, common::ReadFileToString(path, "inputs"));
  const auto j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return absl::InvalidArgumentError(absl::StrCat(path, " is not JSON"));
  const int64_t rows = j.value("rows", int64_t{0}), seq = j.value("seq", int64_t{0});
  model::ModelInputs inputs;
  inputs.choices = j.value("choices", int64_t{1});
  auto tensor = [&](const char* key) -> absl::StatusOr<at::Tensor> {
    if (!j.contains(key) || !j[key].is_array() || static_cast<int64_t>(j[key].size()) != rows * seq) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": ", key, " must hold rows x seq integers"));
    }
    return at::tensor(j[key].get<std::vector<int64_t>>(), at::kLong).view({rows, seq});
  };
  ASSIGN_OR_RETURN(inputs.input_ids, tensor("input_ids"));
  ASSIGN_OR_RETURN(inputs.attention_mask, tensor("attention_mask"));
  ASSIGN_OR_RETURN(inputs.token_type_ids, tensor("token_type_ids"));
  return inputs;
}

int64_t PeakRssBytes() {
  struct rusage usage;
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<int64_t>(usage.ru_maxrss) * 1024;  // Linux reports KiB
}

// Written beside `path` and renamed into place: a reader polling for it never sees half a number.
absl::Status WritePortFile(const std::string& path, int port) {
  const std::string partial = path + ".partial";
  {
    std::ofstream out(partial);
    out << port << "\n";
    if (!out.flush()) return absl::InternalError(absl::StrCat("cannot write the port file ", partial));
  }
  if (std::rename(partial.c_str(), path.c_str()) != 0) {
    return absl::InternalError(absl::StrCat("cannot rename ", partial, " to ", path));
  }
  return absl::OkStatus();
}

absl::Status WriteOutputs(const std::string& path, const std::map<std::string, at::Tensor>& outputs) {
  std::vector<checkpoint::TensorData> tensors;
  for (const auto& [name, t] : outputs) {
    const at::Tensor c = t.contiguous().to(at::kFloat);
    checkpoint::TensorData data;
    data.name = name;
    data.shape.assign(c.sizes().begin(), c.sizes().end());
    data.values.assign(c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
    tensors.push_back(std::move(data));
  }
  return checkpoint::WriteSafetensors(path, tensors, {{"format", "pt"}});
}

}  // namespace

absl::Status RunRank(const RankOptions& o) {
  SetMathThreads(o.threads);
  const auto start = Clock::now();
  ASSIGN_OR_RETURN(std::string plan_bytes, common::ReadFileToString(o.plan_path, "plan"));
  v1::ShardPlan plan;
  if (!plan.ParseFromString(plan_bytes)) {
    return absl::InvalidArgumentError(absl::StrCat(o.plan_path, " is not a ShardPlan"));
  }
  ASSIGN_OR_RETURN(model::ModelInputs inputs, ReadInputs(o.inputs_path));
  RETURN_IF_ERROR(CheckBackend(o.backend));
  ShardLoadOptions options;
  options.checkpoint = o.checkpoint;
  options.collectives.backend = o.backend;
  options.collectives.shared_memory = o.shared_memory;
  if (o.backend == "nccl") {
    // `shardctl run --local`: every rank on this host, so each needs a GPU of its own.
    ASSIGN_OR_RETURN(options.collectives.gpu, GpuForLocalRank(o.rank, /*ranks_on_host=*/plan.world_size()));
    options.load.device = c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(options.collectives.gpu));
  }
  // Hosted first, before the load, so that the launcher can start the other ranks (which need the
  // port) while this one loads.
  RendezvousOptions& rendezvous = options.collectives.rendezvous;
  rendezvous.master_addr = o.master_addr;
  rendezvous.master_port = o.master_port;
  rendezvous.timeout = std::chrono::seconds(o.timeout_seconds);
  if (o.secret_file.empty()) return absl::InvalidArgumentError("a rendezvous secret file is required");
  ASSIGN_OR_RETURN(rendezvous.secret, common::ReadSecretFile(o.secret_file));
  if (o.master_port == 0) {
    if (o.rank != 0 || o.port_file.empty()) {
      return absl::InvalidArgumentError("master_port 0 (a port the system picks) is for rank 0, with a port file");
    }
    ASSIGN_OR_RETURN(auto store, HostStore(o.master_addr, rendezvous.secret, rendezvous.timeout));
    rendezvous.master_port = store->getPort();
    RETURN_IF_ERROR(WritePortFile(o.port_file, rendezvous.master_port));
    rendezvous.store = std::move(store);
  }
  std::optional<model::GemmChoice> measured;
  double pick_seconds = 0;
  if (o.gemm.has_value()) {
    options.load.gemm = *o.gemm;
  } else if (options.load.device.is_cpu()) {
    // The threads are set: the figures are those of the forwards.
    const auto pick_start = Clock::now();
    measured = model::PickGemmPathForPlan(plan);
    pick_seconds = Seconds(pick_start);
    options.load.gemm = measured->path;
  }
  double load_seconds = 0;
  Clock::time_point connect_start;
  options.loaded = [&](const model::BertShard& shard) {
    SetMathThreads(o.threads, shard.gemm_path() == model::GemmPath::kBlas);
    // Without the pick, so that load times compare with runs that name their path.
    load_seconds = Seconds(start) - pick_seconds;
    connect_start = Clock::now();
  };
  ASSIGN_OR_RETURN(LoadedShard loaded, LoadAndConnect(plan, o.rank, options));
  const double connect_seconds = Seconds(connect_start);
  const std::unique_ptr<model::BertShard>& shard = loaded.shard;
  const std::unique_ptr<model::Collectives>& comm = loaded.collectives.comm;

  std::map<std::string, at::Tensor> outputs;
  std::vector<double> forward_seconds;
  for (int i = 0; i < std::max(1, o.iterations); ++i) {
    // All ranks start each forward together, so that the slowest rank's time is one forward's
    // latency. Without it, stage 0 would start forward i+1 while the last stage still runs i, and
    // back-to-back pipeline iterations would look faster than any single forward is.
    if (o.iterations > 1) RETURN_IF_ERROR(comm->Barrier());
    const auto forward_start = Clock::now();
    // Forward returns once the GPU's work is done (it synchronises before handing back the
    // outputs), so the time is the GPU's.
    ASSIGN_OR_RETURN(outputs, shard->Forward(inputs, o.micro_batches, comm.get()));
    forward_seconds.push_back(Seconds(forward_start));
  }
  const bool writes_outputs = shard->holds_heads() && comm->tp_rank() == 0;
  if (writes_outputs) RETURN_IF_ERROR(WriteOutputs(o.output_path, outputs));

  nlohmann::json report = {
      {"rank", o.rank},
      {"stage", shard->stage()},
      {"tp_rank", comm->tp_rank()},
      {"load_seconds", load_seconds},
      {"connect_seconds", connect_seconds},
      {"forward_seconds", forward_seconds.back()},
      {"forward_seconds_all", forward_seconds},
      {"peak_rss_bytes", PeakRssBytes()},
      {"checkpoint_bytes_read", loaded.checkpoint_bytes_read},
      {"param_bytes", shard->param_bytes()},
      {"padding_bytes", shard->padding_bytes()},
      {"wrote_outputs", writes_outputs},
      {"gemm", std::string(model::GemmPathName(shard->gemm_path()))},
      {"dtype", planner::DtypeName(plan.dtype())},
      {"tp_transport", loaded.collectives.tp_transport},
  };
  if (measured.has_value()) {
    nlohmann::json gflops = {{"blas", measured->blas_gflops}};
    if (measured->onednn_gflops > 0) gflops["onednn"] = measured->onednn_gflops;
    report["gemm_gflops"] = gflops;
    report["gemm_pick_seconds"] = pick_seconds;
  }
  std::ofstream out(o.report_path);
  out << report.dump() << "\n";
  if (!out) return absl::InternalError(absl::StrCat("cannot write report ", o.report_path));
  return absl::OkStatus();
}

}  // namespace bertshard::worker
