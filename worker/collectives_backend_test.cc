// Backend names to real collectives: Gloo groups over the rendezvous store on loopback (ranks are threads),
// and what a build without NCCL answers for "nccl".
#include "worker/collectives_backend.h"

#include <ATen/ATen.h>

#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace bertshard::worker {
namespace {

const std::string kSecret(32, 's');  // the job's rendezvous secret

TEST(CollectivesBackend, UnknownBackendsAreRefusedNamingTheValidOnes) {
  EXPECT_TRUE(CheckBackend("gloo").ok());
  const absl::Status mpi = CheckBackend("mpi");
  EXPECT_EQ(mpi.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(mpi.message(), "unknown backend mpi; valid: gloo, nccl");
  auto connected = ConnectCollectives({.backend = "mpi"});
  EXPECT_EQ(connected.status(), mpi);
}

#ifdef BERTSHARD_WITH_NCCL
TEST(CollectivesBackend, NcclIsServedInThisBuild) { EXPECT_TRUE(CheckBackend("nccl").ok()); }
#else
// Without NCCL, every way in to it says how to get a build that has it, naming this binary.
TEST(CollectivesBackend, WithoutNcclEveryNcclPathSaysHowToBuildIt) {
  const absl::Status nccl = CheckBackend("nccl");
  EXPECT_EQ(nccl.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(nccl.message(), "this collectives_backend_test was built without NCCL: bazel build --config=cuda");
  EXPECT_EQ(ConnectCollectives({.backend = "nccl"}).status(), nccl);
  EXPECT_EQ(GpuForLocalRank(0, 1).status(), nccl);
  const auto bus_id = WorkerGpuBusId("cuda:3", 3);
  EXPECT_EQ(bus_id.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(bus_id.status().message(), "--device=cuda:3 needs a build with NCCL: bazel build --config=cuda");
}
#endif

// "gloo" with its TP transport choices: shared memory where a stage's ranks share a host (these
// threads do), Gloo when shared memory is turned off, none at TP 1; the groups really sum.
TEST(CollectivesBackend, GlooConnectsWithTheTransportAsked) {
  struct Case {
    int tp_size;
    bool shared_memory;
    std::string transport;
  };
  for (const Case& c : {Case{2, true, "shared memory"}, Case{2, false, "gloo"}, Case{1, true, "none"}}) {
    auto hosted = HostStore("127.0.0.1", kSecret, std::chrono::seconds(30));
    ASSERT_TRUE(hosted.ok()) << hosted.status();
    const int world = 2;
    std::vector<std::string> failures(world);
    std::vector<std::thread> ranks;
    for (int rank = 0; rank < world; ++rank) {
      ranks.emplace_back([&, rank] {
        auto connected =
            ConnectCollectives({.backend = "gloo",
                                .rendezvous = {.master_port = (*hosted)->getPort(),
                                               .rank = rank,
                                               .world_size = world,
                                               .timeout = std::chrono::seconds(30),
                                               .secret = kSecret,
                                               .store = rank == 0 ? c10::intrusive_ptr<c10d::Store>(*hosted)
                                                                  : c10::intrusive_ptr<c10d::Store>()},
                                .tp_size = c.tp_size,
                                .shared_memory = c.shared_memory});
        if (!connected.ok()) {
          failures[rank] = std::string(connected.status().message());
          return;
        }
        if (connected->tp_transport != c.transport) failures[rank] += "transport " + connected->tp_transport + "; ";
        if (connected->comm->tp_size() != c.tp_size) failures[rank] += "tp size; ";
        at::Tensor t = at::ones({3}) * (rank + 1);
        if (!connected->comm->AllReduceSum(t).ok()) failures[rank] += "all-reduce; ";
        // TP 2 sums both ranks (1 + 2); at TP 1 each rank is its own group.
        if (!t.equal(at::ones({3}) * (c.tp_size == 2 ? 3 : rank + 1))) failures[rank] += "sum; ";
        if (!connected->comm->Barrier().ok()) failures[rank] += "barrier; ";
      });
    }
    for (auto& t : ranks) t.join();
    for (int rank = 0; rank < world; ++rank) EXPECT_EQ(failures[rank], "") << c.transport << ", rank " << rank;
  }
}

}  // namespace
}  // namespace bertshard::worker
