// File: model/gemm_flag.h
// -----------------------------------------------------------------------------
// The matrix-product paths a shard's linears can take, and the --gemm flag that names them. Kept
// apart from model/gemm.h (which times the paths) because shardctl validates the flag and must not
// link LibTorch.
//
// Example:
//   ASSIGN_OR_RETURN(std::optional<GemmPath> gemm, ParseGemmFlag(flag));  // nullopt: "auto"
//
// Thread safety: stateless.
#ifndef BERTSHARD_MODEL_GEMM_FLAG_H_
#define BERTSHARD_MODEL_GEMM_FLAG_H_

#include <optional>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace bertshard::model {

enum class GemmPath {
  kBlas,    // at::linear: the BLAS LibTorch was built against (Debian: OpenBLAS via libblas.so.3)
  kOneDnn,  // at::mkldnn_linear on weights prepacked once at load (MKL-DNN / oneDNN)
};

// The valid --gemm values, for messages and usage text.
inline constexpr absl::string_view kGemmFlagValues = "auto, blas, onednn";

// "auto" -> nullopt (measure at start-up), "blas", "onednn"; INVALID_ARGUMENT naming the valid
// values otherwise.
absl::StatusOr<std::optional<GemmPath>> ParseGemmFlag(absl::string_view value);

// "blas" or "onednn": the flag's spelling, also used in reports.
absl::string_view GemmPathName(GemmPath path);

}  // namespace bertshard::model

#endif  // BERTSHARD_MODEL_GEMM_FLAG_H_
