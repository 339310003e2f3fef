#include "server/placement.h"

#include <map>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/device.h"

namespace bertshard::server {
namespace {

bool IsGpu(absl::string_view device) { return common::CudaIndex(device).has_value(); }

// "1 worker", "2 workers".
std::string Count(size_t n, absl::string_view one, absl::string_view many) {
  return absl::StrCat(n, " ", n == 1 ? one : many);
}

}  // namespace

absl::StatusOr<std::string> NormaliseBackend(absl::string_view backend) {
  const std::string lower = absl::AsciiStrToLower(backend);
  if (lower.empty() || lower == "gloo") return std::string("gloo");
  if (lower == "nccl") return std::string("nccl");
  return absl::InvalidArgumentError(
      absl::StrCat("unknown backend '", backend, "'; valid: gloo (CPU workers, the default), nccl (GPU workers)"));
}

absl::Status CheckDevice(absl::string_view device) {
  if (device.empty() || device == "cpu" || IsGpu(device)) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("unknown device '", device, "'; valid: cpu, cuda:N (N >= 0)"));
}

std::string HostOf(absl::string_view address) {
  if (absl::StartsWith(address, "[")) {
    const size_t close = address.find(']');
    return std::string(close == absl::string_view::npos ? address : address.substr(0, close + 1));
  }
  const size_t colon = address.rfind(':');
  if (colon == absl::string_view::npos || address.find(':') != colon) return std::string(address);
  return std::string(address.substr(0, colon));
}

Placement PlaceRanks(absl::string_view backend, int need, const std::vector<IdleWorker>& idle) {
  const bool gpu = backend == "nccl";
  Placement placement;
  std::map<std::pair<std::string, std::string>, std::vector<std::string>> by_gpu;  // (host, device) -> workers
  for (size_t i = 0; i < idle.size(); ++i) {
    const IdleWorker& w = idle[i];
    if (IsGpu(w.device) != gpu) continue;
    if (gpu) {
      auto& claimants = by_gpu[{HostOf(w.address), w.gpu_bus_id.empty() ? w.device : w.gpu_bus_id}];
      claimants.push_back(absl::StrCat(w.worker_id, " at ", w.address, " as ", w.device));
      if (claimants.size() > 1) continue;  // that GPU has a rank already
    }
    if (static_cast<int>(placement.ranks.size()) < need) placement.ranks.push_back(i);
  }
  const int found = static_cast<int>(placement.ranks.size());
  if (found >= need) return placement;
  placement.ranks.clear();
  if (!gpu) {
    placement.waiting_for = absl::StrCat(
        "waiting for ", Count(static_cast<size_t>(need), "healthy idle CPU worker", "healthy idle CPU workers"),
        " (gloo); ", found, found == 1 ? " is" : " are", " free");
    return placement;
  }
  placement.waiting_for = absl::StrCat(
      "waiting for ",
      Count(static_cast<size_t>(need), "healthy idle GPU worker", "healthy idle GPU workers on distinct GPUs"),
      " (nccl: one rank per GPU); ", Count(static_cast<size_t>(found), "distinct GPU is", "distinct GPUs are"),
      " free");
  std::vector<std::string> shared;
  for (const auto& [gpu_of_host, workers] : by_gpu) {
    if (workers.size() > 1) {
      shared.push_back(absl::StrCat("GPU ", gpu_of_host.second, " of ", gpu_of_host.first, " is reported by ",
                                    workers.size(), " workers (", absl::StrJoin(workers, ", "), ")"));
    }
  }
  if (!shared.empty()) {
    absl::StrAppend(&placement.waiting_for, "; ", absl::StrJoin(shared, "; "),
                    ", and counts once: give each worker a GPU of its own (--device, CUDA_VISIBLE_DEVICES)");
  }
  return placement;
}

}  // namespace bertshard::server
