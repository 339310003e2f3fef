#include "worker/gloo_collectives.h"

#include <ATen/ATen.h>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "worker/rendezvous.h"

namespace bertshard::worker {
namespace {

// Runs a c10d call; any exception means the group is broken.
template <typename F>
absl::Status Guard(absl::string_view what, F&& f) {
  try {
    f();
    return absl::OkStatus();
  } catch (const c10::Error& e) {
    // Without the C++ backtrace: this text becomes a job's stored failure cause.
    return absl::UnavailableError(absl::StrCat(what, " failed: ", e.what_without_backtrace()));
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat(what, " failed: ", e.what()));
  }
}

// Gloo (in LibTorch 1.13) has no bfloat16. Transfers need no arithmetic, so a bf16 tensor travels
// as the float16 tensor with the same bits (a view: no copy, exact). Sums never run in 16 bits:
// see AllReduceSum and ReduceScatter.
at::Tensor Wire(const at::Tensor& t) { return t.scalar_type() == at::kBFloat16 ? t.view(at::kHalf) : t; }
at::Tensor Unwire(const at::Tensor& t, at::ScalarType dtype) {
  return dtype == at::kBFloat16 ? t.view(at::kBFloat16) : t;
}
bool IsNarrowFloat(const at::Tensor& t) { return t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf; }

}  // namespace

struct GlooCollectives::Groups {
  GlooOptions options;
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> world;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> tp;  // null when tp_size == 1 or `shm` serves TP
  std::unique_ptr<SharedMemoryGroup> shm;         // the TP group's, where its ranks share a host
  int tp_rank = 0;
  int64_t barriers = 0;  // Barrier() calls so far: each uses its own store keys
  // Sends in flight, with the tensors they read (kept alive until done).
  std::vector<std::pair<c10::intrusive_ptr<c10d::Work>, at::Tensor>> sends;
};

GlooCollectives::GlooCollectives(std::unique_ptr<Groups> groups) : groups_(std::move(groups)) {}
GlooCollectives::~GlooCollectives() = default;

absl::StatusOr<std::unique_ptr<GlooCollectives>> GlooCollectives::Connect(const GlooOptions& o) {
  const RendezvousOptions& r = o.rendezvous;
  if (r.world_size < 1 || o.tp_size < 1 || r.world_size % o.tp_size != 0 || r.rank < 0 || r.rank >= r.world_size ||
      r.master_port <= 0 || r.master_port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("inconsistent process group: rank ", r.rank, " of ", r.world_size,
                                                   ", tp ", o.tp_size, ", port ", r.master_port));
  }
  auto groups = std::make_unique<Groups>();
  groups->options = o;
  groups->tp_rank = r.rank % o.tp_size;
  auto store = ConnectStore(r);
  if (!store.ok()) return store.status();
  groups->store = *store;
  const int stage = r.rank / o.tp_size;
  if (o.tp_size > 1 && o.shared_memory) {
    ShmOptions shm = o.shm;
    shm.timeout = r.timeout;
    auto group = SharedMemoryGroup::Join(**store, absl::StrCat("shm/tp", stage), groups->tp_rank, o.tp_size, shm);
    if (!group.ok()) return group.status();
    groups->shm = std::move(*group);  // null: not one host, Gloo it is
  }
  absl::Status status = Guard("rendezvous", [&]() {
    auto make_options = [&]() {
      auto options = c10d::ProcessGroupGloo::Options::create(r.timeout);
      options->devices.push_back(
          c10d::ProcessGroupGloo::createDeviceForHostname(o.bind_host.empty() ? r.master_addr : o.bind_host));
      options->threads = 1;
      return options;
    };
    groups->world = c10::make_intrusive<c10d::ProcessGroupGloo>(
        c10::make_intrusive<c10d::PrefixStore>("world", groups->store), r.rank, r.world_size, make_options());
    if (o.tp_size > 1 && !groups->shm) {
      groups->tp = c10::make_intrusive<c10d::ProcessGroupGloo>(
          c10::make_intrusive<c10d::PrefixStore>(absl::StrCat("tp", stage), groups->store), groups->tp_rank, o.tp_size,
          make_options());
    }
  });
  if (!status.ok()) return status;
  return std::unique_ptr<GlooCollectives>(new GlooCollectives(std::move(groups)));
}

