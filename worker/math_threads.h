// File: worker/math_threads.h
// -----------------------------------------------------------------------------
// How many threads a rank's math may use, for LibTorch's intra-op pool and for the BLAS under it.
// at::set_num_threads alone leaves Debian's OpenBLAS (which LibTorch calls for its matrix products)
// at one thread per core, whose workers spin between calls: a `--threads=1` worker then used about
// two cores, and four such workers on one machine slowed each other down (bench/README.md).
// `shardctl run` sets OPENBLAS_NUM_THREADS for its rank processes; a worker daemon serves many jobs
// with per-job thread counts, so it sets both at run time instead.
//
// Example:
//   SetMathThreads(job->threads, job->shard->gemm_path() == GemmPath::kBlas);  // before each forward:
//                                                                          // jobs on one worker differ
//
// Thread safety: process-wide settings; call from the thread that runs the forward.
#ifndef BERTSHARD_WORKER_MATH_THREADS_H_
#define BERTSHARD_WORKER_MATH_THREADS_H_

namespace bertshard::worker {

// LibTorch's intra-op threads (its OpenMP pool, which oneDNN shares) and, when the process has
// OpenBLAS, its threads: max(1, threads). With `blas_products` false (a shard on the oneDNN path,
// whose products and attention never call BLAS) OpenBLAS gets one thread, so its pool never wakes
// and never spins beside the OpenMP one: exactly `threads` threads compute, one per core given.
// Cheap when the counts are unchanged: LibTorch's own setter (which also rebuilds its pthreadpool,
// starting fresh threads that spin) runs only when the count changes; per forward, only the calling
// thread's OpenMP count and OpenBLAS's are set.
void SetMathThreads(int threads, bool blas_products = true);

}  // namespace bertshard::worker

#endif  // BERTSHARD_WORKER_MATH_THREADS_H_
