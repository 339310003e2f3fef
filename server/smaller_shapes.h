// File: server/smaller_shapes.h
// -----------------------------------------------------------------------------
// The smaller shapes a job's replica may run in when it lost workers and no spare is left
// (ClusterOptions::smaller_shapes): the same model, dtype and checkpoint on fewer workers, planned
// from the job's own plan (its config, every field set), so no file is read. Which ones and in what
// order:
//   - the same TP over fewer stages first: every surviving rank of a stage keeps its TP slice, so
//     the tensors it held are in its new table, and only the other stages' layers are new to it;
//   - then smaller TPs (divisors of the job's TP), the largest world first, then the larger TP;
//   - only what the planner accepts (a TP the heads do not divide, an interleaved pipeline with
//     more chunks than layers, ...): the planner says which.
// A single stage drops the pipeline style; TP 1 drops sequence parallelism.
// Also AssignKeptWorkers, which of the workers a replica kept takes which rank of its next plan, and
// ShapeText, how a shape is named in reasons and notes.
//
// Example:
//   // A TP 2 x PP 2 job with 3 workers left: TP 2 x PP 1 (its stage-0 ranks keep their slices).
//   std::optional<SmallerShape> s = LargestSmallerShape(job.request(), plan, /*workers=*/3);
//   // s->request.parallel().tp_size() == 2, s->plan.world_size() == 2
//
// Failure model: pure; no shape fits -> nullopt (a one-worker job has none).
//
// Thread safety: thread-safe (no shared state).
#ifndef BERTSHARD_SERVER_SMALLER_SHAPES_H_
#define BERTSHARD_SERVER_SMALLER_SHAPES_H_

#include <optional>
#include <string>
#include <vector>

#include "bertshard/v1/plan.pb.h"

namespace bertshard::server {

struct SmallerShape {
  v1::PlanRequest request;  // the job's request with its parallel config changed (checkpoint kept)
  v1::ShardPlan plan;
};

// The best smaller shape of the job planned as `plan` from `request` on at most `workers` workers
// (fewer than the plan's world), as above; nullopt when none fits.
std::optional<SmallerShape> LargestSmallerShape(const v1::PlanRequest& request, const v1::ShardPlan& plan, int workers);

// Which kept worker takes each rank of `plan`, so that the tensors the workers hold are used most
// (they keep those the new table has alike: LoadShardRequest.keep_held): kept worker i held rank
// held_ranks[i] of `held_plan`. Greedily, the (rank, worker) pair sharing the most bytes first
// (tensors of the same name and slice; on a tie the lower rank, then the lower held rank); then the
// ranks that share nothing with any worker left take those left, in order; -1 once none is left
// (an idle worker takes it). A worker left over takes no rank.
std::vector<int> AssignKeptWorkers(const v1::ShardPlan& held_plan, const std::vector<int32_t>& held_ranks,
                                   const v1::ShardPlan& plan);

// The smaller shape TP `tp` x PP `pp` of the job, planned as LargestSmallerShape plans each (a
// restarted coordinator takes back a replica in it); nullopt when the planner refuses it or it is
// not smaller than the job's.
std::optional<SmallerShape> SmallerShapeOf(const v1::PlanRequest& request, const v1::ShardPlan& plan, int64_t tp,
                                           int64_t pp);

// "TP 2 x PP 1, FP32, /models/minilm": what a user changes with shardctl update.
std::string ShapeText(const v1::PlanRequest& request);

}  // namespace bertshard::server

#endif  // BERTSHARD_SERVER_SMALLER_SHAPES_H_
