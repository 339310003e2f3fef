// File: planner/planner.h
// -----------------------------------------------------------------------------
// The BERT sharding planner: the behaviour of ColossalAI ShardFormer's BertPolicy family
// (module replacements, held layers, shared params), ShardConfig normalisation and the
// PipelineStageManager layout, plus a per-rank tensor table, with the deliberate differences of
// docs/plan-contract.md. No gRPC here: the coordinator and shardctl are thin layers over Plan().
//
// Example:
//   v1::PlanRequest r;
//   r.set_variant(v1::BERT_FOR_MASKED_LM);
//   r.mutable_parallel()->set_tp_size(2);
//   r.mutable_parallel()->set_pp_size(2);
//   absl::StatusOr<v1::ShardPlan> plan = Plan(r);
//   // plan->layers_per_stage() == {6, 6}; plan->ranks_size() == 4
//
// Thread safety: thread-safe (no shared state).
#ifndef BERTSHARD_PLANNER_PLANNER_H_
#define BERTSHARD_PLANNER_PLANNER_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "bertshard/v1/plan.pb.h"

namespace bertshard::planner {

// Upper bounds that separate a large model from a malformed request.
inline constexpr int64_t kMaxParallelSize = 4096;                // tp_size, pp_size, world size
inline constexpr int64_t kMaxLayers = 4096;                      // num_hidden_layers
inline constexpr int64_t kMaxTensorElements = int64_t{1} << 31;  // one tensor, padded

// Computes the plan of `request`. If the request names a checkpoint, its config.json fills the
// unset config fields and the variant (file I/O). Errors: INVALID_ARGUMENT for any invalid
// request, with what is wrong and what would be valid; nothing is planned halfway.
absl::StatusOr<v1::ShardPlan> Plan(const v1::PlanRequest& request);

// As Plan(), but fills `*plan` (cleared first), so callers can allocate it on a
// google::protobuf::Arena: a plan of BERT-large at tp 4 x pp 4 has ~1600 tensor entries. On error
// `*plan` is left in an unspecified state.
absl::Status PlanInto(const v1::PlanRequest& request, v1::ShardPlan* plan);

// The TP sizes a config admits: the divisors of both num_attention_heads and intermediate_size
// (hidden_size is a multiple of the head count), ascending.
std::vector<int64_t> ValidTpSizes(const v1::BertConfig& config_with_defaults);

}  // namespace bertshard::planner

#endif  // BERTSHARD_PLANNER_PLANNER_H_
