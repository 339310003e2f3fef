#include "server/smaller_shapes.h"

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "planner/planner.h"

namespace bertshard::server {

std::string ShapeText(const v1::PlanRequest& request) {
  const v1::ParallelConfig& p = request.parallel();
  std::string text =
      absl::StrCat("TP ", std::max<int64_t>(1, p.tp_size()), " x PP ", std::max<int64_t>(1, p.pp_size()));
  if (p.pp_size() > 1) absl::StrAppend(&text, " ", v1::PipelineStyle_Name(p.pp_style()));
  if (p.sp_mode() != v1::SequenceParallelMode{})
    absl::StrAppend(&text, ", SP ", v1::SequenceParallelMode_Name(p.sp_mode()));
  absl::StrAppend(&text, ", ", request.dtype() == v1::Dtype{} ? "FP32" : v1::Dtype_Name(request.dtype()), ", ",
                  request.checkpoint());
  return text;
}

std::optional<SmallerShape> LargestSmallerShape(const v1::PlanRequest& request, const v1::ShardPlan& plan,
                                                int workers) {
  const int64_t tp = std::max(1, plan.shard_config().tensor_parallel_size());
  const int64_t pp = std::max(1, plan.shard_config().pp_size());
  // (same TP?, world, TP, PP), best first.
  std::vector<std::tuple<bool, int64_t, int64_t, int64_t>> candidates;
  for (int64_t t : planner::ValidTpSizes(plan.config())) {
    if (t > tp || tp % t != 0) continue;
    for (int64_t p = std::min<int64_t>(t == tp ? pp - 1 : pp, workers / t); p >= 1; --p) {
      candidates.emplace_back(t == tp, t * p, t, p);
    }
  }
  std::sort(candidates.begin(), candidates.end(), [](const auto& a, const auto& b) {
    return std::make_tuple(std::get<0>(a), std::get<1>(a), std::get<2>(a)) >
           std::make_tuple(std::get<0>(b), std::get<1>(b), std::get<2>(b));
  });
  for (const auto& [same_tp, world, t, p] : candidates) {
    SmallerShape shape;
    shape.request = request;
    v1::ParallelConfig& parallel = *shape.request.mutable_parallel();
    parallel.set_tp_size(t);
    parallel.set_pp_size(p);
    parallel.clear_num_layers_per_stage();  // counts for the job's stages, not these
    if (p == 1) {
      parallel.clear_pp_style();
      parallel.clear_num_model_chunks();
    }
    if (t == 1) parallel.clear_sp_mode();
    // Planned from the job's own plan: its class and config (every field set), no file read.
    v1::PlanRequest planning = shape.request;
    planning.clear_checkpoint();
    planning.set_variant(plan.variant());
    *planning.mutable_config() = plan.config();
    planning.set_dtype(plan.dtype());
    absl::StatusOr<v1::ShardPlan> planned = planner::Plan(planning);
    if (!planned.ok()) continue;  // the planner refuses this one: the next
    shape.plan = *std::move(planned);
    return shape;
  }
  return std::nullopt;
}

}  // namespace bertshard::server
