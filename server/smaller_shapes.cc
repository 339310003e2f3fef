#include "server/smaller_shapes.h"

#include <algorithm>
#include <cstdint>
#include <map>
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
    // The planner refuses this one: the next.
    if (std::optional<SmallerShape> shape = SmallerShapeOf(request, plan, t, p)) return shape;
  }
  return std::nullopt;
}

std::optional<SmallerShape> SmallerShapeOf(const v1::PlanRequest& request, const v1::ShardPlan& plan, int64_t tp,
                                           int64_t pp) {
  const int64_t job_tp = std::max(1, plan.shard_config().tensor_parallel_size());
  const int64_t job_pp = std::max(1, plan.shard_config().pp_size());
  if (tp < 1 || pp < 1 || tp > job_tp || job_tp % tp != 0 || pp > job_pp || tp * pp >= job_tp * job_pp) {
    return std::nullopt;
  }
  SmallerShape shape;
  shape.request = request;
  v1::ParallelConfig& parallel = *shape.request.mutable_parallel();
  parallel.set_tp_size(tp);
  parallel.set_pp_size(pp);
  parallel.clear_num_layers_per_stage();  // counts for the job's stages, not these
  if (pp == 1) {
    parallel.clear_pp_style();
    parallel.clear_num_model_chunks();
  }
  if (tp == 1) parallel.clear_sp_mode();
  // Planned from the job's own plan: its class and config (every field set), no file read.
  v1::PlanRequest planning = shape.request;
  planning.clear_checkpoint();
  planning.set_variant(plan.variant());
  *planning.mutable_config() = plan.config();
  planning.set_dtype(plan.dtype());
  absl::StatusOr<v1::ShardPlan> planned = planner::Plan(planning);
  if (!planned.ok()) return std::nullopt;
  shape.plan = *std::move(planned);
  return shape;
}

namespace {

// The bytes of rank `rank`'s table of `plan` by tensor: name, split dim, start and end.
using SliceKey = std::tuple<std::string, int32_t, int64_t, int64_t>;
std::map<SliceKey, int64_t> TableOf(const v1::ShardPlan& plan, int32_t rank) {
  std::map<SliceKey, int64_t> table;
  for (const v1::RankShard& r : plan.ranks()) {
    if (r.rank() != rank) continue;
    for (const v1::TensorShard& t : r.tensors()) table[{t.name(), t.split_dim(), t.start(), t.end()}] = t.bytes();
  }
  return table;
}

}  // namespace

std::vector<int> AssignKeptWorkers(const v1::ShardPlan& held_plan, const std::vector<int32_t>& held_ranks,
                                   const v1::ShardPlan& plan) {
  std::vector<std::map<SliceKey, int64_t>> held;
  for (int32_t r : held_ranks) held.push_back(TableOf(held_plan, r));
  // (bytes shared, rank, kept worker) for every pair that shares any; the most first.
  std::vector<std::tuple<int64_t, int32_t, int>> pairs;
  for (int32_t rank = 0; rank < plan.world_size(); ++rank) {
    const std::map<SliceKey, int64_t> wanted = TableOf(plan, rank);
    for (size_t i = 0; i < held.size(); ++i) {
      int64_t shared = 0;
      for (const auto& [key, bytes] : wanted) shared += held[i].count(key) > 0 ? bytes : 0;
      if (shared > 0) pairs.emplace_back(shared, rank, static_cast<int>(i));
    }
  }
  std::sort(pairs.begin(), pairs.end(), [&](const auto& a, const auto& b) {
    if (std::get<0>(a) != std::get<0>(b)) return std::get<0>(a) > std::get<0>(b);
    if (std::get<1>(a) != std::get<1>(b)) return std::get<1>(a) < std::get<1>(b);
    return held_ranks[static_cast<size_t>(std::get<2>(a))] < held_ranks[static_cast<size_t>(std::get<2>(b))];
  });
  std::vector<int> assigned(static_cast<size_t>(std::max(0, plan.world_size())), -1);
  std::vector<bool> taken(held.size(), false);
  for (const auto& [bytes, rank, i] : pairs) {
    if (assigned[static_cast<size_t>(rank)] >= 0 || taken[static_cast<size_t>(i)]) continue;
    assigned[static_cast<size_t>(rank)] = i;
    taken[static_cast<size_t>(i)] = true;
  }
  // The ranks no kept worker shares anything with take the ones left before any idle worker.
  size_t next = 0;
  for (int& a : assigned) {
    while (next < held.size() && taken[next]) ++next;
    if (a >= 0 || next == held.size()) continue;
    a = static_cast<int>(next);
    taken[next] = true;
  }
  return assigned;
}

}  // namespace bertshard::server
