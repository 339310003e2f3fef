// File: model/collectives.h
// -----------------------------------------------------------------------------
// The communication a rank of a sharded BERT needs: collectives over its stage's tensor-parallel
// group and point-to-point transfers of activations between pipeline stages. This is bertshard's
// own interface, not a c10d one: the worker implements it with Gloo process groups and shared
// memory on CPU, and with NCCL communicators on CUDA (worker/collectives_backend.h picks one by
// backend name); SingleRankCollectives serves an unsharded model.
//
// Every method returns a Status instead of throwing. After an error the group is unusable (a
// failed collective can desynchronise the ranks): callers end the rank.
//
// Thread safety: implementations are thread-compatible (one forward at a time).
#ifndef BERTSHARD_MODEL_COLLECTIVES_H_
#define BERTSHARD_MODEL_COLLECTIVES_H_

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace bertshard::model {

class Collectives {
 public:
  virtual ~Collectives() = default;

  virtual int tp_size() const = 0;
  virtual int tp_rank() const = 0;

  // Sum over the TP group, in place.
  virtual absl::Status AllReduceSum(at::Tensor& tensor) = 0;
  // Concatenation of every TP rank's `tensor` along `dim`, in TP rank order.
  virtual absl::StatusOr<at::Tensor> AllGather(const at::Tensor& tensor, int64_t dim) = 0;
  // Sum over the TP group, then this rank's 1/tp_size part along `dim` (which it must divide).
  virtual absl::StatusOr<at::Tensor> ReduceScatter(const at::Tensor& tensor, int64_t dim) = 0;

  // Pipeline transfers between global ranks; `tag` pairs a send with its receive. Recv fills a
  // tensor of the expected shape. Send may return before the transfer is done, so that a stage
  // computes its next micro-batch while the receiver is still busy; `tensor` must not change
  // until WaitForSends returns, which reports a failed transfer.
  virtual absl::Status Send(const at::Tensor& tensor, int dst_rank, int tag) = 0;
  virtual absl::Status Recv(at::Tensor& tensor, int src_rank, int tag) = 0;
  // Returns once every Send so far has completed (at once where Send itself waits).
  virtual absl::Status WaitForSends() { return absl::OkStatus(); }
  // Whether Send returns before its receive is posted. The pipeline's schedule depends on it: a
  // stage may send several micro-batches ahead only where sends do not wait for their receivers.
  virtual bool SendsReturnAtOnce() const { return false; }
  // Returns once the device work queued so far on this rank (compute and communication) is done,
  // within the group's timeout, or with the error it met. Where collectives complete on the host
  // before they return (Gloo on CPU) there is nothing to wait for. On a GPU, calls only queue
  // work, and a failure (a peer gone mid-collective) shows here: the model calls it before it
  // copies outputs to the host, a copy that would otherwise wait on a stuck GPU for ever.
  virtual absl::Status Synchronize() { return absl::OkStatus(); }

  // Returns once every rank of the world has called it (benchmarks time one forward from a common
  // start; forwards themselves never need it).
  virtual absl::Status Barrier() = 0;
};

// One rank, no peers: collectives are identities and transfers are errors.
class SingleRankCollectives final : public Collectives {
 public:
  int tp_size() const override { return 1; }
  int tp_rank() const override { return 0; }
  absl::Status AllReduceSum(at::Tensor&) override { return absl::OkStatus(); }
  absl::StatusOr<at::Tensor> AllGather(const at::Tensor& tensor, int64_t) override { return tensor; }
  absl::StatusOr<at::Tensor> ReduceScatter(const at::Tensor& tensor, int64_t) override { return tensor; }
  absl::Status Send(const at::Tensor&, int, int) override {
    return absl::InternalError("a single rank has no pipeline peer to send to");
  }
  absl::Status Recv(at::Tensor&, int, int) override {
    return absl::InternalError("a single rank has no pipeline peer to receive from");
  }
  absl::Status Barrier() override { return absl::OkStatus(); }
};

}  // namespace bertshard::model

#endif  // BERTSHARD_MODEL_COLLECTIVES_H_