int GlooCollectives::tp_size() const { return groups_->options.tp_size; }
int GlooCollectives::tp_rank() const { return groups_->tp_rank; }

std::string GlooCollectives::tp_transport() const {
  return groups_->shm ? "shared memory" : groups_->tp ? "gloo" : "none";
}

absl::Status GlooCollectives::AllReduceSum(at::Tensor& tensor) {
  if (groups_->shm) return groups_->shm->AllReduceSum(tensor);
  if (!groups_->tp) return absl::OkStatus();
  return Guard("tensor-parallel all-reduce", [&]() {
    // bf16/fp16 sum in float32 (fp32 accumulation, as the local products have; Gloo has no bf16
    // sum and a float16 one would round at every step), and are rounded once at the end.
    const bool widen = IsNarrowFloat(tensor);
    std::vector<at::Tensor> tensors = {widen ? tensor.to(at::kFloat) : tensor};
    groups_->tp->allreduce(tensors)->wait();
    if (widen) tensor.copy_(tensors[0]);
  });
}

absl::StatusOr<at::Tensor> GlooCollectives::AllGather(const at::Tensor& tensor, int64_t dim) {
  if (groups_->shm) return groups_->shm->AllGather(tensor, dim);
  if (!groups_->tp) return tensor;
  at::Tensor result;
  absl::Status status = Guard("tensor-parallel all-gather", [&]() {
    std::vector<at::Tensor> input = {Wire(tensor.contiguous())};
    std::vector<std::vector<at::Tensor>> output(1);
    for (int i = 0; i < tp_size(); ++i) output[0].push_back(at::empty_like(input[0]));
    groups_->tp->allgather(output, input)->wait();
    result = Unwire(at::cat(output[0], dim), tensor.scalar_type());
  });
  if (!status.ok()) return status;
  return result;
}

absl::StatusOr<at::Tensor> GlooCollectives::ReduceScatter(const at::Tensor& tensor, int64_t dim) {
  if (tp_size() == 1) return tensor;
  if (tensor.size(dim) % tp_size() != 0) {
    return absl::InternalError("reduce-scatter dimension is not a multiple of the TP size");
  }
  if (groups_->shm) return groups_->shm->ReduceScatter(tensor, dim);
  at::Tensor result;
  absl::Status status = Guard("tensor-parallel reduce-scatter", [&]() {
    // Chunk j goes to TP rank j; each rank then sums the chunks it received.
    at::Tensor input = Wire(at::stack(tensor.chunk(tp_size(), dim), 0).contiguous());
    at::Tensor output = at::empty_like(input);
    std::vector<int64_t> equal_splits;
    groups_->tp->alltoall_base(output, input, equal_splits, equal_splits)->wait();
    // The chunks travel in their own dtype; the sum runs in float32 (as in AllReduceSum).
    output = Unwire(output, tensor.scalar_type());
    result = IsNarrowFloat(output) ? output.sum(0, false, at::kFloat).to(tensor.scalar_type()) : output.sum(0);
  });
  if (!status.ok()) return status;
  return result;
}

absl::Status GlooCollectives::Send(const at::Tensor& tensor, int dst_rank, int tag) {
  return Guard(absl::StrCat("send to rank ", dst_rank), [&]() {
    std::vector<at::Tensor> tensors = {Wire(tensor.contiguous())};
    // Not waited for here: Gloo completes it in the background once the receiver takes it.
    groups_->sends.emplace_back(groups_->world->send(tensors, dst_rank, tag), tensors[0]);
  });
}

absl::Status GlooCollectives::WaitForSends() {
  absl::Status first;
  for (auto& [work, tensor] : groups_->sends) {
    absl::Status s = Guard("pipeline send", [&]() { work->wait(); });
    if (first.ok()) first = s;
  }
  groups_->sends.clear();
  return first;
}

absl::Status GlooCollectives::Recv(at::Tensor& tensor, int src_rank, int tag) {
  return Guard(absl::StrCat("receive from rank ", src_rank), [&]() {
    std::vector<at::Tensor> tensors = {Wire(tensor)};  // a view: the bytes land in `tensor`
    groups_->world->recv(tensors, src_rank, tag)->wait();
  });
}

absl::Status GlooCollectives::Barrier() {
  return StoreBarrier(*groups_->store, absl::StrCat("barrier/", groups_->barriers++),
                      groups_->options.rendezvous.world_size);
}

}  // namespace bertshard::worker
