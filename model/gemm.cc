#include "model/gemm.h"

#include <ATen/ATen.h>
#include <dlfcn.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <chrono>
#include <cmath>
#include <exception>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

namespace bertshard::model {
namespace {

using Clock = std::chrono::steady_clock;

// Of the timed runs, both paths: small next to a shard's load, short enough for every process
// start. One run of each is taken whatever it costs: a product that alone takes longer is timed
// once (BERT-base's 1024 x 768 x 3072 is ~60 ms a run on one AVX2 core).
constexpr double kBudgetSeconds = 0.1;
constexpr int kMaxRuns = 3;

double SecondsOf(const std::function<void()>& call) {
  const auto start = Clock::now();
  call();
  return std::chrono::duration<double>(Clock::now() - start).count();
}

double Fastest(const std::vector<double>& runs) { return *std::min_element(runs.begin(), runs.end()); }

// One path this much faster than the other after a round decides the pick without more rounds.
constexpr double kDecisive = 1.5;

// Blocks of kBlock x kBlock elements keep a block's source rows and destination rows in L1/L2.
constexpr int64_t kBlock = 64;

// `ls`: the source's row stride (cols may be a block of its columns).
void TransposeScalar(const float* src, int64_t rows, int64_t cols, int64_t ls, float* dst, int64_t ld) {
  for (int64_t c0 = 0; c0 < cols; c0 += kBlock) {
    for (int64_t r0 = 0; r0 < rows; r0 += kBlock) {
      const int64_t c1 = std::min(cols, c0 + kBlock), r1 = std::min(rows, r0 + kBlock);
      for (int64_t c = c0; c < c1; ++c) {
        for (int64_t r = r0; r < r1; ++r) dst[c * ld + r] = src[r * ls + c];
      }
    }
  }
}

#if defined(__x86_64__)
// One 8 x 8 tile: eight rows of `s` (stride ls) become eight rows of `d` (stride ld).
__attribute__((target("avx2"))) inline void Transpose8x8(const float* s, int64_t ls, float* d, int64_t ld) {
  const __m256 r0 = _mm256_loadu_ps(s), r1 = _mm256_loadu_ps(s + ls), r2 = _mm256_loadu_ps(s + 2 * ls),
               r3 = _mm256_loadu_ps(s + 3 * ls), r4 = _mm256_loadu_ps(s + 4 * ls), r5 = _mm256_loadu_ps(s + 5 * ls),
               r6 = _mm256_loadu_ps(s + 6 * ls), r7 = _mm256_loadu_ps(s + 7 * ls);
  const __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1), t2 = _mm256_unpacklo_ps(r2, r3),
               t3 = _mm256_unpackhi_ps(r2, r3), t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5),
               t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE),
               u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE),
               u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE),
               u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  _mm256_storeu_ps(d, _mm256_permute2f128_ps(u0, u4, 0x20));
  _mm256_storeu_ps(d + ld, _mm256_permute2f128_ps(u1, u5, 0x20));
  _mm256_storeu_ps(d + 2 * ld, _mm256_permute2f128_ps(u2, u6, 0x20));
  _mm256_storeu_ps(d + 3 * ld, _mm256_permute2f128_ps(u3, u7, 0x20));
  _mm256_storeu_ps(d + 4 * ld, _mm256_permute2f128_ps(u0, u4, 0x31));
  _mm256_storeu_ps(d + 5 * ld, _mm256_permute2f128_ps(u1, u5, 0x31));
  _mm256_storeu_ps(d + 6 * ld, _mm256_permute2f128_ps(u2, u6, 0x31));
  _mm256_storeu_ps(d + 7 * ld, _mm256_permute2f128_ps(u3, u7, 0x31));
}

