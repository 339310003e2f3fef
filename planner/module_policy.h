// File: planner/module_policy.h
// -----------------------------------------------------------------------------
// Internal to //planner:planner. A plan's module_policy: ColossalAI BertPolicy.module_policy()'s
// dict of ModulePolicyDescriptions (submodule, method and attribute replacements per HF class),
// in the seed's key-creation order, for a resolved request.
//
// Example:
//   BuildModulePolicy(resolved, /*bias_gelu_fused=*/false, &plan);
//   // tp 2: plan.module_policy(0).target_class() == "BertLayer", its query is a Linear1D_Col
//
// Failure model: none (the request is valid once resolved).
// Thread safety: thread-safe (writes only `*plan`).
#ifndef BERTSHARD_PLANNER_MODULE_POLICY_H_
#define BERTSHARD_PLANNER_MODULE_POLICY_H_

#include "bertshard/v1/plan.pb.h"
#include "planner/plan_request_resolution.h"

namespace bertshard::planner {

// Appends the module policy of `r` to `plan->module_policy()` (empty on entry).
// `bias_gelu_fused`: the plan's enable_bias_gelu_fused (JIT fused and an exact gelu).
void BuildModulePolicy(const ResolvedRequest& r, bool bias_gelu_fused, v1::ShardPlan* plan);

}  // namespace bertshard::planner

#endif  // BERTSHARD_PLANNER_MODULE_POLICY_H_
