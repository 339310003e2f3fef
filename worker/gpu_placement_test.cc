#include "worker/gpu_placement.h"

#include "gtest/gtest.h"

namespace bertshard::worker {
namespace {

TEST(GpuForRank, OneRankPerGpu) {
  EXPECT_EQ(*GpuForRank(0, 4, 4), 0);
  EXPECT_EQ(*GpuForRank(3, 4, 4), 3);
  EXPECT_EQ(*GpuForRank(3, 4, 8), 3);
  EXPECT_EQ(*GpuForRank(5, 0, 4), 1);  // ranks on other hosts: rank mod devices
}

TEST(GpuForRank, MoreRanksThanGpusIsRefusedBeforeNcclSaysSo) {
  const auto s = GpuForRank(0, 2, 1).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.message(),
            "the nccl backend runs one rank per GPU, and NCCL refuses two on one: 2 ranks on this host, 1 GPU visible "
            "(use tp x pp <= the GPU count, check CUDA_VISIBLE_DEVICES, or use --backend gloo)");
  EXPECT_EQ(GpuForRank(0, 1, 0).status().message(), "no CUDA device visible");
  EXPECT_EQ(GpuForRank(-1, 1, 1).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ParseWorkerDevice, CpuOrOneCudaIndex) {
  EXPECT_EQ(ParseWorkerDevice("cpu").value(), -1);
  EXPECT_EQ(ParseWorkerDevice("cuda:0").value(), 0);
  EXPECT_EQ(ParseWorkerDevice("cuda:3").value(), 3);
  for (const char* bad : {"", "gpu", "cuda", "cuda:", "cuda:-1", "cuda:01", "cuda:0,1"}) {
    const absl::Status status = ParseWorkerDevice(bad).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(status.message().find("valid: cpu"), std::string::npos) << status;
  }
}

TEST(CheckGpuVisible, NamesTheCounts) {
  EXPECT_TRUE(CheckGpuVisible(1, 2).ok());
  const absl::Status missing = CheckGpuVisible(2, 2);
  EXPECT_EQ(missing.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(missing.message().find("cuda:2 is not a visible GPU: 2 GPUs are visible"), std::string::npos) << missing;
  EXPECT_EQ(CheckGpuVisible(0, 0).code(), absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace bertshard::worker
