// File: planner/token_check.h
// -----------------------------------------------------------------------------
// Checks model inputs against a plan before any rank sees them: the shape the variant needs,
// sequence length, id and token-type ranges, a 0/1 mask, and what sequence parallelism needs.
// `shardctl run` and the coordinator's Infer both call it, so a user gets the same message
// either way.
//
// Example:
//   RETURN_IF_ERROR(CheckTokens({.rows = 2, .seq = 8, .choices = 1, .input_ids = ids, ...}, plan));
//
// Thread safety: thread-safe (pure function).
#ifndef BERTSHARD_PLANNER_TOKEN_CHECK_H_
#define BERTSHARD_PLANNER_TOKEN_CHECK_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "bertshard/v1/plan.pb.h"

namespace bertshard::planner {

// Row-major [rows, seq] values; rows = batch x choices.
struct TokenView {
  int64_t rows = 0;
  int64_t seq = 0;
  int64_t choices = 1;
  absl::Span<const int64_t> input_ids;
  absl::Span<const int64_t> attention_mask;
  absl::Span<const int64_t> token_type_ids;
};

// INVALID_ARGUMENT naming the first problem.
absl::Status CheckTokens(const TokenView& tokens, const v1::ShardPlan& plan);

}  // namespace bertshard::planner

#endif  // BERTSHARD_PLANNER_TOKEN_CHECK_H_
