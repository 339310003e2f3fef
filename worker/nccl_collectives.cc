#include "worker/nccl_collectives.h"

#include <ATen/ATen.h>
#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/gpu_placement.h"
#include "worker/rendezvous.h"

namespace bertshard::worker {
namespace {

using Clock = std::chrono::steady_clock;

absl::Status CudaStatus(cudaError_t error, absl::string_view what) {
  if (error == cudaSuccess) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(what, ": ", cudaGetErrorString(error)));
}

// ncclInProgress is the normal answer of a non-blocking communicator.
absl::Status NcclStatus(ncclResult_t result, absl::string_view what) {
  if (result == ncclSuccess || result == ncclInProgress) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat(what, ": ", ncclGetErrorString(result)));
}

absl::Status RequireCuda(const at::Tensor& t) {
  if (!t.is_cuda()) {
    return absl::FailedPreconditionError(
        "the nccl backend needs CUDA tensors: run with a CUDA-enabled LibTorch (see README)");
  }
  if (t.scalar_type() != at::kFloat) return absl::InternalError("NCCL collectives expect float32 tensors");
  return absl::OkStatus();
}

}  // namespace

struct NcclCollectives::State {
  GlooOptions options;
  int device = 0;
  int tp_rank = 0;
  cudaStream_t stream = nullptr;
  ncclComm_t world = nullptr;
  ncclComm_t tp = nullptr;
  c10::intrusive_ptr<c10d::Store> store;
  int64_t barriers = 0;  // Barrier() calls so far: each uses its own store keys

