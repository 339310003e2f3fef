#include "worker/gpu_placement.h"

#include "absl/strings/str_cat.h"

namespace bertshard::worker {

absl::StatusOr<int> GpuForRank(int rank, int ranks_on_host, int devices) {
  if (devices < 1) return absl::FailedPreconditionError("no CUDA device visible");
  if (ranks_on_host > devices) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the nccl backend runs one rank per GPU, and NCCL refuses two on one: ", ranks_on_host,
        " ranks on this host, ", devices, " GPU", devices == 1 ? "" : "s",
        " visible (use tp x pp <= the GPU count, check CUDA_VISIBLE_DEVICES, or use --backend gloo)"));
  }
  if (rank < 0) return absl::InvalidArgumentError(absl::StrCat("rank ", rank, " is negative"));
  return rank % devices;
}

}  // namespace bertshard::worker
