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

}  // namespace
}  // namespace bertshard::worker
