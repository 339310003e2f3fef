#include "worker/gpu_placement.h"

#include <optional>

#include "absl/strings/str_cat.h"
#include "common/device.h"

namespace bertshard::worker {

absl::StatusOr<int> GpuForRank(int rank, int ranks_on_host, int devices) {
  if (devices < 1) return absl::FailedPreconditionError("no CUDA device visible");
  if (ranks_on_host > devices) {
    return absl::FailedPreconditionError(
        absl::StrCat("the nccl backend runs one rank per GPU, and NCCL refuses two on one: ", ranks_on_host,
                     " ranks on this host, ", devices, " GPU", devices == 1 ? "" : "s",
                     " visible (use tp x pp <= the GPU count, check CUDA_VISIBLE_DEVICES, or use --backend gloo)"));
  }
  if (rank < 0) return absl::InvalidArgumentError(absl::StrCat("rank ", rank, " is negative"));
  return rank % devices;
}

absl::StatusOr<int> ParseWorkerDevice(absl::string_view device) {
  if (device == "cpu") return -1;
  if (const std::optional<int> gpu = common::CudaIndex(device)) return *gpu;
  return absl::InvalidArgumentError(
      absl::StrCat("--device '", device, "': valid: cpu (serves gloo), cuda:N (serves nccl on GPU N)"));
}

absl::Status CheckGpuVisible(int gpu, int devices) {
  if (gpu >= 0 && gpu < devices) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat("cuda:", gpu, " is not a visible GPU: ", devices, " GPU",
                                                    devices == 1 ? " is" : "s are",
                                                    " visible (check --device and CUDA_VISIBLE_DEVICES)"));
}

}  // namespace bertshard::worker
