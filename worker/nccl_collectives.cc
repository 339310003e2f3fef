#include "worker/nccl_collectives.h"

#include <ATen/ATen.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <cstring>
#include <deque>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/status_macros.h"
#include "worker/gpu_placement.h"
#include "worker/rendezvous.h"

namespace bertshard::worker {
namespace {

using Clock = std::chrono::steady_clock;

// LibTorch's default stream on the current device: where the model computes (bertshard never sets
// another current stream). Named here without c10_cuda, which Debian's CPU LibTorch lacks and CI
// links this file against.
const cudaStream_t kComputeStream = cudaStreamLegacy;

absl::Status CudaStatus(cudaError_t error, absl::string_view what) {
  if (error == cudaSuccess) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(what, ": ", cudaGetErrorString(error)));
}

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
      return absl::InternalError(absl::StrCat("NCCL collectives take float32, bfloat16 or float16 tensors, not ",
                                              c10::toString(t.scalar_type())));
  }
}

}  // namespace

struct NcclCollectives::State {
  NcclOptions options;
  int device = 0;
  int tp_rank = 0;
  cudaStream_t stream = nullptr;        // communication: every NCCL call
  cudaEvent_t compute_ready = nullptr;  // recorded on the compute stream before each call
  cudaEvent_t comm_done = nullptr;      // recorded on the communication stream after a result
  ncclComm_t world = nullptr;
  ncclComm_t tp = nullptr;
  c10::intrusive_ptr<c10d::Store> store;
  int64_t barriers = 0;  // Barrier() calls so far: each uses its own store keys
  // Sends queued and not yet seen done, oldest first: each holds its tensor, so that LibTorch's
  // allocator cannot hand the memory to new compute while NCCL still reads it.
  struct PendingSend {
    cudaEvent_t done = nullptr;
    at::Tensor tensor;
    int dst_rank = 0;
  };
  std::deque<PendingSend> sends;
  std::vector<cudaEvent_t> spare_events;  // for sends, reused
  std::string broken;                     // why the group failed; empty while it works

  absl::Status Usable() const {
    if (broken.empty()) return absl::OkStatus();
    return absl::UnavailableError(absl::StrCat("the NCCL group failed earlier: ", broken));
  }

  // Ends the group: both communicators aborted (their kernels stop), every later call refused.
  absl::Status Fail(const std::string& why) {
    if (broken.empty()) broken = why;
    AbortCommunicators();
    return absl::UnavailableError(why);
  }

  // An error the caller made (a tensor of the wrong kind): nothing was queued, but the peers are
  // in the collective this rank now skips, so the group ends all the same, with the error's code.
  absl::Status Refuse(absl::Status error) {
    if (broken.empty()) broken = std::string(error.message());
    AbortCommunicators();
    return error;
  }

  // Both at once: the two communicators queue on one stream, and an abort waits for its
  // communicator's work on it, which may sit behind the other's stuck kernel (a send to a dead
  // stage ahead of the next all-reduce): aborted one after the other, the first would never return.
  void AbortCommunicators() {
    std::thread tp_abort;
    if (tp != nullptr) {
      tp_abort = std::thread([comm = tp, device = device] {
        cudaSetDevice(device);
        ncclCommAbort(comm);
      });
    }
    if (world != nullptr) ncclCommAbort(world);
    if (tp_abort.joinable()) tp_abort.join();
    tp = world = nullptr;
  }

  // A CUDA error mid-forward leaves the queued work in doubt: the group ends.
  absl::Status Cuda(cudaError_t error, absl::string_view what) {
    if (error == cudaSuccess) return absl::OkStatus();
    return Fail(absl::StrCat(what, ": CUDA: ", cudaGetErrorString(error)));
  }

  // ncclInProgress is the normal answer of a non-blocking communicator.
  absl::Status Nccl(ncclResult_t result, ncclComm_t comm, absl::string_view what) {
    if (result == ncclSuccess || result == ncclInProgress) return absl::OkStatus();
    return Fail(absl::StrCat(what, ": ", ncclGetErrorString(result), Detail(comm)));
  }

  static std::string Detail(ncclComm_t comm) {
    const char* last = ncclGetLastError(comm);
    return last != nullptr && *last != '\0' ? absl::StrCat(" (", last, ")") : "";
  }

