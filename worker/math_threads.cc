#include "worker/math_threads.h"

#include <ATen/Parallel.h>
#include <dlfcn.h>

#include <algorithm>
#include <atomic>

namespace bertshard::worker {

void SetMathThreads(int threads, bool blas_products) {
  threads = std::max(1, threads);
  // at::set_num_threads also rebuilds LibTorch's pthreadpool (destroying its threads and starting
  // new ones, which spin while they wait for work) on every call, so it is called only when the
  // count changes; OpenMP's count is the calling thread's own setting, so that is set every time.
  static std::atomic<int> process_threads{0};
  using SetThreads = void (*)(int);
  static const auto omp = reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "omp_set_num_threads"));
  if (process_threads.exchange(threads) != threads || omp == nullptr) {
    at::set_num_threads(threads);
  } else {
    omp(threads);
  }
  // Looked up, not linked: LibTorch reaches BLAS through Debian's libblas.so.3 alternative, which
  // is OpenBLAS here but need not be (the reference BLAS has no threads to limit).
  static const auto openblas = reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
  if (openblas != nullptr) openblas(blas_products ? threads : 1);
}

}  // namespace bertshard::worker
