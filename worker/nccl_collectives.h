// File: worker/nccl_collectives.h
// -----------------------------------------------------------------------------
// Collectives (model/collectives.h) over NCCL on CUDA tensors, for the `nccl` backend: direct
// NCCL calls (all-reduce, all-gather, reduce-scatter, send/recv) on a communication stream of this
// rank's GPU (worker/gpu_placement.h), in float32, bfloat16 or float16. The NCCL unique ids travel
// through the same authenticated rendezvous as Gloo's (worker/rendezvous.h). Built only with --config=cuda; running it
// needs a CUDA-enabled LibTorch (Debian's is CPU-only; see README).
//
// Streams: the model computes on LibTorch's default stream (it never sets another); every NCCL
// call runs on this rank's own communication stream, ordered by CUDA events, not by the host:
//   - a call's NCCL work starts once the compute queued before it is done (the communication
//     stream waits on an event recorded on the compute stream);
//   - a collective's or a receive's result is ready for the compute queued after it (the compute
//     stream waits on the call's event), so the host never blocks and keeps queueing kernels;
//   - a send holds only the communication stream: the compute of the next micro-batch overlaps
//     it. Its tensor is kept until the send is done (WaitForSends, or the next call that finds it
//     finished), so that LibTorch's allocator never reuses its memory under NCCL.
// Every collective path exists at any size: the TP communicator is built even for one rank (a
// one-GPU host runs every collective through NCCL in tests; the model itself skips TP calls at
// tp 1). Calls are made from any thread: each sets the thread's current device to the rank's.
//
// Errors: communicators are non-blocking and every host wait polls with a deadline (the
// options' timeout): a dead peer or a stuck collective aborts the communicators and returns
// UNAVAILABLE instead of hanging; Synchronize (called by the model before it copies outputs to the
// host) is where a failure queued on the GPU surfaces. Its deadline covers all the work queued
// before it, so one forward must finish within the timeout. No error ever exits the process (unlike
// FasterTransformer's NCCLCHECK). After an error the object is unusable: every call fails.
//
// Thread safety: thread-compatible.
#ifndef BERTSHARD_WORKER_NCCL_COLLECTIVES_H_
#define BERTSHARD_WORKER_NCCL_COLLECTIVES_H_

#include <memory>

#include "absl/status/statusor.h"
#include "model/collectives.h"
#include "worker/rendezvous.h"

namespace bertshard::worker {

struct NcclOptions {
  RendezvousOptions rendezvous;  // its timeout also bounds every host wait on the GPU's work
  int tp_size = 1;               // ranks stage*tp .. stage*tp+tp-1 form a stage's TP group
  // The GPU this rank uses (a worker's --device), or -1: the rank's (DeviceForRank).
  int gpu = -1;
};

class NcclCollectives final : public model::Collectives {
 public:
  // The CUDA device this rank uses, or FAILED_PRECONDITION when there is no usable GPU.
  // `rank`'s GPU (worker/gpu_placement.h); `ranks_on_host` 0 when not known here.
  static absl::StatusOr<int> DeviceForRank(int rank, int ranks_on_host = 0);

  // OK when GPU `gpu` is visible to this process; FAILED_PRECONDITION naming the count otherwise.
  static absl::Status RequireGpu(int gpu);
  // GPU `gpu`'s PCI bus id ("0000:3B:00.0"): what tells a host's GPUs apart whatever
  // CUDA_VISIBLE_DEVICES numbers them (a worker reports it to the coordinator).
  static absl::StatusOr<std::string> GpuBusId(int gpu);

  // Joins the rendezvous (worker/rendezvous.h) and builds the world and TP communicators on
  // options.gpu. FAILED_PRECONDITION without a GPU, UNAVAILABLE when peers do not arrive or NCCL
  // fails.
  static absl::StatusOr<std::unique_ptr<NcclCollectives>> Connect(const NcclOptions& options);
  ~NcclCollectives() override;

  int tp_size() const override;
  int tp_rank() const override;
  absl::Status AllReduceSum(at::Tensor& tensor) override;
  absl::StatusOr<at::Tensor> AllGather(const at::Tensor& tensor, int64_t dim) override;
  absl::StatusOr<at::Tensor> ReduceScatter(const at::Tensor& tensor, int64_t dim) override;
  absl::Status Send(const at::Tensor& tensor, int dst_rank, int tag) override;
  absl::Status Recv(at::Tensor& tensor, int src_rank, int tag) override;
  absl::Status WaitForSends() override;
  absl::Status Synchronize() override;
  absl::Status Barrier() override;

 private:
  struct State;
  explicit NcclCollectives(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace bertshard::worker

#endif  // BERTSHARD_WORKER_NCCL_COLLECTIVES_H_