__attribute__((target("avx2"))) void TransposeAvx2(const float* src, int64_t rows, int64_t cols, int64_t ls, float* dst,
                                                   int64_t ld) {
  for (int64_t c0 = 0; c0 < cols; c0 += kBlock) {
    for (int64_t r0 = 0; r0 < rows; r0 += kBlock) {
      const int64_t c1 = std::min(cols, c0 + kBlock), r1 = std::min(rows, r0 + kBlock);
      int64_t c = c0;
      for (; c + 8 <= c1; c += 8) {
        int64_t r = r0;
        for (; r + 8 <= r1; r += 8) Transpose8x8(src + r * ls + c, ls, dst + c * ld + r, ld);
        for (; r < r1; ++r) {  // rows past the last whole tile
          for (int64_t k = c; k < c + 8; ++k) dst[k * ld + r] = src[r * ls + k];
        }
      }
      for (; c < c1; ++c) {  // columns past the last whole tile
        for (int64_t r = r0; r < r1; ++r) dst[c * ld + r] = src[r * ls + c];
      }
    }
  }
}
#endif

}  // namespace

void TransposeInto(const float* src, int64_t rows, int64_t cols, float* dst, int64_t dst_stride) {
#if defined(__x86_64__)
  static const bool avx2 = __builtin_cpu_supports("avx2");
#endif
  // One thread: on two cores a second one did not speed it up (the page faults of a fresh
  // destination dominate), measured.
#if defined(__x86_64__)
  if (avx2) return TransposeAvx2(src, rows, cols, cols, dst, dst_stride);
#endif
  TransposeScalar(src, rows, cols, cols, dst, dst_stride);
}

bool OneDnnPacksByTransposing(at::ScalarType dtype, c10::Device device) {
  return DnnlSgemm() != nullptr && dtype == at::kFloat && device.is_cpu();
}

namespace {

// What LibTorch 1.13's mkldnn_linear asks of the CPU for bfloat16 (mkldnn_bf16_device_check).
bool CpuHasOneDnnBf16() {
#if defined(__x86_64__)
  static const bool has =
      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  return has;
#else
  return false;
#endif
}

}  // namespace

absl::Status GemmPathAvailable(GemmPath path, at::ScalarType dtype) {
  if (path != GemmPath::kOneDnn) return absl::OkStatus();
  if (!at::hasMKLDNN()) {
    return absl::FailedPreconditionError(
        "--gemm=onednn needs a LibTorch built with MKL-DNN (oneDNN); this one has none: use --gemm=blas or auto");
  }
  if (dtype == at::kBFloat16 && !CpuHasOneDnnBf16()) {
    return absl::FailedPreconditionError(
        "--gemm=onednn with bf16 needs a CPU with AVX-512 BW, VL and DQ (oneDNN's bf16 linear); this one lacks "
        "them: use --gemm=blas or auto");
  }
  return absl::OkStatus();
}

DnnlSgemmFn DnnlSgemm() {
  static const auto sgemm = reinterpret_cast<DnnlSgemmFn>(dlsym(RTLD_DEFAULT, "dnnl_sgemm"));
  return sgemm;
}

at::Tensor PackOneDnnWeight(const at::Tensor& weight) {
  // float32 with oneDNN's sgemm at hand: the weight transposed once, [in, out] row-major. Its GEMM
  // reads that form at least as fast as at::mkldnn_linear reads its packed one (2 AVX-512 cores,
  // batch 8 x 128 rows: 243-277 against 155-252 GFLOP/s over BERT-base's four shapes), and inputs
  // and outputs stay dense: no conversion to and from oneDNN's layout around each product.
  if (OneDnnPacksByTransposing(weight.scalar_type(), weight.device())) {
    const at::Tensor w = weight.contiguous();
    at::Tensor packed = at::empty({w.size(1), w.size(0)}, w.options());
    TransposeInto(w.data_ptr<float>(), w.size(0), w.size(1), packed.data_ptr<float>(), w.size(0));
    return packed;
  }
  return weight.contiguous().to_mkldnn();
}

