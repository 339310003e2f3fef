#include "worker/math_threads.h"

#include <ATen/Parallel.h>
#include <dlfcn.h>

#include <algorithm>

namespace bertshard::worker {

void SetMathThreads(int threads, bool blas_products) {
  threads = std::max(1, threads);
  at::set_num_threads(threads);
  // Looked up, not linked: LibTorch reaches BLAS through Debian's libblas.so.3 alternative, which
  // is OpenBLAS here but need not be (the reference BLAS has no threads to limit).
  using SetThreads = void (*)(int);
  static const auto openblas = reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
  if (openblas != nullptr) openblas(blas_products ? threads : 1);
}

}  // namespace bertshard::worker
