// The threads a rank's math may use: LibTorch's pool always, OpenBLAS's only where products call
// it (a shard on the oneDNN path keeps OpenBLAS at one thread, so no second pool spins).
#include "worker/math_threads.h"

#include <ATen/Parallel.h>
#include <dlfcn.h>

#include "gtest/gtest.h"

namespace bertshard::worker {
namespace {

TEST(SetMathThreads, LibTorchAndOpenBlasTogether) {
  const auto openblas_threads = reinterpret_cast<int (*)()>(dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
  SetMathThreads(2);
  EXPECT_EQ(at::get_num_threads(), 2);
  if (openblas_threads != nullptr) {
    EXPECT_EQ(openblas_threads(), 2);
  }
  SetMathThreads(2, /*blas_products=*/false);
  EXPECT_EQ(at::get_num_threads(), 2);
  if (openblas_threads != nullptr) {
    EXPECT_EQ(openblas_threads(), 1);
  }
  SetMathThreads(0);  // at least one
  EXPECT_EQ(at::get_num_threads(), 1);
  if (openblas_threads == nullptr) GTEST_SKIP() << "no OpenBLAS in this process: only LibTorch's threads checked";
}

}  // namespace
}  // namespace bertshard::worker
