// Real Gloo process groups: four ranks as threads of this process (TP 2 x 2 stages) over the
// rendezvous store on loopback. Inputs are ones * rank, so every expectation is a closed form.
#include "worker/gloo_collectives.h"

#include <ATen/ATen.h>
#include <sys/stat.h>

#include <atomic>
#include <cmath>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "worker/rendezvous.h"

namespace bertshard::worker {
namespace {

const std::string kSecret(32, 's');  // the job's rendezvous secret

// A job's rendezvous, hosted before any rank starts on a port the system picks (as a worker's
// ReservePort does): rank 0 is handed the store, the others connect to its port. A port found free
// and bound later by rank 0 could be taken in between by a test running alongside.
class Rendezvous {
 public:
  Rendezvous() : store_(HostStore("127.0.0.1", kSecret, std::chrono::seconds(30)).value()) {}
  int port() const { return store_->getPort(); }
  // What rank `rank` of `world_size` joins with, on loopback.
  RendezvousOptions For(int rank, int world_size, std::chrono::milliseconds timeout = std::chrono::seconds(30)) const {
    return {.master_addr = "127.0.0.1",
            .master_port = port(),
            .rank = rank,
            .world_size = world_size,
            .timeout = timeout,
            .secret = kSecret,
            .store = StoreFor(rank)};
  }
  // RendezvousOptions::store for `rank`: the hosted store for rank 0, none for the others.
  c10::intrusive_ptr<c10d::Store> StoreFor(int rank) const {
    return rank == 0 ? c10::intrusive_ptr<c10d::Store>(store_) : c10::intrusive_ptr<c10d::Store>();
  }

