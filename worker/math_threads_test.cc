// The threads a rank's math may use: LibTorch's pool always, OpenBLAS's only where products call
// it (a shard on the oneDNN path keeps OpenBLAS at one thread, so no second pool spins).
#include "worker/math_threads.h"

#include <ATen/Parallel.h>
#include <dlfcn.h>

#include <filesystem>
#include <set>
#include <string>
#include <thread>

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

// The process's threads, by id.
std::set<std::string> ThreadIds() {
  std::set<std::string> ids;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/task")) {
    ids.insert(entry.path().filename().string());
  }
  return ids;
}

// A worker sets the counts before every forward: doing so must not start threads each time (LibTorch
// rebuilds its pthreadpool on every at::set_num_threads, and the new threads spin while they wait:
// a 2-thread rank's one-sentence forward took 13-19 ms served against 4-6 ms alone).
TEST(SetMathThreads, AnUnchangedCountStartsNoThreads) {
  SetMathThreads(2);
  at::parallel_for(0, 1 << 16, 1, [](int64_t, int64_t) {});  // the pools exist and have run
  const std::set<std::string> before = ThreadIds();
  for (int i = 0; i < 5; ++i) SetMathThreads(2);
  EXPECT_EQ(ThreadIds(), before);
  EXPECT_EQ(at::get_num_threads(), 2);
}

// OpenMP's count is each calling thread's own: a forward on another thread gets it too.
TEST(SetMathThreads, AnotherThreadGetsTheCountToo) {
  SetMathThreads(2);
  int seen = 0;
  std::thread([&seen] {
    SetMathThreads(2);
    seen = at::get_num_threads();
  }).join();
  EXPECT_EQ(seen, 2);
}

}  // namespace
}  // namespace bertshard::worker
