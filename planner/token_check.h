// File: planner/token_check.h
// -----------------------------------------------------------------------------
// Checks model inputs against a plan before any rank sees them: the shape the variant needs,
// sequence length, id and token-type ranges, a 0/1 mask, and what sequence parallelism needs.
// `shardctl run` and the coordinator's Infer both call it, so a user gets the same message
// either way.
//
// Example:
//   RETURN_IF_ERROR(CheckInputsAgainstPlan({.rows = 2, .seq = 8, .choices = 1, .input_ids = ids, ...}, plan));
//
// Thread safety: thread-safe (pure function).
#ifndef BERTSHARD_PLANNER_TOKEN_CHECK_H_
#define BERTSHARD_PLANNER_TOKEN_CHECK_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "bertshard/v1/plan.pb.h"
#include "common/token_view.h"

namespace bertshard::planner {

using TokenView = common::TokenView;

// Whether `tokens` are inputs this plan can run; INVALID_ARGUMENT naming the first problem.
absl::Status CheckInputsAgainstPlan(const TokenView& tokens, const v1::ShardPlan& plan);

}  // namespace bertshard::planner

#endif  // BERTSHARD_PLANNER_TOKEN_CHECK_H_
