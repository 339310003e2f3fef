// File: planner/plan_request_resolution.h
// -----------------------------------------------------------------------------
// Internal to //planner:planner. The first half of planning: a PlanRequest checked field by field
// (the BertConfig with HF defaults, the parallel sizes, the pipeline style and chunks, sequence
// parallelism, tensor-parallel divisibility) and normalised into a ResolvedRequest, the one input
// the module policy and the tensor table read. Every refusal of an invalid request is made here,
// so nothing after it can fail on bad input.
//
// Example:
//   ASSIGN_OR_RETURN(const ResolvedRequest r, ResolveRequest(request));
//   // r.tp == 2, r.stages == 2, r.layers_per_slot == {6, 6}
//
// Failure model: INVALID_ARGUMENT naming what is wrong and what would be valid.
// Thread safety: thread-safe (pure functions).
#ifndef BERTSHARD_PLANNER_PLAN_REQUEST_RESOLUTION_H_
#define BERTSHARD_PLANNER_PLAN_REQUEST_RESOLUTION_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "bertshard/v1/plan.pb.h"

namespace bertshard::planner {

// Everything Plan() needs, validated and normalised.
struct ResolvedRequest {
  v1::ModelVariant variant = v1::MODEL_VARIANT_UNSPECIFIED;
  v1::BertConfig config;  // every field set
  int64_t vocab = 0, hidden = 0, layers = 0, heads = 0, intermediate = 0;
  bool tie_weight = false;

  int64_t tp = 1;
  bool tp_on = false;

  bool pipeline = false;  // a stage manager exists
  int64_t stages = 1;
  int64_t chunks = 1;
  v1::PipelineStyle style = v1::PIPELINE_STYLE_UNSPECIFIED;
  bool interleave = false;
  bool zbv = false;
  std::vector<int64_t> layers_per_slot;

  v1::SequenceParallelMode sp = v1::SP_NONE;  // effective: SP_NONE or SPLIT_GATHER
  bool fused_norm = false, jit = false, all_opt = false, fp8 = false;
  int64_t vocab_multiple = 64;  // make_vocab_size_divisible_by
  v1::Dtype dtype = v1::FP32;
  std::vector<std::string> warnings;
};

// Validates `request` (whose checkpoint, if any, has already filled it: ResolveCheckpoint) and
// normalises it.
absl::StatusOr<ResolvedRequest> ResolveRequest(const v1::PlanRequest& request);

// `value` rounded up to a multiple of `multiple` (> 0): the padded vocabulary.
int64_t RoundUp(int64_t value, int64_t multiple);

}  // namespace bertshard::planner

#endif  // BERTSHARD_PLANNER_PLAN_REQUEST_RESOLUTION_H_