at::Tensor OneDnnLinear(const at::Tensor& x, const at::Tensor& packed_weight, const at::Tensor& bias) {
  if (!packed_weight.is_mkldnn()) {
    // The transposed float32 weight of PackOneDnnWeight: y = bias + x w^T through dnnl_sgemm.
    const DnnlSgemmFn sgemm = DnnlSgemm();
    const int64_t in = packed_weight.size(0), out = packed_weight.size(1);
    const at::Tensor a = x.reshape({-1, in}).contiguous();  // a view unless x is strided (the pooler's)
    const int64_t rows = a.size(0);
    std::vector<int64_t> shape = x.sizes().vec();
    shape.back() = out;
    at::Tensor y = at::empty(shape, x.options());
    float beta = 0;
    if (bias.defined()) {
      y.view({rows, out}).copy_(bias.expand({rows, out}));
      beta = 1;
    }
    const int status = sgemm('N', 'N', rows, out, in, 1.f, a.data_ptr<float>(), in, packed_weight.data_ptr<float>(),
                             out, beta, y.data_ptr<float>(), out);
    if (status != 0) throw std::runtime_error("dnnl_sgemm failed with status " + std::to_string(status));
    return y;
  }
  // to_mkldnn makes a contiguous copy itself (the pooler's input is a strided slice).
  const c10::optional<at::Tensor> b = bias.defined() ? c10::optional<at::Tensor>(bias) : c10::nullopt;
  return at::mkldnn_linear(x.to_mkldnn(), packed_weight, b).to_dense();
}

GemmChoice PickGemmPath(int64_t rows, int64_t in, int64_t out, at::ScalarType dtype) {
  GemmChoice choice;
  if (rows < 1 || in < 1 || out < 1) return choice;
  const double flop = 2.0 * static_cast<double>(rows) * static_cast<double>(in) * static_cast<double>(out);
  try {
    // The product itself, not a smaller one: which path wins depends on the rows (on two AVX2
    // cores oneDNN is twice OpenBLAS's speed at 128 rows, and no faster at 1024).
    const at::Tensor x = at::randn({rows, in}).to(dtype);
    // A trained layer's scale; the figures do not depend on the values, but denormals would.
    const at::Tensor weight = (at::randn({out, in}) / std::sqrt(static_cast<double>(in))).to(dtype);
    const at::Tensor bias = at::randn({out}).to(dtype);
    const std::function<void()> blas = [&] { at::linear(x, weight, bias); };
    // Warm-ups. BLAS: a few rows wake its threads. oneDNN: the first call of a shape creates the
    // primitive (and JIT code) for it, so it is the whole product.
    at::linear(x.narrow(0, 0, std::min<int64_t>(rows, 64)), weight, bias);
    std::function<void()> onednn;
    at::Tensor packed;
    if (GemmPathAvailable(GemmPath::kOneDnn).ok()) {
      try {
        packed = PackOneDnnWeight(weight);
        OneDnnLinear(x, packed, bias);
        onednn = [&] { OneDnnLinear(x, packed, bias); };
      } catch (const std::exception&) {
        // A oneDNN that fails here would fail in the forward: BLAS it is.
      }
    }
    // Runs alternate between the paths, so that a burst of other work on the machine slows both.
    // Each path's figure is its fastest run: other work only ever adds time. Past the budget, the
    // timing stops once one path is clearly ahead (kDecisive); a close call, or one a burst of
    // noise may have decided, gets more rounds, up to kMaxRuns (a large product on a busy machine
    // once read oneDNN at 76 GFLOP/s against its 240).
    std::vector<double> blas_runs, onednn_runs;
    double spent = 0;
    while (blas_runs.size() < static_cast<size_t>(kMaxRuns)) {
      blas_runs.push_back(SecondsOf(blas));
      spent += blas_runs.back();
      if (onednn) {
        onednn_runs.push_back(SecondsOf(onednn));
        spent += onednn_runs.back();
      }
      if (spent < kBudgetSeconds) continue;
      if (!onednn) break;
      const double b = Fastest(blas_runs), o = Fastest(onednn_runs);
      if (std::max(b, o) > kDecisive * std::min(b, o)) break;
    }
    choice.blas_gflops = flop / std::max(1e-9, Fastest(blas_runs)) / 1e9;
    if (!onednn_runs.empty()) choice.onednn_gflops = flop / std::max(1e-9, Fastest(onednn_runs)) / 1e9;
  } catch (const std::exception&) {
    return GemmChoice{};
  }
  if (choice.onednn_gflops > choice.blas_gflops) choice.path = GemmPath::kOneDnn;
  return choice;
}

}  // namespace bertshard::model
