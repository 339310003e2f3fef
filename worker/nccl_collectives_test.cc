// The NCCL backend. Without a GPU (this project's CI) the code is still compiled and linked, and
// asking for a device fails cleanly; the collectives themselves need >= 2 GPUs and a
// CUDA-enabled LibTorch, and are skipped otherwise.
#include "worker/nccl_collectives.h"

#include <ATen/ATen.h>
#include <ATen/Context.h>

#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "worker/rendezvous.h"

namespace bertshard::worker {
namespace {

TEST(NcclCollectives, WithoutGpuConnectFailsCleanly) {
  if (NcclCollectives::DeviceForRank(0).ok()) GTEST_SKIP() << "a GPU is present";
  // Refused before the rendezvous, which is hosted here all the same (on a port the system picks).
  auto store = HostStore(std::chrono::seconds(2)).value();
  GlooOptions options{.master_addr = "127.0.0.1", .master_port = store->getPort(), .rank = 0, .world_size = 1,
                      .tp_size = 1, .timeout = std::chrono::milliseconds(2000), .store = store};
  auto comm = NcclCollectives::Connect(options);
  EXPECT_EQ(comm.status().code(), absl::StatusCode::kFailedPrecondition) << comm.status();
}

TEST(NcclCollectives, AllReduceGatherScatterSendRecvOnTwoGpus) {
  int devices = 0;
  auto device = NcclCollectives::DeviceForRank(0);
  if (device.ok()) devices = static_cast<int>(at::getNumGPUs());
  if (!at::hasCUDA() || devices < 2) GTEST_SKIP() << "needs 2 GPUs and a CUDA-enabled LibTorch";
  // Hosted before the ranks start, on a port the system picks: rank 0 is handed the store, rank 1
  // connects to its port (a fixed port may be taken by anything else on the host).
  auto store = HostStore(std::chrono::seconds(30)).value();
  std::vector<std::string> failures(2);
  auto run = [&](int rank) {
    GlooOptions options{.master_addr = "127.0.0.1", .master_port = store->getPort(), .rank = rank, .world_size = 2,
                        .tp_size = 2, .timeout = std::chrono::milliseconds(30000),
                        .store = rank == 0 ? c10::intrusive_ptr<c10d::Store>(store)
                                           : c10::intrusive_ptr<c10d::Store>()};
    auto comm = NcclCollectives::Connect(options);
    if (!comm.ok()) {
      failures[rank] = std::string(comm.status().message());
      return;
    }
    const auto cuda = at::TensorOptions().dtype(at::kFloat).device(at::Device(at::kCUDA, rank));
    at::Tensor t = at::ones({4}, cuda) * rank;
    if (!(*comm)->AllReduceSum(t).ok() || !t.cpu().equal(at::ones({4}))) failures[rank] += "allreduce ";
    auto g = (*comm)->AllGather(at::full({1, 2}, rank, cuda), 1);
    if (!g.ok() || !g->cpu().equal(at::tensor({0.f, 0.f, 1.f, 1.f}).view({1, 4}))) failures[rank] += "allgather ";
    auto s = (*comm)->ReduceScatter(at::arange(4, cuda).view({1, 4}), 1);
    if (!s.ok() || !s->cpu().equal(at::tensor({4.f * rank, 4.f * rank + 2}).view({1, 2}))) failures[rank] += "reduce-scatter ";
    if (rank == 0) {
      if (!(*comm)->Send(at::full({3}, 7, cuda), 1, 0).ok()) failures[rank] += "send ";
    } else {
      at::Tensor got = at::empty({3}, cuda);
      if (!(*comm)->Recv(got, 0, 0).ok() || !got.cpu().equal(at::full({3}, 7.f))) failures[rank] += "recv ";
    }
  };
  std::thread a(run, 0), b(run, 1);
  a.join();
  b.join();
  EXPECT_EQ(failures[0], "");
  EXPECT_EQ(failures[1], "");
}

}  // namespace
}  // namespace bertshard::worker
