#include "worker/collectives_backend.h"

#include <errno.h>  // program_invocation_short_name (glibc)

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/gloo_collectives.h"
#ifdef BERTSHARD_WITH_NCCL
#include <ATen/Context.h>

#include "worker/nccl_collectives.h"
#endif

namespace bertshard::worker {
namespace {

#ifndef BERTSHARD_WITH_NCCL
// "this shard-rank was built without NCCL: ...": the binary's own name, whichever serves.
absl::Status NoNccl() {
  return absl::FailedPreconditionError(
      absl::StrCat("this ", program_invocation_short_name, " was built without NCCL: bazel build --config=cuda"));
}
#endif

}  // namespace

absl::Status CheckBackend(absl::string_view backend) {
  if (backend == "gloo") return absl::OkStatus();
  if (backend == "nccl") {
#ifdef BERTSHARD_WITH_NCCL
    return absl::OkStatus();
#else
    return NoNccl();
#endif
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown backend ", backend, "; valid: gloo, nccl"));
}

absl::StatusOr<ConnectedCollectives> ConnectCollectives(const CollectivesOptions& options) {
  RETURN_IF_ERROR(CheckBackend(options.backend));
  ConnectedCollectives connected;
  if (options.backend == "gloo") {
    ASSIGN_OR_RETURN(auto gloo, GlooCollectives::Connect({.rendezvous = options.rendezvous,
                                                          .tp_size = options.tp_size,
                                                          .bind_host = options.bind_host,
                                                          .shared_memory = options.shared_memory}));
    connected.tp_transport = gloo->tp_transport();
    connected.comm = std::move(gloo);
    return connected;
  }
#ifdef BERTSHARD_WITH_NCCL
  // NCCL picks its own transport.
  ASSIGN_OR_RETURN(
      connected.comm,
      NcclCollectives::Connect({.rendezvous = options.rendezvous, .tp_size = options.tp_size, .gpu = options.gpu}));
  connected.tp_transport = "nccl";
  return connected;
#else
  return NoNccl();  // not reached: CheckBackend refused it
#endif
}

absl::StatusOr<int> GpuForLocalRank(int rank, int ranks_on_host) {
#ifdef BERTSHARD_WITH_NCCL
  if (!at::hasCUDA()) {
    return absl::FailedPreconditionError(
        "the nccl backend needs a CUDA-enabled LibTorch (build with BERTSHARD_LIBTORCH set; see README)");
  }
  return NcclCollectives::DeviceForRank(rank, ranks_on_host);
#else
  (void)rank;
  (void)ranks_on_host;
  return NoNccl();
#endif
}

absl::StatusOr<std::string> WorkerGpuBusId(absl::string_view device, int gpu) {
#ifdef BERTSHARD_WITH_NCCL
  if (absl::Status visible = NcclCollectives::RequireGpu(gpu); !visible.ok()) {
    return absl::Status(visible.code(), absl::StrCat("--device=", device, ": ", visible.message()));
  }
  absl::StatusOr<std::string> bus_id = NcclCollectives::GpuBusId(gpu);
  if (!bus_id.ok()) {
    return absl::Status(bus_id.status().code(), absl::StrCat("--device=", device, ": ", bus_id.status().message()));
  }
  return bus_id;
#else
  (void)gpu;
  return absl::FailedPreconditionError(
      absl::StrCat("--device=", device, " needs a build with NCCL: bazel build --config=cuda"));
#endif
}

}  // namespace bertshard::worker
