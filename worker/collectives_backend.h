// File: worker/collectives_backend.h
// -----------------------------------------------------------------------------
// The one place that turns a backend name into a rank's model::Collectives, and the one place
// that knows whether this build has NCCL (BERTSHARD_WITH_NCCL, set by worker/BUILD under
// --config=cuda). Backends:
//   - "gloo": CPU tensors over c10d Gloo (worker/gloo_collectives.h); a stage's TP collectives go
//     through shared memory where its ranks share a host, unless `shared_memory` is false.
//   - "nccl": CUDA tensors over NCCL (worker/nccl_collectives.h); only in --config=cuda builds.
// Everything above it (the shard loader, shard-worker, shard-rank) is the same in every build.
//
// Example:
//   RETURN_IF_ERROR(CheckBackend(request.backend()));     // before anything is read
//   ASSIGN_OR_RETURN(ConnectedCollectives comm,
//                    ConnectCollectives({.backend = "gloo", .rendezvous = {...}, .tp_size = 2}));
//
// Errors: an unknown name is INVALID_ARGUMENT naming the valid ones; "nccl" in a build without it
// is FAILED_PRECONDITION saying how to build it; connecting fails as the backend does
// (UNAVAILABLE when peers do not arrive in time).
//
// Thread safety: thread-safe (free functions; each call connects a group of its own).
#ifndef BERTSHARD_WORKER_COLLECTIVES_BACKEND_H_
#define BERTSHARD_WORKER_COLLECTIVES_BACKEND_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "model/collectives.h"
#include "worker/rendezvous.h"

namespace bertshard::worker {

struct CollectivesOptions {
  std::string backend = "gloo";  // "gloo" or "nccl"
  RendezvousOptions rendezvous;
  int tp_size = 1;  // ranks stage*tp .. stage*tp+tp-1 form a stage's TP group
  // gloo: the address its transport binds to (GlooOptions::bind_host), and whether a stage's TP
  // collectives may go through shared memory.
  std::string bind_host;
  bool shared_memory = true;
  // nccl: the GPU this rank uses, or -1: the rank's (NcclCollectives::DeviceForRank).
  int gpu = -1;
};

struct ConnectedCollectives {
  std::unique_ptr<model::Collectives> comm;
  // How the TP collectives travel: "shared memory", "gloo" or "none" (TP 1) for gloo; "nccl".
  std::string tp_transport;
};

// OK when `backend` can be connected in this build; the errors above otherwise.
absl::Status CheckBackend(absl::string_view backend);

// Joins the rendezvous and builds the backend's groups (CheckBackend's errors first).
absl::StatusOr<ConnectedCollectives> ConnectCollectives(const CollectivesOptions& options);

// The GPU rank `rank` of an nccl job uses when `ranks_on_host` of its ranks share this host
// (shard-rank: all of them): FAILED_PRECONDITION without a CUDA-enabled LibTorch or enough GPUs,
// or in a build without NCCL.
absl::StatusOr<int> GpuForLocalRank(int rank, int ranks_on_host);

// A GPU worker's (--device=cuda:N, `gpu` N) PCI bus id, which the coordinator places ranks by.
// FAILED_PRECONDITION when the GPU is not visible, and in a build without NCCL; the message
// starts with "--device=<device>".
absl::StatusOr<std::string> WorkerGpuBusId(absl::string_view device, int gpu);

}  // namespace bertshard::worker

#endif  // BERTSHARD_WORKER_COLLECTIVES_BACKEND_H_
