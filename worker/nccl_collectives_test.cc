// The NCCL backend. Without a GPU (this project's CI) the code is still compiled and linked, and
// asking for a device fails cleanly. With GPUs and a CUDA-enabled LibTorch (tools/gpu_check.sh
// runs this binary on a GPU host) every collective runs over one rank per visible GPU: on a
// one-GPU host a world of one, through one-rank communicators, so that every path still goes
// through NCCL, its streams and its events. BERTSHARD_EXPECT_GPU=1 turns the skips into failures.
#include "worker/nccl_collectives.h"

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
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

const std::string kSecret(32, 's');  // the job's rendezvous secret

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
  auto store = HostStore("127.0.0.1", kSecret, std::chrono::seconds(30)).value();
  std::vector<std::string> failures(static_cast<size_t>(world));
  std::vector<std::thread> threads;
  for (int rank = 0; rank < world; ++rank) {
    threads.emplace_back([&, rank] {
      NcclOptions options{.rendezvous = {.master_addr = "127.0.0.1",
                                         .master_port = store->getPort(),
                                         .rank = rank,
                                         .world_size = world,
                                         .timeout = timeout,
                                         .secret = kSecret,
                                         .store = rank == 0 ? c10::intrusive_ptr<c10d::Store>(store)
                                                            : c10::intrusive_ptr<c10d::Store>()},
                          .tp_size = world};
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
  auto store = HostStore("127.0.0.1", kSecret, std::chrono::seconds(2)).value();
  NcclOptions options{.rendezvous = {.master_addr = "127.0.0.1",
                                     .master_port = store->getPort(),
                                     .rank = 0,
                                     .world_size = 1,
                                     .timeout = std::chrono::milliseconds(2000),
                                     .store = store},
                      .tp_size = 1};
  auto comm = NcclCollectives::Connect(options);
  EXPECT_EQ(comm.status().code(), absl::StatusCode::kFailedPrecondition) << comm.status();
}

// All-reduce, all-gather and reduce-scatter in each dtype the model runs, a non-contiguous
// all-reduce (summed into the caller's tensor), and pipeline sends along a chain of the ranks.
// Results are read only after a bounded Synchronize, so that a rank whose peer failed ends with
// a status instead of blocking in a copy. On one GPU an all-reduce is an identity by definition:
// there the test shows that every call goes through NCCL, its stream and its events and comes
// back right, not that sums are summed; the sends need two GPUs.
TEST(NcclCollectives, EveryCollectiveInEveryDtypeOnEveryGpu) {
  REQUIRE_GPUS(1);
  const int n = gpus;
  const auto failures =
      OnEveryRank(n, std::chrono::seconds(60), [n](int rank, NcclCollectives& comm, std::string& failed) {
        for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
          const std::string in = absl::StrCat(" (", c10::toString(dtype), ")");
          const auto cuda = at::TensorOptions().dtype(dtype).device(at::Device(at::kCUDA, rank));
          const auto cpu = at::TensorOptions().dtype(at::kFloat);
          // Small integers: exact in every dtype (up to 8 GPUs in bf16).
          at::Tensor t = at::full({4}, rank + 1, cuda);
          const absl::Status reduced = comm.AllReduceSum(t);
          at::Tensor wide = at::full({3, 4}, rank + 1, cuda);
          at::Tensor column = wide.select(1, 2);  // a strided view: summed in a copy, written back
          const absl::Status reduced_strided = comm.AllReduceSum(column);
          auto gathered = comm.AllGather(at::full({1, 2}, rank, cuda), 1);
          // Element j of every rank's [1, 2n] row goes to rank j / 2, summed over the ranks.
          auto scattered = comm.ReduceScatter(at::arange(2 * n, cuda).view({1, 2 * n}), 1);
          // A chain 0 -> 1 -> ... -> n-1, each rank adding one: as the pipeline's stages pass on the
          // hidden states. The send returns at once; its tensor is released only once sent.
          at::Tensor got = at::full({5}, 0, cuda);
          absl::Status chained = absl::OkStatus();
          if (n > 1) {
            if (rank > 0) chained.Update(comm.Recv(got, rank - 1, 0));
            if (chained.ok() && rank < n - 1) chained.Update(comm.Send(got + 1, rank + 1, 0));
            if (chained.ok()) chained.Update(comm.WaitForSends());
          }
          if (absl::Status synced = comm.Synchronize(); !synced.ok()) {
            failed += absl::StrCat("synchronize", in, ": ", synced.ToString());
            return;
          }
          const auto same = [&](const at::Tensor& got_tensor, const at::Tensor& want) {
            return got_tensor.cpu().to(at::kFloat).equal(want);
          };
          if (!reduced.ok() || !same(t, at::full({4}, n * (n + 1) / 2, cpu))) failed += "all-reduce" + in + " ";
          if (!reduced_strided.ok() || !same(wide.select(1, 2), at::full({3}, n * (n + 1) / 2, cpu)) ||
              !same(wide.select(1, 0), at::full({3}, rank + 1, cpu))) {
            failed += "strided all-reduce" + in + " ";
          }
          if (!gathered.ok() || !same(*gathered, at::arange(n, cpu).repeat_interleave(2).view({1, 2 * n}))) {
            failed += "all-gather" + in + " ";
          }
          if (!scattered.ok() || !same(*scattered, at::tensor({2.f * n * rank, (2.f * rank + 1) * n}).view({1, 2}))) {
            failed += "reduce-scatter" + in + " ";
          }
          if (!chained.ok() || (n > 1 && !same(got, at::full({5}, rank, cpu)))) {
            failed += "chain" + in + ": " + chained.ToString() + " ";
          }
        }
      });
  for (int rank = 0; rank < n; ++rank) EXPECT_EQ(failures[static_cast<size_t>(rank)], "") << "rank " << rank;
}

// NCCL runs on its own stream: its input must be the result of the compute queued before the
// call, and its output what the compute queued after it reads. A product of milliseconds feeds
// an out-of-place gather of 64 MiB a rank (which copies even on one GPU), and the concatenation
// queued right after reads the gather's buffer. Each round writes another value, and the
// allocator hands the rounds the same blocks: without the event before the call, the gather
// copies the last round's values; without the one after it, the concatenation does.
TEST(NcclCollectives, CollectivesAreOrderedWithTheComputeAroundThem) {
  REQUIRE_GPUS(1);
  const int n = gpus;
  const auto failures =
      OnEveryRank(n, std::chrono::seconds(60), [](int rank, NcclCollectives& comm, std::string& failed) {
        const auto cuda = at::TensorOptions().dtype(at::kFloat).device(at::Device(at::kCUDA, rank));
        const at::Tensor a = at::full({4096, 4096}, 1.0 / 4096, cuda);
        for (int round = 0; round < 6; ++round) {
          const at::Tensor product = at::matmul(a, at::full({4096, 4096}, round + 1, cuda));  // every entry round + 1
          auto gathered = comm.AllGather(product, 1);  // concatenated along dim 1 after the gather
          if (absl::Status synced = comm.Synchronize(); !gathered.ok() || !synced.ok()) {
            failed += absl::StrCat("round ", round, ": ", gathered.status().ToString(), " ", synced.ToString());
            return;
          }
          const float low = gathered->min().item<float>(), high = gathered->max().item<float>();
          if (low != round + 1 || high != round + 1)
            failed += absl::StrCat("round ", round, ": [", low, ", ", high, "] ");
        }
      });
  for (int rank = 0; rank < n; ++rank) EXPECT_EQ(failures[static_cast<size_t>(rank)], "") << "rank " << rank;
}

// GPU work that never completes ends in a status within the timeout, not a hang, and the group
// then refuses every call. On one GPU the compute stream is held by a host function until the
// check is over (the deadline and the abort of an idle group); with two, rank 1 never receives
// rank 0's send (the abort of a running, stuck NCCL kernel).
TEST(NcclCollectives, StuckGpuWorkFailsWithinTheTimeoutAndEndsTheGroup) {
  REQUIRE_GPUS(1);
  const int n = std::min(gpus, 2);
  constexpr auto kTimeout = std::chrono::seconds(8);
  std::atomic<bool> release{false};
  // Lets the held stream go after the deadline whatever happens, so that nothing here can hang.
  std::thread releaser([&] {
    std::this_thread::sleep_for(kTimeout + std::chrono::seconds(4));
    release = true;
  });
  const auto failures = OnEveryRank(n, kTimeout, [&](int rank, NcclCollectives& comm, std::string& failed) {
    const auto cuda = at::TensorOptions().dtype(at::kFloat).device(at::Device(at::kCUDA, rank));
    const auto start = Clock::now();
    absl::Status status;
    if (n == 1) {
      cudaSetDevice(0);
      cudaLaunchHostFunc(
          cudaStreamLegacy,
          [](void* flag) {
            while (!static_cast<std::atomic<bool>*>(flag)->load())
              std::this_thread::sleep_for(std::chrono::milliseconds(1));
          },
          &release);
      status = comm.Synchronize();
    } else if (rank == 0) {
      status = comm.Send(at::ones({1 << 20}, cuda), 1, 0);
      if (status.ok()) status = comm.Synchronize();
    } else {
      std::this_thread::sleep_for(kTimeout + std::chrono::seconds(2));  // never receives
      return;
    }
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    release = true;
    if (status.ok()) failed += "work that never completed was reported done ";
    if (status.code() != absl::StatusCode::kUnavailable) failed += "not UNAVAILABLE: " + status.ToString() + " ";
    if (seconds > 20) failed += absl::StrCat("took ", seconds, " s ");
    at::Tensor t = at::ones({4}, cuda);
    if (comm.AllReduceSum(t).ok()) failed += "the group still works after the failure ";
    std::printf("stuck %s: %s after %.2f s\n", n == 1 ? "compute" : "send", status.ToString().c_str(), seconds);
  });
  release = true;
  releaser.join();
  for (int rank = 0; rank < n; ++rank) EXPECT_EQ(failures[static_cast<size_t>(rank)], "") << "rank " << rank;
}

// A send with no receive on a one-rank group is NCCL's invalid usage: a status, not a crash.
TEST(NcclCollectives, InvalidUsageIsAStatus) {
  REQUIRE_GPUS(1);
  const auto failures = OnEveryRank(1, std::chrono::seconds(20), [](int, NcclCollectives& comm, std::string& failed) {
    const auto cuda = at::TensorOptions().dtype(at::kFloat).device(at::Device(at::kCUDA, 0));
    absl::Status status = comm.Send(at::ones({16}, cuda), 0, 0);
    if (status.ok()) status = comm.Synchronize();
    if (status.ok()) failed += "a send to itself with no receive completed ";
    std::printf("send to itself: %s\n", status.ToString().c_str());
  });
  EXPECT_EQ(failures[0], "");
}

}  // namespace
}  // namespace bertshard::worker
