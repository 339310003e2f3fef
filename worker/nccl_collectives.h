// File: worker/nccl_collectives.h
// -----------------------------------------------------------------------------
// Collectives (model/collectives.h) over NCCL on CUDA tensors, for the `nccl` backend: direct
// NCCL calls (all-reduce, all-gather, reduce-scatter, send/recv) on a stream of this rank's GPU
// (rank mod the visible device count). The NCCL unique ids travel through the same TCPStore
// rendezvous as Gloo's. Built only with --config=cuda; running it needs a CUDA-enabled LibTorch
// (Debian's is CPU-only; see README).
//
// Communicators are non-blocking and every wait polls with a deadline: a dead peer or a stuck
// collective aborts the communicator and returns UNAVAILABLE instead of hanging, and no error
// ever exits the process (unlike FasterTransformer's NCCLCHECK).
//
// Thread safety: thread-compatible.
#ifndef BERTSHARD_WORKER_NCCL_COLLECTIVES_H_
#define BERTSHARD_WORKER_NCCL_COLLECTIVES_H_

#include <memory>

#include "absl/status/statusor.h"
#include "model/collectives.h"
#include "worker/gloo_collectives.h"

namespace bertshard::worker {

class NcclCollectives final : public model::Collectives {
 public:
  // The CUDA device this rank uses, or FAILED_PRECONDITION when there is no usable GPU.
  // `rank`'s GPU (worker/gpu_placement.h); `ranks_on_host` 0 when not known here.
  static absl::StatusOr<int> DeviceForRank(int rank, int ranks_on_host = 0);

  // Rendezvous as in GlooOptions; builds the world and TP communicators. FAILED_PRECONDITION
  // without a GPU, UNAVAILABLE when peers do not arrive or NCCL fails.
  static absl::StatusOr<std::unique_ptr<NcclCollectives>> Connect(const GlooOptions& options);
  ~NcclCollectives() override;

  int tp_size() const override;
  int tp_rank() const override;
  absl::Status AllReduceSum(at::Tensor& tensor) override;
  absl::StatusOr<at::Tensor> AllGather(const at::Tensor& tensor, int64_t dim) override;
  absl::StatusOr<at::Tensor> ReduceScatter(const at::Tensor& tensor, int64_t dim) override;
  absl::Status Send(const at::Tensor& tensor, int dst_rank, int tag) override;
  absl::Status Recv(at::Tensor& tensor, int src_rank, int tag) override;
  absl::Status Barrier() override;

 private:
  struct State;
  explicit NcclCollectives(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace bertshard::worker

#endif  // BERTSHARD_WORKER_NCCL_COLLECTIVES_H_