  // An error NCCL met in the background (a socket to a peer closed, ...), if any.
  absl::Status AsyncErrors(absl::string_view what) {
    for (ncclComm_t comm : {tp, world}) {
      if (comm == nullptr) continue;
      ncclResult_t async = ncclSuccess;
      const ncclResult_t asked = ncclCommGetAsyncError(comm, &async);
      if (asked != ncclSuccess) return Fail(absl::StrCat(what, ": ", ncclGetErrorString(asked)));
      if (async != ncclSuccess && async != ncclInProgress) {
        return Fail(absl::StrCat(what, ": ", ncclGetErrorString(async), Detail(comm)));
      }
    }
    return absl::OkStatus();
  }

  // A non-blocking communicator may answer a call (or its creation) before it has queued the work:
  // the next call waits until it has (ncclCommGetAsyncError no longer ncclInProgress). This is
  // the host's part only; the GPU work itself is not waited for.
  absl::Status WaitQueued(ncclComm_t comm, absl::string_view what) {
    const auto deadline = Clock::now() + options.rendezvous.timeout;
    for (int polls = 0;; ++polls) {
      ncclResult_t async = ncclSuccess;
      const ncclResult_t asked = ncclCommGetAsyncError(comm, &async);
      if (asked != ncclSuccess) return Fail(absl::StrCat(what, ": ", ncclGetErrorString(asked)));
      if (async == ncclSuccess) return absl::OkStatus();
      if (async != ncclInProgress) return Fail(absl::StrCat(what, ": ", ncclGetErrorString(async), Detail(comm)));
      if (Clock::now() > deadline) return Fail(absl::StrCat(what, " timed out"));
      Pause(polls);
    }
  }

  // NCCL's background thread usually queues a call within microseconds: yield for those first,
  // then sleep, so that a long wait does not hold a core.
  static void Pause(int polls) {
    if (polls < 64) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }

  // Waits, within the timeout, for `event` to complete, watching NCCL's background errors; a
  // peer gone mid-collective leaves the event pending for ever, so the deadline aborts the group.
  absl::Status WaitEvent(cudaEvent_t event, absl::string_view what) {
    const auto deadline = Clock::now() + options.rendezvous.timeout;
    for (int polls = 0;; ++polls) {
      const cudaError_t e = cudaEventQuery(event);
      if (e == cudaSuccess) return absl::OkStatus();
      if (e != cudaErrorNotReady) return Cuda(e, what);
      RETURN_IF_ERROR(AsyncErrors(what));
      if (Clock::now() > deadline) {
        return Fail(absl::StrCat(what, " timed out after ",
                                 absl::FormatDuration(absl::FromChrono(options.rendezvous.timeout)),
                                 " (a peer is gone or stuck?)"));
      }
      Pause(polls);
    }
  }

  // Lets go of the sends the GPU has finished, oldest first, without waiting.
  absl::Status ReapSends() {
    while (!sends.empty()) {
      const cudaError_t e = cudaEventQuery(sends.front().done);
      if (e == cudaErrorNotReady) return absl::OkStatus();
      RETURN_IF_ERROR(Cuda(e, absl::StrCat("send to rank ", sends.front().dst_rank)));
      spare_events.push_back(sends.front().done);
      sends.pop_front();
    }
    return absl::OkStatus();
  }

  // Queues `call` (an NCCL call on `comm`, given the communication stream) after the compute
  // queued so far. With `compute_waits`, the compute queued next starts only once it is done.
  template <typename Call>
  absl::Status Enqueue(ncclComm_t comm, absl::string_view what, bool compute_waits, Call call) {
    RETURN_IF_ERROR(Usable());
    RETURN_IF_ERROR(Cuda(cudaSetDevice(device), "cudaSetDevice"));  // the calling thread's device
    RETURN_IF_ERROR(ComputeStreamIsDefault());
    RETURN_IF_ERROR(ReapSends());
    RETURN_IF_ERROR(AsyncErrors(what));
    RETURN_IF_ERROR(Cuda(cudaEventRecord(compute_ready, kComputeStream), what));
    RETURN_IF_ERROR(Cuda(cudaStreamWaitEvent(stream, compute_ready, 0), what));
    RETURN_IF_ERROR(Nccl(call(stream), comm, what));
    RETURN_IF_ERROR(WaitQueued(comm, what));
    if (compute_waits) {
      RETURN_IF_ERROR(Cuda(cudaEventRecord(comm_done, stream), what));
      RETURN_IF_ERROR(Cuda(cudaStreamWaitEvent(kComputeStream, comm_done, 0), what));
    }
    return absl::OkStatus();
  }

