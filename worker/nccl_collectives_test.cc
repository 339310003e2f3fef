// The NCCL backend. Without a GPU (this project's CI) the code is still compiled and linked, and
// asking for a device fails cleanly. With GPUs and a CUDA-enabled LibTorch (tools/gpu_check.sh
// runs this binary on a GPU host) every collective runs over one rank per visible GPU: on a
// one-GPU host a world of one, through one-rank communicators, so that every path still goes
// through NCCL, its streams and its events. BERTSHARD_EXPECT_GPU=1 turns the skips into failures.
#include "worker/nccl_collectives.h"

#include <ATen/ATen.h>
#include <ATen/Context.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "worker/rendezvous.h"

namespace bertshard::worker {
namespace {

using Clock = std::chrono::steady_clock;

bool GpuExpected() {
  const char* expect = std::getenv("BERTSHARD_EXPECT_GPU");
  return expect != nullptr && std::string(expect) == "1";
}

// The GPUs this process can run ranks on, or 0 (skipping the test, or failing it where a GPU is
// expected).
int Gpus() {
  if (!NcclCollectives::DeviceForRank(0).ok() || !at::hasCUDA()) return 0;
  return static_cast<int>(at::getNumGPUs());
}

#define REQUIRE_GPUS(n)                                                                    \
  const int gpus = Gpus();                                                                 \
  if (gpus < (n)) {                                                                        \
    if (GpuExpected() && gpus == 0) FAIL() << "BERTSHARD_EXPECT_GPU=1, but no usable GPU"; \
    GTEST_SKIP() << "needs " << (n) << " GPU(s) and a CUDA-enabled LibTorch";              \
  }

// Runs `body(rank, comm)` on one thread per rank of a world of `world` ranks, all in one TP
// group, and returns each rank's failures ("" when none).
template <typename Body>
std::vector<std::string> OnEveryRank(int world, std::chrono::milliseconds timeout, Body body) {
  // Hosted before the ranks start, on a port the system picks: rank 0 is handed the store, the
  // others connect to its port.
  auto store = HostStore(std::chrono::seconds(30)).value();
  std::vector<std::string> failures(static_cast<size_t>(world));
  std::vector<std::thread> threads;
  for (int rank = 0; rank < world; ++rank) {
    threads.emplace_back([&, rank] {
      GlooOptions options{.master_addr = "127.0.0.1", .master_port = store->getPort(), .rank = rank,
                          .world_size = world, .tp_size = world, .timeout = timeout,
                          .store = rank == 0 ? c10::intrusive_ptr<c10d::Store>(store)
                                             : c10::intrusive_ptr<c10d::Store>()};
      auto comm = NcclCollectives::Connect(options);
      if (!comm.ok()) {
        failures[static_cast<size_t>(rank)] = absl::StrCat("connect: ", comm.status().ToString());
        return;
      }
      body(rank, **comm, failures[static_cast<size_t>(rank)]);
    });
  }
  for (auto& t : threads) t.join();
  return failures;
}

TEST(NcclCollectives, WithoutGpuConnectFailsCleanly) {
  if (NcclCollectives::DeviceForRank(0).ok()) GTEST_SKIP() << "a GPU is present";
  // Refused before the rendezvous, which is hosted here all the same (on a port the system picks).
  auto store = HostStore(std::chrono::seconds(2)).value();
  GlooOptions options{.master_addr = "127.0.0.1", .master_port = store->getPort(), .rank = 0, .world_size = 1,
                      .tp_size = 1, .timeout = std::chrono::milliseconds(2000), .store = store};
  auto comm = NcclCollectives::Connect(options);
  EXPECT_EQ(comm.status().code(), absl::StatusCode::kFailedPrecondition) << comm.status();
}

// All-reduce, all-gather and reduce-scatter in each dtype the model runs, a non-contiguous
// all-reduce (summed into the caller's tensor), and pipeline sends along a chain of the ranks.
TEST(NcclCollectives, EveryCollectiveInEveryDtypeOnEveryGpu) {
  REQUIRE_GPUS(1);
  const int n = gpus;
  const auto failures = OnEveryRank(n, std::chrono::seconds(60), [n](int rank, NcclCollectives& comm,
                                                                      std::string& failed) {
    for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
      const std::string in = absl::StrCat(" (", c10::toString(dtype), ")");
      const auto cuda = at::TensorOptions().dtype(dtype).device(at::Device(at::kCUDA, rank));
      const auto cpu = at::TensorOptions().dtype(at::kFloat);
      // Small integers: exact in every dtype.
      at::Tensor t = at::full({4}, rank + 1, cuda);
      if (!comm.AllReduceSum(t).ok() || !t.cpu().to(at::kFloat).equal(at::full({4}, n * (n + 1) / 2, cpu))) {
        failed += "all-reduce" + in + " ";
      }
      at::Tensor wide = at::full({3, 4}, rank + 1, cuda);
      at::Tensor column = wide.select(1, 2);  // a strided view: summed in a copy, written back
      if (!comm.AllReduceSum(column).ok() ||
          !wide.select(1, 2).cpu().to(at::kFloat).equal(at::full({3}, n * (n + 1) / 2, cpu)) ||
          !wide.select(1, 0).cpu().to(at::kFloat).equal(at::full({3}, rank + 1, cpu))) {
        failed += "strided all-reduce" + in + " ";
      }
      auto gathered = comm.AllGather(at::full({1, 2}, rank, cuda), 1);
      const at::Tensor want_gathered = at::arange(n, cpu).repeat_interleave(2).view({1, 2 * n});
      if (!gathered.ok() || !gathered->cpu().to(at::kFloat).equal(want_gathered)) failed += "all-gather" + in + " ";
      // Row j of every rank's [1, 2n] goes to rank j, summed: rank r gets n * [2r, 2r + 1].
      auto scattered = comm.ReduceScatter(at::arange(2 * n, cuda).view({1, 2 * n}), 1);
      const at::Tensor want_scattered = at::tensor({2.f * n * rank, (2.f * rank + 1) * n}).view({1, 2});
      if (!scattered.ok() || !scattered->cpu().to(at::kFloat).equal(want_scattered)) {
        failed += "reduce-scatter" + in + " ";
      }
      // A chain 0 -> 1 -> ... -> n-1, each rank adding one: as the pipeline's stages pass on the
      // hidden states. The send returns at once; its tensor is released only once sent.
      if (n > 1) {
        at::Tensor got = at::full({5}, 0, cuda);
        if (rank > 0 && !comm.Recv(got, rank - 1, 0).ok()) failed += "recv" + in + " ";
        if (rank < n - 1 && !comm.Send(got + 1, rank + 1, 0).ok()) failed += "send" + in + " ";
        if (!comm.WaitForSends().ok()) failed += "wait for sends" + in + " ";
        if (!got.cpu().to(at::kFloat).equal(at::full({5}, rank, cpu))) failed += "chain" + in + " ";
      }
    }
    if (absl::Status s = comm.Synchronize(); !s.ok()) failed += "synchronize: " + s.ToString();
  });
  for (int rank = 0; rank < n; ++rank) EXPECT_EQ(failures[static_cast<size_t>(rank)], "") << "rank " << rank;
}

// NCCL runs on its own stream: its input must be the result of the compute queued before the
// call, and its output what the compute queued after it reads. A long product feeds an
// out-of-place gather (which copies even on one rank), and a product reads its result at once;
// without the events between the streams the gather would read the buffer before the product
// wrote it.
TEST(NcclCollectives, CollectivesAreOrderedWithTheComputeAroundThem) {
  REQUIRE_GPUS(1);
  const int n = gpus;
  const auto failures = OnEveryRank(n, std::chrono::seconds(60), [](int rank, NcclCollectives& comm,
                                                                     std::string& failed) {
    const auto cuda = at::TensorOptions().dtype(at::kFloat).device(at::Device(at::kCUDA, rank));
    for (int round = 0; round < 5; ++round) {
      const at::Tensor a = at::full({4096, 4096}, 1.0 / 4096, cuda);
      const at::Tensor product = at::matmul(a, at::full({4096, 4096}, round + 1, cuda));  // every entry round + 1
      auto gathered = comm.AllGather(product.narrow(0, 0, 8), 0);
      if (!gathered.ok()) {
        failed += "gather failed ";
        break;
      }
      const at::Tensor after = at::matmul(*gathered, a);  // every entry round + 1 again
      const float low = after.min().item<float>(), high = after.max().item<float>();
      if (std::abs(low - (round + 1)) > 1e-3 || std::abs(high - (round + 1)) > 1e-3) {
        failed += absl::StrCat("round ", round, ": [", low, ", ", high, "] ");
      }
    }
  });
  for (int rank = 0; rank < n; ++rank) EXPECT_EQ(failures[static_cast<size_t>(rank)], "") << "rank " << rank;
}

// A call that can never complete (a send nobody receives: on one GPU, to itself) gives a status
// within the timeout, not a hang; the group then refuses every call.
TEST(NcclCollectives, AStuckTransferFailsWithinTheTimeoutAndEndsTheGroup) {
  REQUIRE_GPUS(1);
  constexpr auto kTimeout = std::chrono::milliseconds(3000);
  const auto failures = OnEveryRank(1, kTimeout, [&](int, NcclCollectives& comm, std::string& failed) {
    const auto start = Clock::now();
    const auto cuda = at::TensorOptions().dtype(at::kFloat).device(at::Device(at::kCUDA, 0));
    absl::Status status = comm.Send(at::ones({1 << 20}, cuda), 0, 0);
    if (status.ok()) status = comm.Synchronize();
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    if (status.ok()) failed += "an unreceived send completed ";
    if (seconds > 10) failed += absl::StrCat("took ", seconds, " s ");
    at::Tensor t = at::ones({4}, cuda);
    if (comm.AllReduceSum(t).ok()) failed += "the group still works after the failure ";
    std::printf("unreceived send: %s after %.2f s\n", status.ToString().c_str(), seconds);
  });
  EXPECT_EQ(failures[0], "");
}

}  // namespace
}  // namespace bertshard::worker
