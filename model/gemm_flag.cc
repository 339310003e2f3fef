#include "model/gemm_flag.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace bertshard::model {

absl::StatusOr<std::optional<GemmPath>> ParseGemmFlag(absl::string_view value) {
  if (value == "auto") return std::optional<GemmPath>();
  if (value == "blas") return std::optional<GemmPath>(GemmPath::kBlas);
  if (value == "onednn") return std::optional<GemmPath>(GemmPath::kOneDnn);
  return absl::InvalidArgumentError(absl::StrCat("--gemm '", value, "' is not one of ", kGemmFlagValues));
}

absl::string_view GemmPathName(GemmPath path) {
  switch (path) {
    case GemmPath::kBlas:
      return "blas";
    case GemmPath::kOneDnn:
      return "onednn";
  }
  return "unknown";
}

}  // namespace bertshard::model
