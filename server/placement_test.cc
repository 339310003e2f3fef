#include "server/placement.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace bertshard::server {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

TEST(NormaliseBackend, GlooByDefaultNcclOnRequestOthersRefused) {
  EXPECT_EQ(NormaliseBackend("").value(), "gloo");
  EXPECT_EQ(NormaliseBackend("Gloo").value(), "gloo");
  EXPECT_EQ(NormaliseBackend("NCCL").value(), "nccl");
  const absl::Status mpi = NormaliseBackend("mpi").status();
  EXPECT_EQ(mpi.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(mpi.message(), HasSubstr("valid: gloo"));
}

TEST(CheckDevice, CpuAndCudaIndexes) {
  for (const char* ok : {"", "cpu", "cuda:0", "cuda:7"}) EXPECT_TRUE(CheckDevice(ok).ok()) << ok;
  for (const char* bad : {"gpu", "cuda", "cuda:", "cuda:-1", "cuda:01", "cuda:1x", "CUDA:0"}) {
    EXPECT_EQ(CheckDevice(bad).code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

TEST(HostOf, DropsThePort) {
  EXPECT_EQ(HostOf("10.0.0.1:50061"), "10.0.0.1");
  EXPECT_EQ(HostOf("worker-0.bertshard:7000"), "worker-0.bertshard");
  EXPECT_EQ(HostOf("[fd00::1]:7000"), "[fd00::1]");
  EXPECT_EQ(HostOf("nohost"), "nohost");
  EXPECT_EQ(HostOf("fd00::1"), "fd00::1");  // no brackets: all host (gRPC reads it so)
  EXPECT_EQ(HostOf("fd00::2"), "fd00::2");
}

std::vector<IdleWorker> Workers(std::vector<std::pair<std::string, std::string>> address_device) {
  std::vector<IdleWorker> idle;
  for (size_t i = 0; i < address_device.size(); ++i) {
    idle.push_back({"w" + std::to_string(i), address_device[i].first, address_device[i].second});
  }
  return idle;
}

TEST(PlaceRanks, GlooTakesCpuWorkersOnly) {
  const auto idle = Workers({{"a:1", "cuda:0"}, {"a:2", "cpu"}, {"b:1", ""}, {"b:2", "cpu"}});
  EXPECT_THAT(PlaceRanks("gloo", 2, idle).ranks, ElementsAre(1, 2));
  const Placement short_of = PlaceRanks("gloo", 4, idle);
  EXPECT_THAT(short_of.ranks, IsEmpty());
  EXPECT_THAT(short_of.waiting_for, HasSubstr("4 healthy idle CPU workers (gloo); 3 are free"));
}

TEST(PlaceRanks, NcclTakesOneWorkerPerGpuOfAHost) {
  // Host a has GPUs 0 and 1, each reported once, and GPU 0 by a second worker; host b reuses the
  // index 0 of its own GPU, which is another GPU.
  const auto idle =
      Workers({{"a:1", "cuda:0"}, {"a:2", "cuda:0"}, {"a:3", "cpu"}, {"a:4", "cuda:1"}, {"b:1", "cuda:0"}});
  EXPECT_THAT(PlaceRanks("nccl", 3, idle).ranks, ElementsAre(0, 3, 4));
}

TEST(PlaceRanks, NcclWaitsNamingTheGpuSeveralWorkersReport) {
  const auto idle = Workers({{"a:1", "cuda:0"}, {"a:2", "cuda:0"}, {"a:3", "cuda:0"}, {"b:1", "cuda:0"}});
  const Placement placement = PlaceRanks("nccl", 4, idle);
  EXPECT_THAT(placement.ranks, IsEmpty());
  EXPECT_THAT(placement.waiting_for, HasSubstr("4 healthy idle GPU workers on distinct GPUs"));
  EXPECT_THAT(placement.waiting_for, HasSubstr("2 distinct GPUs are free"));
  EXPECT_THAT(placement.waiting_for,
              HasSubstr("GPU cuda:0 of a is reported by 3 workers (w0 at a:1 as cuda:0, w1 at a:2 as cuda:0, w2"));
  EXPECT_THAT(placement.waiting_for, HasSubstr("CUDA_VISIBLE_DEVICES"));
  EXPECT_THAT(placement.waiting_for, HasSubstr("--device"));
  // CPU workers never serve NCCL.
  EXPECT_THAT(PlaceRanks("nccl", 1, Workers({{"a:1", "cpu"}})).ranks, IsEmpty());
}

// Where workers report their GPU's bus id, that is the GPU: two workers each shown one GPU as
// cuda:0 (CUDA_VISIBLE_DEVICES=0 and =1) hold two, and two indexes naming one GPU hold one.
TEST(PlaceRanks, TheBusIdTellsGpusApartWhereReported) {
  std::vector<IdleWorker> idle = {{"w0", "a:1", "cuda:0", "0000:3B:00.0"}, {"w1", "a:2", "cuda:0", "0000:5E:00.0"}};
  EXPECT_THAT(PlaceRanks("nccl", 2, idle).ranks, ElementsAre(0, 1));
  idle = {{"w0", "a:1", "cuda:0", "0000:3B:00.0"}, {"w1", "a:2", "cuda:1", "0000:3B:00.0"}};
  const Placement one_gpu = PlaceRanks("nccl", 2, idle);
  EXPECT_THAT(one_gpu.ranks, IsEmpty());
  EXPECT_THAT(one_gpu.waiting_for, HasSubstr("1 distinct GPU is free"));
  EXPECT_THAT(one_gpu.waiting_for, HasSubstr("GPU 0000:3B:00.0 of a is reported by 2 workers"));
}

TEST(PlaceRanks, SaysOneOrManyRightly) {
  EXPECT_THAT(PlaceRanks("gloo", 1, {}).waiting_for, HasSubstr("1 healthy idle CPU worker (gloo); 0 are free"));
  EXPECT_THAT(PlaceRanks("gloo", 2, Workers({{"a:1", "cpu"}})).waiting_for, HasSubstr("; 1 is free"));
}

}  // namespace
}  // namespace bertshard::server