  // The events order NCCL against kComputeStream: were the caller to compute on another stream
  // (a CUDAStreamGuard), nothing would order them, silently. Cheap: a thread-local read.
  absl::Status ComputeStreamIsDefault() {
    const c10::Stream current = c10::impl::VirtualGuardImpl(c10::kCUDA)
                                    .getStream(c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(device)));
    if (current.id() == 0) return absl::OkStatus();
    return Refuse(absl::InternalError(
        "the NCCL backend orders its calls against LibTorch's default CUDA stream, but another stream is current"));
  }

  // NCCL's type for `t`, a CUDA tensor on this rank's device in a dtype NCCL sums; any other
  // tensor is the caller's error, and ends the group (Refuse).
  absl::StatusOr<ncclDataType_t> TypeOf(const at::Tensor& t) {
    if (!t.is_cuda()) {
      return Refuse(absl::FailedPreconditionError(
          "the nccl backend needs CUDA tensors: run with a CUDA-enabled LibTorch (see README)"));
    }
    if (t.get_device() != device) {
      return Refuse(absl::InternalError(
          absl::StrCat("a tensor on cuda:", t.get_device(), " reached the NCCL group of cuda:", device)));
    }
    absl::StatusOr<ncclDataType_t> type = NcclType(t);
    if (!type.ok()) return Refuse(type.status());
    return type;
  }

  absl::StatusOr<cudaEvent_t> SpareEvent() {
    if (!spare_events.empty()) {
      cudaEvent_t event = spare_events.back();
      spare_events.pop_back();
      return event;
    }
    cudaEvent_t event = nullptr;
    RETURN_IF_ERROR(Cuda(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreate"));
    return event;
  }

  absl::StatusOr<ncclComm_t> InitComm(const std::string& key, int nranks, int rank) {
    ncclUniqueId id;
    try {
      if (rank == 0) {
        RETURN_IF_ERROR(Nccl(ncclGetUniqueId(&id), nullptr, "ncclGetUniqueId"));
        store->set(key,
                   std::vector<uint8_t>(reinterpret_cast<uint8_t*>(&id), reinterpret_cast<uint8_t*>(&id) + sizeof(id)));
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
    const ncclResult_t created = ncclCommInitRankConfig(&comm, nranks, id, rank, &config);
    if (created != ncclSuccess && created != ncclInProgress) {
      const std::string detail = Detail(comm);
      if (comm != nullptr) ncclCommAbort(comm);
      return Fail(absl::StrCat("ncclCommInitRankConfig for ", key, ": ", ncclGetErrorString(created), detail));
    }
    if (absl::Status queued = WaitQueued(comm, absl::StrCat("NCCL init of ", key)); !queued.ok()) {
      ncclCommAbort(comm);  // not yet one of ours, which Fail aborted
      return queued;
    }
    return comm;
  }
};

absl::StatusOr<int> NcclCollectives::DeviceForRank(int rank, int ranks_on_host) {
  int count = 0;
  RETURN_IF_ERROR(CudaStatus(cudaGetDeviceCount(&count), "no usable CUDA device (cudaGetDeviceCount)"));
  return GpuForRank(rank, ranks_on_host, count);
}

absl::Status NcclCollectives::RequireGpu(int gpu) {
  int count = 0;
  RETURN_IF_ERROR(CudaStatus(cudaGetDeviceCount(&count), "no usable CUDA device (cudaGetDeviceCount)"));
  return CheckGpuVisible(gpu, count);
}

absl::StatusOr<std::string> NcclCollectives::GpuBusId(int gpu) {
  char id[32] = {};
  RETURN_IF_ERROR(CudaStatus(cudaDeviceGetPCIBusId(id, sizeof(id), gpu), "cudaDeviceGetPCIBusId"));
  return std::string(id);
}

NcclCollectives::NcclCollectives(std::unique_ptr<State> state) : state_(std::move(state)) {}

NcclCollectives::~NcclCollectives() {
  State& s = *state_;
  cudaSetDevice(s.device);
  // Aborted, not destroyed: ncclCommDestroy waits for the communicator's queued work and, in
  // recent NCCL, for the other ranks, so after a failed forward (a receive still queued, a peer
  // gone) it would never return. A healthy group has nothing queued here (every forward ends
  // synchronised), so the abort costs nothing. PyTorch's NCCLComm does the same.
  s.AbortCommunicators();
  for (auto& send : s.sends) s.spare_events.push_back(send.done);
  s.sends.clear();  // after the communicators: no NCCL kernel reads these tensors any more
  for (cudaEvent_t event : s.spare_events) cudaEventDestroy(event);
  if (s.compute_ready != nullptr) cudaEventDestroy(s.compute_ready);
  if (s.comm_done != nullptr) cudaEventDestroy(s.comm_done);
  if (s.stream != nullptr) cudaStreamDestroy(s.stream);
}

absl::StatusOr<std::unique_ptr<NcclCollectives>> NcclCollectives::Connect(const NcclOptions& o) {
  const RendezvousOptions& r = o.rendezvous;
  if (r.world_size < 1 || o.tp_size < 1 || r.world_size % o.tp_size != 0 || r.rank < 0 || r.rank >= r.world_size) {
    return absl::InvalidArgumentError("inconsistent NCCL process group sizes");
  }
  auto state = std::make_unique<State>();
  state->options = o;
  state->tp_rank = r.rank % o.tp_size;
  if (o.gpu >= 0) {
    RETURN_IF_ERROR(RequireGpu(o.gpu));
    state->device = o.gpu;
  } else {
    ASSIGN_OR_RETURN(state->device, DeviceForRank(r.rank));
  }
  RETURN_IF_ERROR(CudaStatus(cudaSetDevice(state->device), "cudaSetDevice"));
  RETURN_IF_ERROR(CudaStatus(cudaStreamCreateWithFlags(&state->stream, cudaStreamNonBlocking), "cudaStreamCreate"));
  RETURN_IF_ERROR(
      CudaStatus(cudaEventCreateWithFlags(&state->compute_ready, cudaEventDisableTiming), "cudaEventCreate"));
  RETURN_IF_ERROR(CudaStatus(cudaEventCreateWithFlags(&state->comm_done, cudaEventDisableTiming), "cudaEventCreate"));
  ASSIGN_OR_RETURN(state->store, ConnectStore(r));
  // The object owns what exists so far, so that an error below releases it.
  std::unique_ptr<NcclCollectives> comm(new NcclCollectives(std::move(state)));
  State& s = *comm->state_;
  ASSIGN_OR_RETURN(s.world, s.InitComm("nccl/world", r.world_size, r.rank));
  ASSIGN_OR_RETURN(s.tp, s.InitComm(absl::StrCat("nccl/tp", r.rank / o.tp_size), o.tp_size, s.tp_rank));
  return comm;
}

int NcclCollectives::tp_size() const { return state_->options.tp_size; }
int NcclCollectives::tp_rank() const { return state_->tp_rank; }

absl::Status NcclCollectives::AllReduceSum(at::Tensor& tensor) {
  ASSIGN_OR_RETURN(const ncclDataType_t type, state_->TypeOf(tensor));
  at::Tensor t = tensor.contiguous();
  RETURN_IF_ERROR(
      state_->Enqueue(state_->tp, "tensor-parallel all-reduce", /*compute_waits=*/true, [&](cudaStream_t stream) {
        return ncclAllReduce(t.data_ptr(), t.data_ptr(), static_cast<size_t>(t.numel()), type, ncclSum, state_->tp,
                             stream);
      }));
  if (!t.is_same(tensor)) tensor.copy_(t);
  return absl::OkStatus();
}

absl::StatusOr<at::Tensor> NcclCollectives::AllGather(const at::Tensor& tensor, int64_t dim) {
  ASSIGN_OR_RETURN(const ncclDataType_t type, state_->TypeOf(tensor));
  const at::Tensor in = tensor.contiguous();
  std::vector<int64_t> shape = {tp_size()};
  shape.insert(shape.end(), in.sizes().begin(), in.sizes().end());
  at::Tensor out = at::empty(shape, in.options());
  RETURN_IF_ERROR(
      state_->Enqueue(state_->tp, "tensor-parallel all-gather", /*compute_waits=*/true, [&](cudaStream_t stream) {
        return ncclAllGather(in.data_ptr(), out.data_ptr(), static_cast<size_t>(in.numel()), type, state_->tp, stream);
      }));
  return at::cat(out.unbind(0), dim);
}

absl::StatusOr<at::Tensor> NcclCollectives::ReduceScatter(const at::Tensor& tensor, int64_t dim) {
  ASSIGN_OR_RETURN(const ncclDataType_t type, state_->TypeOf(tensor));
  if (tensor.size(dim) % tp_size() != 0) {
    return state_->Refuse(absl::InternalError("reduce-scatter dim not divisible by tp"));
  }
  // Chunk j (along dim) goes to TP rank j.
  const at::Tensor in = at::stack(tensor.chunk(tp_size(), dim), 0).contiguous();
  at::Tensor out = at::empty(in.sizes().slice(1), in.options());
  RETURN_IF_ERROR(
      state_->Enqueue(state_->tp, "tensor-parallel reduce-scatter", /*compute_waits=*/true, [&](cudaStream_t stream) {
        return ncclReduceScatter(in.data_ptr(), out.data_ptr(), static_cast<size_t>(out.numel()), type, ncclSum,
                                 state_->tp, stream);
      }));
  return out;
}

absl::Status NcclCollectives::Send(const at::Tensor& tensor, int dst_rank, int /*tag*/) {
  // NCCL has no tags; ranks post transfers in the same route order, which pairs them.
  State& s = *state_;
  ASSIGN_OR_RETURN(const ncclDataType_t type, s.TypeOf(tensor));
  const at::Tensor t = tensor.contiguous();
  const std::string what = absl::StrCat("send to rank ", dst_rank);
  RETURN_IF_ERROR(s.Enqueue(s.world, what, /*compute_waits=*/false, [&](cudaStream_t stream) {
    return ncclSend(t.data_ptr(), static_cast<size_t>(t.numel()), type, dst_rank, s.world, stream);
  }));
  // After Enqueue, which set the thread's device to the stream's: the event is made on it. A
  // failure here ends the group (Cuda), so an untracked send never outlives it.
  ASSIGN_OR_RETURN(cudaEvent_t done, s.SpareEvent());
  if (absl::Status recorded = s.Cuda(cudaEventRecord(done, s.stream), what); !recorded.ok()) {
    s.spare_events.push_back(done);
    return recorded;
  }
  s.sends.push_back({done, t, dst_rank});
  return absl::OkStatus();
}

absl::Status NcclCollectives::Recv(at::Tensor& tensor, int src_rank, int /*tag*/) {
  ASSIGN_OR_RETURN(const ncclDataType_t type, state_->TypeOf(tensor));
  if (!tensor.is_contiguous()) return state_->Refuse(absl::InternalError("receive buffer must be contiguous"));
  return state_->Enqueue(
      state_->world, absl::StrCat("receive from rank ", src_rank), /*compute_waits=*/true, [&](cudaStream_t stream) {
        return ncclRecv(tensor.data_ptr(), static_cast<size_t>(tensor.numel()), type, src_rank, state_->world, stream);
      });
}

absl::Status NcclCollectives::WaitForSends() {
  State& s = *state_;
  RETURN_IF_ERROR(s.Usable());
  RETURN_IF_ERROR(s.Cuda(cudaSetDevice(s.device), "cudaSetDevice"));
  while (!s.sends.empty()) {
    RETURN_IF_ERROR(s.WaitEvent(s.sends.front().done, absl::StrCat("send to rank ", s.sends.front().dst_rank)));
    RETURN_IF_ERROR(s.ReapSends());
  }
  return absl::OkStatus();
}

absl::Status NcclCollectives::Synchronize() {
  State& s = *state_;
  RETURN_IF_ERROR(s.Usable());
  RETURN_IF_ERROR(s.Cuda(cudaSetDevice(s.device), "cudaSetDevice"));
  // The compute stream's work includes, through the events, every collective's and receive's.
  RETURN_IF_ERROR(s.Cuda(cudaEventRecord(s.compute_ready, kComputeStream), "synchronize"));
  RETURN_IF_ERROR(s.WaitEvent(s.compute_ready, "the forward's GPU work"));
  return WaitForSends();
}

absl::Status NcclCollectives::Barrier() {
  // Through the rendezvous store: needs no device buffer, and waits with the store's timeout.
  return StoreBarrier(*state_->store, absl::StrCat("barrier/", state_->barriers++),
                      state_->options.rendezvous.world_size);
}

}  // namespace bertshard::worker
