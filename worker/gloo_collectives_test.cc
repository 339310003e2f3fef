// Real Gloo process groups: four ranks as threads of this process (TP 2 x 2 stages) over a
// TCPStore on loopback. Inputs are ones * rank, so every expectation is a closed form.
#include "worker/gloo_collectives.h"

#include <ATen/ATen.h>

#include <atomic>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/free_port.h"
#include "gtest/gtest.h"

namespace bertshard::worker {
namespace {

int FreePort() { return *common::FindFreePort(/*loopback=*/true); }

TEST(GlooCollectives, TensorParallelAndPipelineOpsOnFourRanks) {
  const int port = FreePort();
  std::vector<std::string> failures(4);
  auto run = [&](int rank) {
    auto fail = [&](const std::string& what) { failures[rank] += what + "; "; };
    GlooOptions options{.master_addr = "127.0.0.1", .master_port = port, .rank = rank,
                        .world_size = 4, .tp_size = 2, .timeout = std::chrono::milliseconds(30000)};
    auto comm = GlooCollectives::Connect(options);
    if (!comm.ok()) return fail(std::string(comm.status().message()));
    const int stage = rank / 2, tp_rank = rank % 2;
    at::Tensor t = at::ones({2, 4}) * rank;
    if (!(*comm)->AllReduceSum(t).ok()) return fail("allreduce");
    // Stage 0 sums ranks 0 + 1, stage 1 ranks 2 + 3.
    if (!t.equal(at::ones({2, 4}) * (stage == 0 ? 1 : 5))) fail("allreduce value");
    auto gathered = (*comm)->AllGather(at::full({1, 2}, rank, at::kFloat), 1);
    const float a = 2.f * stage, b = a + 1;  // the stage's two ranks, each contributing [r, r]
    if (!gathered.ok() || !gathered->equal(at::tensor({a, a, b, b}).view({1, 4})))
      fail("allgather");
    // [1, 4] = [r, r, r, r] summed over the pair, split along dim 1: each gets 2 columns of the sum.
    auto scattered = (*comm)->ReduceScatter(at::full({1, 4}, rank, at::kFloat) + at::arange(4).view({1, 4}), 1);
    const float pair_sum = stage == 0 ? 1.f : 5.f;
    if (!scattered.ok() ||
        !scattered->equal(at::tensor({pair_sum + 2 * (2 * tp_rank), pair_sum + 2 * (2 * tp_rank + 1)}).view({1, 2})))
      fail("reduce-scatter");
    // Stage 0 sends to its TP peer on stage 1.
    if (stage == 0) {
      if (!(*comm)->Send(at::full({3}, 10 + rank, at::kFloat), rank + 2, 7).ok()) fail("send");
    } else {
      at::Tensor got = at::empty({3});
      if (!(*comm)->Recv(got, rank - 2, 7).ok() || !got.equal(at::full({3}, 8 + rank, at::kFloat))) fail("recv");
    }
  };
  std::vector<std::thread> threads;
  for (int r = 0; r < 4; ++r) threads.emplace_back(run, r);
  for (auto& t : threads) t.join();
  for (int r = 0; r < 4; ++r) EXPECT_EQ(failures[r], "") << "rank " << r;
}

// Nobody leaves a barrier before the last rank arrives: each rank records the arrivals it saw on
// leaving; rank 2 arrives late on purpose. Twice in a row, so each call's keys are its own.
TEST(GlooCollectives, BarrierWaitsForEveryRank) {
  const int port = FreePort();
  std::atomic<int> arrived{0};
  std::vector<std::string> failures(3);
  auto run = [&](int rank) {
    GlooOptions options{.master_addr = "127.0.0.1", .master_port = port, .rank = rank,
                        .world_size = 3, .tp_size = 1, .timeout = std::chrono::milliseconds(30000)};
    auto comm = GlooCollectives::Connect(options);
    if (!comm.ok()) return void(failures[rank] = std::string(comm.status().message()));
    for (int round = 1; round <= 2; ++round) {
      if (rank == 2) std::this_thread::sleep_for(std::chrono::milliseconds(300));
      arrived.fetch_add(1);
      if (absl::Status s = (*comm)->Barrier(); !s.ok()) return void(failures[rank] = std::string(s.message()));
      if (arrived.load() < 3 * round) failures[rank] += absl::StrCat("left round ", round, " early; ");
      // Everyone must have left round 1's check before rank 2 counts round 2 in.
      if (absl::Status s = (*comm)->Barrier(); !s.ok()) return void(failures[rank] = std::string(s.message()));
    }
  };
  std::vector<std::thread> threads;
  for (int r = 0; r < 3; ++r) threads.emplace_back(run, r);
  for (auto& t : threads) t.join();
  for (int r = 0; r < 3; ++r) EXPECT_EQ(failures[r], "") << "rank " << r;
}

TEST(GlooCollectives, BarrierWithoutPeersTimesOutAsUnavailable) {
  const int port = FreePort();
  std::thread peer([&] {
    // Rank 1 joins the rendezvous, then never calls Barrier.
    GlooOptions options{.master_addr = "127.0.0.1", .master_port = port, .rank = 1,
                        .world_size = 2, .tp_size = 1, .timeout = std::chrono::milliseconds(1500)};
    auto comm = GlooCollectives::Connect(options);
    ASSERT_TRUE(comm.ok()) << comm.status();
    std::this_thread::sleep_for(std::chrono::milliseconds(2500));
  });
  GlooOptions options{.master_addr = "127.0.0.1", .master_port = port, .rank = 0,
                      .world_size = 2, .tp_size = 1, .timeout = std::chrono::milliseconds(1500)};
  auto comm = GlooCollectives::Connect(options);
  ASSERT_TRUE(comm.ok()) << comm.status();
  EXPECT_EQ((*comm)->Barrier().code(), absl::StatusCode::kUnavailable);
  peer.join();
}

TEST(GlooCollectives, RendezvousWithoutPeersTimesOutAsUnavailable) {
  GlooOptions options{.master_addr = "127.0.0.1", .master_port = FreePort(), .rank = 0,
                      .world_size = 2, .tp_size = 1, .timeout = std::chrono::milliseconds(1500)};
  auto comm = GlooCollectives::Connect(options);
  EXPECT_EQ(comm.status().code(), absl::StatusCode::kUnavailable) << comm.status();
  options.world_size = 3;
  options.tp_size = 2;
  EXPECT_EQ(GlooCollectives::Connect(options).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace bertshard::worker