 private:
  c10::intrusive_ptr<HostedStore> store_;
};

// The TP tests run twice: TP collectives through shared memory (the default where ranks share a
// host, as these threads do) and through Gloo.
class TpTransport : public testing::TestWithParam<bool> {
 protected:
  bool shared_memory() const { return GetParam(); }
  std::string want_transport() const { return GetParam() ? "shared memory" : "gloo"; }
};
INSTANTIATE_TEST_SUITE_P(GlooCollectives, TpTransport, testing::Bool(),
                         [](const testing::TestParamInfo<bool>& info) { return info.param ? "Shm" : "Gloo"; });

TEST_P(TpTransport, TensorParallelAndPipelineOpsOnFourRanks) {
  const Rendezvous rendezvous;
  std::vector<std::string> failures(4);
  auto run = [&](int rank) {
    auto fail = [&](const std::string& what) { failures[rank] += what + "; "; };
    GlooOptions options{.rendezvous = rendezvous.For(rank, 4), .tp_size = 2, .shared_memory = shared_memory()};
    auto comm = GlooCollectives::Connect(options);
    if (!comm.ok()) return fail(std::string(comm.status().message()));
    if ((*comm)->tp_transport() != want_transport()) fail("transport " + (*comm)->tp_transport());
    const int stage = rank / 2, tp_rank = rank % 2;
    at::Tensor t = at::ones({2, 4}) * rank;
    if (!(*comm)->AllReduceSum(t).ok()) return fail("allreduce");
    // Stage 0 sums ranks 0 + 1, stage 1 ranks 2 + 3.
    if (!t.equal(at::ones({2, 4}) * (stage == 0 ? 1 : 5))) fail("allreduce value");
    auto gathered = (*comm)->AllGather(at::full({1, 2}, rank, at::kFloat), 1);
    const float a = 2.f * stage, b = a + 1;  // the stage's two ranks, each contributing [r, r]
    if (!gathered.ok() || !gathered->equal(at::tensor({a, a, b, b}).view({1, 4}))) fail("allgather");
    // [1, 4] = [r, r, r, r] summed over the pair, split along dim 1: each gets 2 columns of the sum.
    auto scattered = (*comm)->ReduceScatter(at::full({1, 4}, rank, at::kFloat) + at::arange(4).view({1, 4}), 1);
    const float pair_sum = stage == 0 ? 1.f : 5.f;
    if (!scattered.ok() ||
        !scattered->equal(at::tensor({pair_sum + 2 * (2 * tp_rank), pair_sum + 2 * (2 * tp_rank + 1)}).view({1, 2})))
      fail("reduce-scatter");
    // Stage 0 sends to its TP peer on stage 1.
    if (stage == 0) {
      if (!(*comm)->Send(at::full({3}, 10 + rank, at::kFloat), rank + 2, 7).ok()) fail("send");
      if (!(*comm)->WaitForSends().ok()) fail("send completion");
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

// bf16 over Gloo, which has no bf16: transfers carry the bits unchanged (values far beyond fp16's
// range survive, so they were not converted to fp16 on the way), and sums run in float32 and round
// once: 256 + 1 + 1 is 258 in bf16, while summing in bf16 rounds 256 + 1 back to 256 on the way.
TEST_P(TpTransport, Bf16TravelsExactlyAndSumsInFloat32) {
  const Rendezvous rendezvous;
  std::vector<std::string> failures(3);
  auto run = [&](int rank) {
    auto fail = [&](const std::string& what) { failures[rank] += what + "; "; };
    GlooOptions options{.rendezvous = rendezvous.For(rank, 3), .tp_size = 3, .shared_memory = shared_memory()};
    auto comm = GlooCollectives::Connect(options);
    if (!comm.ok()) return fail(std::string(comm.status().message()));
    if ((*comm)->tp_transport() != want_transport()) fail("transport " + (*comm)->tp_transport());
    const auto bf16 = [](std::vector<float> v) { return at::tensor(v).to(at::kBFloat16); };
    // Column 0: 256, 1, 1 (fp32 sum 258). Column 1: 1e30 * (rank + 1) (sum 6e30).
    at::Tensor t = bf16({rank == 0 ? 256.f : 1.f, 1e30f * static_cast<float>(rank + 1)});
    if (absl::Status st = (*comm)->AllReduceSum(t); !st.ok()) return fail(std::string(st.message()));
    if (t.scalar_type() != at::kBFloat16 || !t.equal(bf16({258.f, 6e30f}))) fail("allreduce value");
    auto gathered = (*comm)->AllGather(bf16({1e30f * static_cast<float>(rank + 1)}).view({1, 1}), 1);
    if (!gathered.ok() || gathered->scalar_type() != at::kBFloat16 ||
        !gathered->equal(bf16({1e30f, 2e30f, 3e30f}).view({1, 3})))
      fail("allgather");
    // Each rank holds [256 or 1, ...] x 3 columns; rank j keeps column j of the sum.
    // (2^100 is exact in bf16 and out of fp16's range.)
    const float big = std::ldexp(1.f, 100);
    auto scattered = (*comm)->ReduceScatter(bf16({rank == 0 ? 256.f : 1.f, 1.f, big}).view({1, 3}), 1);
    const float want = std::vector<float>{258.f, 3.f, 3 * big}[static_cast<size_t>(rank)];
    if (!scattered.ok() || scattered->scalar_type() != at::kBFloat16 || !scattered->equal(bf16({want}).view({1, 1})))
      fail("reduce-scatter");
    // A pipeline transfer, rank 0 to rank 2.
    if (rank == 0 && (!(*comm)->Send(bf16({3e38f, -1e-30f}), 2, 5).ok() || !(*comm)->WaitForSends().ok())) {
      fail("send");
    }
    if (rank == 2) {
      at::Tensor got = at::empty({2}, at::kBFloat16);
      if (!(*comm)->Recv(got, 0, 5).ok() || !got.equal(bf16({3e38f, -1e-30f}))) fail("recv");
    }
  };
  std::vector<std::thread> threads;
  for (int r = 0; r < 3; ++r) threads.emplace_back(run, r);
  for (auto& t : threads) t.join();
  for (int r = 0; r < 3; ++r) EXPECT_EQ(failures[r], "") << "rank " << r;
}

// TP ranks that cannot share a segment (each looks in its own directory, as on two hosts) use Gloo,
// and their collectives still add up.
TEST(GlooCollectives, TpRanksWithoutACommonShmFallBackToGloo) {
  const Rendezvous rendezvous;
  const std::string base = testing::TempDir() + "/gloo_shm_fallback_";
  std::vector<std::string> failures(2);
  auto run = [&](int rank) {
    GlooOptions options{.rendezvous = rendezvous.For(rank, 2), .tp_size = 2};
    options.shm.dir = base + std::to_string(rank);
    mkdir(options.shm.dir.c_str(), 0700);
    auto comm = GlooCollectives::Connect(options);
    if (!comm.ok()) return void(failures[rank] = std::string(comm.status().message()));
    if ((*comm)->tp_transport() != "gloo") failures[rank] += "transport " + (*comm)->tp_transport() + "; ";
    at::Tensor t = at::full({5}, rank + 1.f);
    if (!(*comm)->AllReduceSum(t).ok() || !t.equal(at::full({5}, 3.f))) failures[rank] += "allreduce; ";
  };
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) threads.emplace_back(run, r);
  for (auto& t : threads) t.join();
  for (int r = 0; r < 2; ++r) EXPECT_EQ(failures[r], "") << "rank " << r;
}

// A pipeline send returns before its receiver has posted the receive, so the sending stage goes on
// with its next micro-batch: the receiver here posts its receive only after it has seen the
// send return. 64 MiB is far more than a socket buffer holds, so a send that waited for its
// transfer could not return first (the receiver gives up waiting after 20 s and the test fails).
TEST(GlooCollectives, SendReturnsBeforeTheReceiverTakesIt) {
  const Rendezvous rendezvous;
  std::atomic<bool> send_returned{false};
  std::vector<std::string> failures(2);
  const int64_t n = int64_t{16} << 20;  // floats
  auto run = [&](int rank) {
    GlooOptions options{.rendezvous = rendezvous.For(rank, 2, std::chrono::milliseconds(60000)), .tp_size = 1};
    auto comm = GlooCollectives::Connect(options);
    if (!comm.ok()) return void(failures[rank] = std::string(comm.status().message()));
    if (rank == 0) {
      if (!(*comm)->Send(at::arange(n, at::kFloat), 1, 3).ok()) failures[0] += "send; ";
      send_returned = true;
      if (absl::Status s = (*comm)->WaitForSends(); !s.ok()) failures[0] += std::string(s.message());
    } else {
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
      while (!send_returned && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
      if (!send_returned) failures[1] += "the send did not return before its receive was posted; ";
      at::Tensor got = at::empty({n});
      if (!(*comm)->Recv(got, 0, 3).ok() || !got.equal(at::arange(n, at::kFloat))) failures[1] += "recv; ";
    }
  };
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) threads.emplace_back(run, r);
  for (auto& t : threads) t.join();
  for (int r = 0; r < 2; ++r) EXPECT_EQ(failures[r], "") << "rank " << r;
}

// Nobody leaves a barrier before the last rank arrives: each rank records the arrivals it saw on
// leaving; rank 2 arrives late on purpose. Twice in a row, so each call's keys are its own.
TEST(GlooCollectives, BarrierWaitsForEveryRank) {
  const Rendezvous rendezvous;
  std::atomic<int> arrived{0};
  std::vector<std::string> failures(3);
  auto run = [&](int rank) {
    GlooOptions options{.rendezvous = rendezvous.For(rank, 3), .tp_size = 1};
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
  const Rendezvous rendezvous;
  std::thread peer([&] {
    // Rank 1 joins the rendezvous, then never calls Barrier.
    GlooOptions options{.rendezvous = rendezvous.For(1, 2, std::chrono::milliseconds(1500)), .tp_size = 1};
    auto comm = GlooCollectives::Connect(options);
    ASSERT_TRUE(comm.ok()) << comm.status();
    std::this_thread::sleep_for(std::chrono::milliseconds(2500));
  });
  GlooOptions options{.rendezvous = rendezvous.For(0, 2, std::chrono::milliseconds(1500)), .tp_size = 1};
  auto comm = GlooCollectives::Connect(options);
  ASSERT_TRUE(comm.ok()) << comm.status();
  const auto start = std::chrono::steady_clock::now();
  EXPECT_EQ((*comm)->Barrier().code(), absl::StatusCode::kUnavailable);
  // After the options' timeout, not the 30 s the store was hosted with: Connect set it.
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  peer.join();
}

TEST(GlooCollectives, RendezvousWithoutPeersTimesOutAsUnavailable) {
  const Rendezvous rendezvous;
  GlooOptions options{.rendezvous = rendezvous.For(0, 2, std::chrono::milliseconds(1500)), .tp_size = 1};
  auto comm = GlooCollectives::Connect(options);
  EXPECT_EQ(comm.status().code(), absl::StatusCode::kUnavailable) << comm.status();
  options.rendezvous.world_size = 3;
  options.tp_size = 2;
  EXPECT_EQ(GlooCollectives::Connect(options).status().code(), absl::StatusCode::kInvalidArgument);
}

// Rank 0 without a store hosts one on master_port; a port someone else holds (here: a hosted
// store's) fails at once as UNAVAILABLE, naming the port, rather than waiting for the timeout.
TEST(GlooCollectives, HostingOnATakenPortFailsAtOnceAsUnavailable) {
  const Rendezvous taken;
  GlooOptions options{.rendezvous = {.master_addr = "127.0.0.1",
                                     .master_port = taken.port(),
                                     .rank = 0,
                                     .world_size = 2,
                                     .timeout = std::chrono::milliseconds(30000),
                                     .secret = kSecret},
                      .tp_size = 1};
  const auto start = std::chrono::steady_clock::now();
  auto comm = GlooCollectives::Connect(options);
  EXPECT_EQ(comm.status().code(), absl::StatusCode::kUnavailable) << comm.status();
  EXPECT_NE(comm.status().message().find(absl::StrCat("127.0.0.1:", taken.port())), std::string::npos) << comm.status();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
}

}  // namespace
}  // namespace bertshard::worker
