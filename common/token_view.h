// File: common/token_view.h
// -----------------------------------------------------------------------------
// A model's integer inputs as spans over the caller's buffers, row-major [rows, seq] with
// rows = batch x choices: what the planner checks against a plan (planner/token_check.h) and what
// the serving layer reads head outputs against (serving/heads.h). No protobuf, no LibTorch.
//
// Thread safety: a view; as safe as the buffers it points at.
#ifndef BERTSHARD_COMMON_TOKEN_VIEW_H_
#define BERTSHARD_COMMON_TOKEN_VIEW_H_

#include <cstdint>

#include "absl/types/span.h"

namespace bertshard::common {

struct TokenView {
  int64_t rows = 0;
  int64_t seq = 0;
  int64_t choices = 1;                       // > 1 only for multiple choice
  absl::Span<const int64_t> input_ids;       // rows * seq
  absl::Span<const int64_t> attention_mask;  // rows * seq 0/1 (serving: or empty, all ones)
  absl::Span<const int64_t> token_type_ids;  // rows * seq (serving: or empty, all zeros)
};

}  // namespace bertshard::common

#endif  // BERTSHARD_COMMON_TOKEN_VIEW_H_
