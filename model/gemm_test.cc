// The --gemm flag, the oneDNN linear against at::linear, and the start-up choice between them.
#include "model/gemm.h"

#include <ATen/ATen.h>

#include <chrono>
#include <cmath>
#include <utility>
#include <vector>

#include "gtest/gtest.h"

namespace bertshard::model {
namespace {

TEST(ParseGemmFlag, NamesThePathsAndAuto) {
  auto parsed = ParseGemmFlag("auto");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_FALSE(parsed->has_value());
  parsed = ParseGemmFlag("blas");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(*parsed, GemmPath::kBlas);
  parsed = ParseGemmFlag("onednn");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(*parsed, GemmPath::kOneDnn);
  for (GemmPath path : {GemmPath::kBlas, GemmPath::kOneDnn}) {
    auto round_trip = ParseGemmFlag(GemmPathName(path));
    ASSERT_TRUE(round_trip.ok());
    EXPECT_EQ(*round_trip, path);
  }
}

TEST(ParseGemmFlag, RefusesOtherValuesNamingTheValidOnes) {
  for (const char* bad : {"", "BLAS", "mkldnn", "onednn ", "openblas"}) {
    auto parsed = ParseGemmFlag(bad);
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(parsed.status().message().find("auto, blas, onednn"), std::string::npos) << parsed.status();
  }
}

TEST(GemmPathAvailable, OneDnnExactlyWithMkldnn) {
  EXPECT_TRUE(GemmPathAvailable(GemmPath::kBlas).ok());
  const absl::Status onednn = GemmPathAvailable(GemmPath::kOneDnn);
  if (at::hasMKLDNN()) {
    EXPECT_TRUE(onednn.ok()) << onednn;
  } else {
    EXPECT_EQ(onednn.code(), absl::StatusCode::kFailedPrecondition);
  }
}

TEST(OneDnnLinear, EqualsAtLinear) {
  if (!at::hasMKLDNN()) GTEST_SKIP() << "this LibTorch has no MKL-DNN";
  at::manual_seed(3);
  // BERT-base's intermediate shape (oneDNN's blocked kernels), and a small one.
  for (const auto& [in, out] : std::vector<std::pair<int64_t, int64_t>>{{768, 3072}, {32, 5}}) {
    SCOPED_TRACE(::testing::Message() << in << " -> " << out);
    const at::Tensor x = at::randn({2, 16, in});
    const at::Tensor w = at::randn({out, in}) / std::sqrt(static_cast<double>(in));
    const at::Tensor b = at::randn({out});
    const at::Tensor packed = PackOneDnnWeight(w);
    const at::Tensor got = OneDnnLinear(x, packed, b);
    ASSERT_EQ(got.sizes(), (std::vector<int64_t>{2, 16, out}));
    EXPECT_FALSE(got.is_mkldnn());
    EXPECT_LE((got - at::linear(x, w, b)).abs().max().item<float>(), 1e-4f);
    // Without bias (a row-parallel linear adds it after the sum), and a strided 2-D input (the
    // pooler's first token).
    EXPECT_LE((OneDnnLinear(x, packed, at::Tensor()) - at::matmul(x, w.t())).abs().max().item<float>(), 1e-4f);
    const at::Tensor first = x.select(1, 0);
    ASSERT_FALSE(first.is_contiguous());
    EXPECT_LE((OneDnnLinear(first, packed, b) - at::linear(first, w, b)).abs().max().item<float>(), 1e-4f);
  }
}

TEST(PickGemmPath, ReturnsThePathWithTheLargerFigure) {
  const GemmChoice choice = PickGemmPath(/*rows=*/256, /*in=*/256, /*out=*/1024);
  EXPECT_GT(choice.blas_gflops, 0);
  if (at::hasMKLDNN()) {
    EXPECT_GT(choice.onednn_gflops, 0);
  } else {
    EXPECT_EQ(choice.onednn_gflops, 0);
  }
  const double chosen = choice.path == GemmPath::kOneDnn ? choice.onednn_gflops : choice.blas_gflops;
  EXPECT_EQ(chosen, std::max(choice.blas_gflops, choice.onednn_gflops))
      << "blas " << choice.blas_gflops << ", onednn " << choice.onednn_gflops << ", picked "
      << GemmPathName(choice.path);
}

TEST(PickGemmPath, StopsTimingALargeProductEarly) {
  // BERT-base's intermediate product at batch 8 x seq 128 (~4.8 GFLOP, tens of ms a run): a
  // warm-up and about one run of each path, not three (~0.2 s; loose for loaded CI).
  const auto start = std::chrono::steady_clock::now();
  const GemmChoice choice = PickGemmPath(/*rows=*/1024, /*in=*/768, /*out=*/3072);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_GT(choice.blas_gflops, 0);
  EXPECT_LT(seconds, 5.0);
}

// float32 takes the transposed dense weight where oneDNN's sgemm is at hand; bfloat16 always
// oneDNN's own layout. Both multiply like at::linear (bf16 within its precision).
TEST(OneDnnLinear, WeightFormPerDtype) {
  if (!at::hasMKLDNN()) GTEST_SKIP() << "this LibTorch has no MKL-DNN";
  at::manual_seed(4);
  const at::Tensor x = at::randn({4, 64}), w = at::randn({48, 64}) / 8, b = at::randn({48});
  const at::Tensor packed = PackOneDnnWeight(w);
  EXPECT_EQ(packed.is_mkldnn(), DnnlSgemm() == nullptr);
  if (!packed.is_mkldnn()) {
    EXPECT_EQ(packed.sizes(), (std::vector<int64_t>{64, 48}));
  }
  const at::Tensor wb = w.to(at::kBFloat16), xb = x.to(at::kBFloat16), bb = b.to(at::kBFloat16);
  const at::Tensor packed_bf16 = PackOneDnnWeight(wb);
  EXPECT_TRUE(packed_bf16.is_mkldnn());
  // GemmPathAvailable's bf16 verdict is LibTorch's: the product runs exactly when it says OK.
  const absl::Status bf16 = GemmPathAvailable(GemmPath::kOneDnn, at::kBFloat16);
  if (!bf16.ok()) {
    EXPECT_EQ(bf16.code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THROW(OneDnnLinear(xb, packed_bf16, bb), std::exception);
    GTEST_SKIP() << bf16;
  }
  const at::Tensor got = OneDnnLinear(xb, packed_bf16, bb);
  EXPECT_EQ(got.scalar_type(), at::kBFloat16);
  const at::Tensor want = at::linear(x, w, b);
  EXPECT_LE((got.to(at::kFloat) - want).abs().max().item<float>() / want.abs().max().item<float>(), 2e-2f);
}

// The attention's per-head products: row-major, transposed B, row strides wider than the rows
// (heads read in place from the fused projection), beta 1 onto existing values.
TEST(DnnlSgemm, StridedRowMajorProductsMatchLibTorch) {
  const DnnlSgemmFn sgemm = DnnlSgemm();
  if (sgemm == nullptr) GTEST_SKIP() << "this process has no oneDNN (dnnl_sgemm)";
  const at::Tensor rows = at::randn({5, 24});  // q in columns [0, 4), k in [8, 12): stride 24
  at::Tensor c = at::randn({5, 5});
  const at::Tensor want = c + 0.5 * at::mm(rows.narrow(1, 0, 4), rows.narrow(1, 8, 4).t());
  ASSERT_EQ(sgemm('N', 'T', 5, 5, 4, 0.5f, rows.data_ptr<float>(), 24, rows.data_ptr<float>() + 8, 24, 1.f,
                  c.data_ptr<float>(), 5),
            0);
  EXPECT_LE((c - want).abs().max().item<float>(), 1e-5f);
  // [5, 5] x [5, 4] into columns [4, 8) of a [5, 12] output.
  at::Tensor out = at::zeros({5, 12});
  ASSERT_EQ(sgemm('N', 'N', 5, 4, 5, 1.f, c.data_ptr<float>(), 5, rows.data_ptr<float>() + 16, 24, 0.f,
                  out.data_ptr<float>() + 4, 12),
            0);
  EXPECT_LE((out.narrow(1, 4, 4) - at::mm(c, rows.narrow(1, 16, 4))).abs().max().item<float>(), 1e-5f);
  EXPECT_EQ(out.narrow(1, 0, 4).abs().max().item<float>(), 0);
  EXPECT_EQ(out.narrow(1, 8, 4).abs().max().item<float>(), 0);
}

// Every shape class: whole 8 x 8 tiles, tails of rows and of columns, more than one 64-wide block,
// vectors, and parts written side by side into a wider destination.
TEST(TransposeInto, EqualsTheTransposeForAnyShapeAndStride) {
  for (const auto& [rows, cols] :
       std::vector<std::pair<int64_t, int64_t>>{{8, 8}, {64, 64}, {77, 45}, {1, 130}, {130, 1}, {200, 136}, {3, 5}}) {
    const at::Tensor src = at::randn({rows, cols});
    at::Tensor dst = at::full({cols, rows}, -7.f);
    TransposeInto(src.data_ptr<float>(), rows, cols, dst.data_ptr<float>(), rows);
    EXPECT_TRUE(dst.equal(src.t())) << rows << " x " << cols;
  }
  // Query, key and value [w, in] into one [in, 3w]: part j in columns j*w .. (j+1)*w.
  const int64_t w = 24, in = 40;
  const std::vector<at::Tensor> parts = {at::randn({w, in}), at::randn({w, in}), at::randn({w, in})};
  at::Tensor fused = at::full({in, 3 * w}, -7.f);
  for (int j = 0; j < 3; ++j) {
    TransposeInto(parts[static_cast<size_t>(j)].data_ptr<float>(), w, in, fused.data_ptr<float>() + j * w, 3 * w);
  }
  EXPECT_TRUE(fused.equal(at::cat(parts, 0).t()));
}

TEST(PickGemmPath, DegenerateShapesKeepBlas) {
  const GemmChoice choice = PickGemmPath(0, 768, 3072);
  EXPECT_EQ(choice.path, GemmPath::kBlas);
  EXPECT_EQ(choice.blas_gflops, 0);
}

}  // namespace
}  // namespace bertshard::model
