// File: worker/gloo_collectives.h
// -----------------------------------------------------------------------------
// Collectives (model/collectives.h) over c10d ProcessGroupGloo on CPU: the authenticated rendezvous
// (worker/rendezvous.h) hosted by rank 0 (MASTER_ADDR/MASTER_PORT style), one process group over all ranks for the
// pipeline's point-to-point transfers, and one per pipeline stage for its tensor-parallel ranks.
// LibTorch 1.13's Gloo has no reduce-scatter: it is emulated with alltoall_base plus a local sum.
// Where a stage's TP ranks share a host, their collectives go through shared memory instead
// (worker/shm_group.h) and the stage has no TP Gloo group.
//
// Every c10d call is wrapped: a failure (peer gone, timeout) becomes UNAVAILABLE, and the groups
// are then unusable -- the rank must end (a failed collective can desynchronise the ranks).
//
// Thread safety: thread-compatible.
#ifndef BERTSHARD_WORKER_GLOO_COLLECTIVES_H_
#define BERTSHARD_WORKER_GLOO_COLLECTIVES_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "model/collectives.h"
#include "worker/rendezvous.h"
#include "worker/shm_group.h"

namespace bertshard::worker {

struct GlooOptions {
  RendezvousOptions rendezvous;
  int tp_size = 1;  // ranks stage*tp .. stage*tp+tp-1 form a stage's TP group
  // The address this rank's Gloo transport binds to: one of this host's own names or addresses
  // (a worker's advertised host). Empty: rendezvous.master_addr, which is only right when every
  // rank shares rank 0's host (loopback); on other hosts that name is not local and binding to it
  // fails.
  std::string bind_host;
  // Tensor-parallel collectives through shared memory where a stage's ranks share a host (and its
  // /dev/shm); Gloo where they do not, or when false. See worker/shm_group.h.
  bool shared_memory = true;
  ShmOptions shm;  // its timeout is rendezvous.timeout
};

class GlooCollectives final : public model::Collectives {
 public:
  // Joins the rendezvous and builds the groups. UNAVAILABLE if peers do not arrive in time;
  // INVALID_ARGUMENT for inconsistent sizes.
  static absl::StatusOr<std::unique_ptr<GlooCollectives>> Connect(const GlooOptions& options);
  ~GlooCollectives() override;

  int tp_size() const override;
  int tp_rank() const override;
  absl::Status AllReduceSum(at::Tensor& tensor) override;
  absl::StatusOr<at::Tensor> AllGather(const at::Tensor& tensor, int64_t dim) override;
  absl::StatusOr<at::Tensor> ReduceScatter(const at::Tensor& tensor, int64_t dim) override;
  absl::Status Send(const at::Tensor& tensor, int dst_rank, int tag) override;
  absl::Status Recv(at::Tensor& tensor, int src_rank, int tag) override;
  absl::Status WaitForSends() override;
  bool SendsReturnAtOnce() const override { return true; }
  absl::Status Barrier() override;

  // How the TP collectives travel: "shared memory", "gloo", or "none" (TP 1).
  std::string tp_transport() const;

 private:
  struct Groups;
  explicit GlooCollectives(std::unique_ptr<Groups> groups);
  std::unique_ptr<Groups> groups_;
};

}  // namespace bertshard::worker

#endif  // BERTSHARD_WORKER_GLOO_COLLECTIVES_H_
