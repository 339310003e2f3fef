// File: worker/gpu_placement.h
// -----------------------------------------------------------------------------
// Which GPU a rank of an NCCL job runs on, and the check made before any NCCL call: NCCL refuses
// two ranks of one communicator on one GPU, and says so only deep inside ncclCommInitRank
// ("Duplicate GPU detected"), after the rendezvous and the load. Free of CUDA, so that it is
// tested on every machine.
//
// Thread safety: stateless functions.
#ifndef BERTSHARD_WORKER_GPU_PLACEMENT_H_
#define BERTSHARD_WORKER_GPU_PLACEMENT_H_

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace bertshard::worker {

// The device of `rank` among `devices` visible GPUs: rank mod devices. `ranks_on_host`: how many
// ranks of the job run on this host (0: not known here, as for a worker that holds one rank).
// FAILED_PRECONDITION without a GPU, or when the host's ranks outnumber its GPUs (naming both
// counts and what to change).
absl::StatusOr<int> GpuForRank(int rank, int ranks_on_host, int devices);

// A worker's --device: -1 for "cpu" (it serves Gloo), N for "cuda:N" (it serves NCCL on GPU N).
// INVALID_ARGUMENT otherwise, naming the valid forms.
absl::StatusOr<int> ParseWorkerDevice(absl::string_view device);

// GPU `gpu` among `devices` visible ones: FAILED_PRECONDITION naming both when it is not there.
absl::Status CheckGpuVisible(int gpu, int devices);

}  // namespace bertshard::worker

#endif  // BERTSHARD_WORKER_GPU_PLACEMENT_H_