  // Waits for a communicator to finish initialising or for the stream's work, polling NCCL's
  // asynchronous error; past the deadline both communicators are aborted.
  absl::Status WaitComm(ncclComm_t comm, absl::string_view what) {
    const auto deadline = Clock::now() + options.timeout;
    while (true) {
      ncclResult_t async = ncclSuccess;
      RETURN_IF_ERROR(NcclStatus(ncclCommGetAsyncError(comm, &async), what));
      if (async == ncclSuccess) return absl::OkStatus();
      if (async != ncclInProgress) return Abort(absl::StrCat(what, ": ", ncclGetErrorString(async)));
      if (Clock::now() > deadline) return Abort(absl::StrCat(what, " timed out"));
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  absl::Status WaitStream(ncclComm_t comm, absl::string_view what) {
    RETURN_IF_ERROR(WaitComm(comm, what));
    const auto deadline = Clock::now() + options.timeout;
    while (true) {
      const cudaError_t e = cudaStreamQuery(stream);
      if (e == cudaSuccess) return absl::OkStatus();
      if (e != cudaErrorNotReady) return Abort(absl::StrCat(what, ": ", cudaGetErrorString(e)));
      ncclResult_t async = ncclSuccess;
      ncclCommGetAsyncError(comm, &async);
      if (async != ncclSuccess && async != ncclInProgress) {
        return Abort(absl::StrCat(what, ": ", ncclGetErrorString(async)));
      }
      if (Clock::now() > deadline) return Abort(absl::StrCat(what, " timed out (a peer is gone?)"));
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }

  absl::Status Abort(const std::string& why) {
    if (tp != nullptr) ncclCommAbort(tp);
    if (world != nullptr) ncclCommAbort(world);
    tp = world = nullptr;
    return absl::UnavailableError(why);
  }

  absl::StatusOr<ncclComm_t> InitComm(const std::string& key, int nranks, int rank) {
    ncclUniqueId id;
    try {
      if (rank == 0) {
        RETURN_IF_ERROR(NcclStatus(ncclGetUniqueId(&id), "ncclGetUniqueId"));
        store->set(key, std::vector<uint8_t>(reinterpret_cast<uint8_t*>(&id), reinterpret_cast<uint8_t*>(&id) + sizeof(id)));
      } else {
        const std::vector<uint8_t> bytes = store->get(key);
        if (bytes.size() != sizeof(id)) return absl::InternalError("bad NCCL unique id in the store");
        std::memcpy(&id, bytes.data(), sizeof(id));
      }
    } catch (const std::exception& e) {
      return absl::UnavailableError(absl::StrCat("rendezvous for ", key, ": ", e.what()));
    }
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclComm_t comm = nullptr;
    RETURN_IF_ERROR(NcclStatus(ncclCommInitRankConfig(&comm, nranks, id, rank, &config), "ncclCommInitRankConfig"));
    RETURN_IF_ERROR(WaitComm(comm, absl::StrCat("NCCL init of ", key)));
    return comm;
  }
};

namespace {

// NCCL sums bf16 and fp16 natively (bf16 since NCCL 2.10), on the device: no widening needed.
absl::StatusOr<ncclDataType_t> NcclType(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return ncclFloat;
    case at::kBFloat16:
      return ncclBfloat16;
    case at::kHalf:
      return ncclHalf;
    default:
      return absl::InternalError(absl::StrCat("no NCCL type for ", c10::toString(t.scalar_type())));
  }
}

}  // namespace

absl::StatusOr<int> NcclCollectives::DeviceForRank(int rank, int ranks_on_host) {
  int count = 0;
  RETURN_IF_ERROR(CudaStatus(cudaGetDeviceCount(&count), "no usable CUDA device (cudaGetDeviceCount)"));
  return GpuForRank(rank, ranks_on_host, count);
}

NcclCollectives::NcclCollectives(std::unique_ptr<State> state) : state_(std::move(state)) {}

NcclCollectives::~NcclCollectives() {
  if (state_->tp != nullptr) ncclCommDestroy(state_->tp);
  if (state_->world != nullptr) ncclCommDestroy(state_->world);
  if (state_->stream != nullptr) cudaStreamDestroy(state_->stream);
}

absl::StatusOr<std::unique_ptr<NcclCollectives>> NcclCollectives::Connect(const GlooOptions& o) {
  if (o.world_size < 1 || o.tp_size < 1 || o.world_size % o.tp_size != 0 || o.rank < 0 || o.rank >= o.world_size) {
    return absl::InvalidArgumentError("inconsistent NCCL process group sizes");
  }
  auto state = std::make_unique<State>();
  state->options = o;
  state->tp_rank = o.rank % o.tp_size;
  ASSIGN_OR_RETURN(state->device, DeviceForRank(o.rank));
  RETURN_IF_ERROR(CudaStatus(cudaSetDevice(state->device), "cudaSetDevice"));
  RETURN_IF_ERROR(CudaStatus(cudaStreamCreateWithFlags(&state->stream, cudaStreamNonBlocking), "cudaStreamCreate"));
  ASSIGN_OR_RETURN(state->store, ConnectStore(o));
  ASSIGN_OR_RETURN(state->world, state->InitComm("nccl/world", o.world_size, o.rank));
  if (o.tp_size > 1) {
    ASSIGN_OR_RETURN(state->tp, state->InitComm(absl::StrCat("nccl/tp", o.rank / o.tp_size), o.tp_size,
                                                state->tp_rank));
  }
  return std::unique_ptr<NcclCollectives>(new NcclCollectives(std::move(state)));
}

int NcclCollectives::tp_size() const { return state_->options.tp_size; }
int NcclCollectives::tp_rank() const { return state_->tp_rank; }

absl::Status NcclCollectives::AllReduceSum(at::Tensor& tensor) {
  if (state_->tp == nullptr) return absl::OkStatus();
  RETURN_IF_ERROR(RequireCuda(tensor));
  at::Tensor t = tensor.contiguous();
  ASSIGN_OR_RETURN(const ncclDataType_t type, NcclType(t));
  RETURN_IF_ERROR(NcclStatus(ncclAllReduce(t.data_ptr(), t.data_ptr(), static_cast<size_t>(t.numel()),
                                           type, ncclSum, state_->tp, state_->stream), "ncclAllReduce"));
  RETURN_IF_ERROR(state_->WaitStream(state_->tp, "tensor-parallel all-reduce"));
  if (!t.is_same(tensor)) tensor.copy_(t);
  return absl::OkStatus();
}

absl::StatusOr<at::Tensor> NcclCollectives::AllGather(const at::Tensor& tensor, int64_t dim) {
  if (state_->tp == nullptr) return tensor;
  RETURN_IF_ERROR(RequireCuda(tensor));
  const at::Tensor in = tensor.contiguous();
  std::vector<int64_t> shape = {tp_size()};
  shape.insert(shape.end(), in.sizes().begin(), in.sizes().end());
  at::Tensor out = at::empty(shape, in.options());
  ASSIGN_OR_RETURN(const ncclDataType_t type, NcclType(in));
  RETURN_IF_ERROR(NcclStatus(ncclAllGather(in.data_ptr(), out.data_ptr(), static_cast<size_t>(in.numel()),
                                           type, state_->tp, state_->stream), "ncclAllGather"));
  RETURN_IF_ERROR(state_->WaitStream(state_->tp, "tensor-parallel all-gather"));
  return at::cat(out.unbind(0), dim);
}

absl::StatusOr<at::Tensor> NcclCollectives::ReduceScatter(const at::Tensor& tensor, int64_t dim) {
  if (state_->tp == nullptr) return tensor;
  RETURN_IF_ERROR(RequireCuda(tensor));
  if (tensor.size(dim) % tp_size() != 0) return absl::InternalError("reduce-scatter dim not divisible by tp");
  // Chunk j (along dim) goes to TP rank j.
  const at::Tensor in = at::stack(tensor.chunk(tp_size(), dim), 0).contiguous();
  at::Tensor out = at::empty(in.sizes().slice(1), in.options());
  ASSIGN_OR_RETURN(const ncclDataType_t type, NcclType(in));
  RETURN_IF_ERROR(NcclStatus(ncclReduceScatter(in.data_ptr(), out.data_ptr(), static_cast<size_t>(out.numel()),
                                               type, ncclSum, state_->tp, state_->stream), "ncclReduceScatter"));
  RETURN_IF_ERROR(state_->WaitStream(state_->tp, "tensor-parallel reduce-scatter"));
  return out;
}

absl::Status NcclCollectives::Send(const at::Tensor& tensor, int dst_rank, int /*tag*/) {
  // NCCL has no tags; ranks post transfers in the same route order, which pairs them.
  RETURN_IF_ERROR(RequireCuda(tensor));
  const at::Tensor t = tensor.contiguous();
  ASSIGN_OR_RETURN(const ncclDataType_t type, NcclType(t));
  RETURN_IF_ERROR(NcclStatus(ncclSend(t.data_ptr(), static_cast<size_t>(t.numel()), type, dst_rank,
                                      state_->world, state_->stream), "ncclSend"));
  return state_->WaitStream(state_->world, absl::StrCat("send to rank ", dst_rank));
}

absl::Status NcclCollectives::Recv(at::Tensor& tensor, int src_rank, int /*tag*/) {
  RETURN_IF_ERROR(RequireCuda(tensor));
  if (!tensor.is_contiguous()) return absl::InternalError("receive buffer must be contiguous");
  ASSIGN_OR_RETURN(const ncclDataType_t type, NcclType(tensor));
  RETURN_IF_ERROR(NcclStatus(ncclRecv(tensor.data_ptr(), static_cast<size_t>(tensor.numel()), type,
                                      src_rank, state_->world, state_->stream), "ncclRecv"));
  return state_->WaitStream(state_->world, absl::StrCat("receive from rank ", src_rank));
}

absl::Status NcclCollectives::Barrier() {
  // Through the rendezvous store: needs no device buffer, and waits with the store's timeout.
  return StoreBarrier(*state_->store, absl::StrCat("barrier/", state_->barriers++), state_->options.world_size);
}

}  // namespace bertshard::worker
