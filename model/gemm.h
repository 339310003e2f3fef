// File: model/gemm.h
// -----------------------------------------------------------------------------
// How a CPU shard runs its linears: LibTorch's BLAS path (at::linear) or oneDNN (in float32 its
// sgemm on a weight transposed once at load; in bf16 at::mkldnn_linear on a weight prepacked once),
// and a start-up micro-benchmark that picks the faster on this machine. Neither wins everywhere:
// with AVX-512 oneDNN's fp32 products are several times faster than Debian's OpenBLAS (2 cores:
// ~300 against ~60 GFLOP/s); on a 2-core AVX2-only EPYC OpenBLAS is faster with one thread, and
// which wins with two depends on the rows -- so "auto" measures instead of guessing, and the
// figures are reported.
//
// Example:
//   at::set_num_threads(threads);  // first: the figures depend on the threads
//   const GemmChoice choice = PickGemmPath(/*rows=*/8 * 128, hidden, intermediate);
//   const at::Tensor packed = PackOneDnnWeight(weight);  // once, at load
//   y = choice.path == GemmPath::kOneDnn ? OneDnnLinear(x, packed, bias) : at::linear(x, weight, bias);
//
// Thread safety: thread-compatible; PickGemmPath uses the calling thread's LibTorch threads and
// should not share the cores with other work while it runs (its figures would be the other work's).
#ifndef BERTSHARD_MODEL_GEMM_H_
#define BERTSHARD_MODEL_GEMM_H_

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "absl/status/status.h"
#include "model/gemm_flag.h"

namespace bertshard::model {

// OK for kBlas; for kOneDnn, FAILED_PRECONDITION when this LibTorch was built without MKL-DNN,
// or, for bfloat16 linears on the CPU, when this CPU lacks what oneDNN's bf16 linear needs
// (AVX-512 BW, VL and DQ: an AVX2 CPU has none), said before any weight is read instead of
// LibTorch's refusal at the first product.
absl::Status GemmPathAvailable(GemmPath path, at::ScalarType dtype = at::kFloat);

// The weight of a linear ([out, in], CPU float32 or bfloat16) in the form the oneDNN path
// multiplies, made once at load: float32 where oneDNN's sgemm is at hand, the transposed weight
// ([in, out], dense: see gemm.cc for why); otherwise oneDNN's own layout (an MKL-DNN tensor).
at::Tensor PackOneDnnWeight(const at::Tensor& weight);

// Whether PackOneDnnWeight's form of a `dtype` weight on `device` is the plain transpose (float32
// on CPU with oneDNN's sgemm at hand): a loader may then write it itself with TransposeInto,
// straight from what it read, instead of building the dense weight first.
bool OneDnnPacksByTransposing(at::ScalarType dtype, c10::Device device);

// dst[c * dst_stride + r] = src[r * cols + c] for a dense row-major [rows, cols] `src`: the
// transpose, written into columns [0, rows) of a [cols, dst_stride] matrix (so that several parts
// can land side by side in one). 8 x 8 AVX2 tiles where the CPU has AVX2 (7 GB/s on one core
// against 2-4 for Tensor::t().contiguous()), a blocked scalar loop elsewhere. One thread.
void TransposeInto(const float* src, int64_t rows, int64_t cols, float* dst, int64_t dst_stride);

// x [..., in] (dense, CPU) times the packed weight, plus `bias` ([out], dense) if defined: dense
// [..., out]. On an MKL-DNN weight it converts x to oneDNN's layout and the product back -- those
// copies are part of the path's cost, and PickGemmPath times them too.
at::Tensor OneDnnLinear(const at::Tensor& x, const at::Tensor& packed_weight, const at::Tensor& bias);

// oneDNN's row-major single-precision GEMM (dnnl_sgemm of oneDNN's C API: C = alpha op(A) op(B) +
// beta C, op 'N' or 'T', leading dimensions in elements; returns dnnl_status_t, 0 for success),
// from the libdnnl LibTorch is linked with, looked up once at run time; null where the process has
// none. Looked up rather than included: Debian ships oneDNN's headers only in libdnnl-dev, and the
// C API's signature is stable since oneDNN 1.0. Called from several threads at once it runs each call on its own
// thread.
using DnnlSgemmFn = int (*)(char transa, char transb, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
                            int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc);
DnnlSgemmFn DnnlSgemm();

struct GemmChoice {
  GemmPath path = GemmPath::kBlas;
  // Measured throughput of each path on the product shape; 0 when not measured (oneDNN where
  // LibTorch has no MKL-DNN, or where it failed).
  double blas_gflops = 0;
  double onednn_gflops = 0;
};

// Times [rows, in] x [in, out] + bias on both paths with the current LibTorch threads (a warm-up,
// then the median of up to 3 runs of each, alternating; runs stop once they have taken ~100 ms,
// after at least one of each) and returns the faster: BLAS on a tie or when oneDNN is unavailable.
// Never fails: anything unexpected leaves the BLAS path, today's. Allocates the product's operands
// (rows x in, out x in, rows x out floats).
// `dtype` is the operands' (kFloat or kBFloat16).
GemmChoice PickGemmPath(int64_t rows, int64_t in, int64_t out, at::ScalarType dtype = at::kFloat);

}  // namespace bertshard::model

#endif  // BERTSHARD_MODEL_GEMM_H_
