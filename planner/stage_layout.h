// File: planner/stage_layout.h
// -----------------------------------------------------------------------------
// Pipeline layer layout, exactly as ColossalAI's PipelineStageManager computes it
// (colossalai/pipeline/stage_manager.py: distribute_layers, get_stage_index). Pure functions on
// small integers; callers validate sizes first.
//
// A pipeline has S stages and C model chunks per stage, so S*C "slots". Slot counts come from
// DistributeLayers (or the user); a stage's chunk c runs slot s + c*S (interleaved) or, for the
// zero-bubble V schedule, slot s (chunk 0) and slot 2S-1-s (chunk 1).
//
// Example:
//   DistributeLayers(12, 5, 1) == {2, 3, 3, 2, 2}
//   StageLayerRanges({2,2,2,3,2,2}, /*stage=*/0, /*num_stages=*/3, /*chunks=*/2, /*zbv=*/true)
//       == {{0, 2}, {11, 13}}
//
// Thread safety: thread-safe (pure functions).
#ifndef BERTSHARD_PLANNER_STAGE_LAYOUT_H_
#define BERTSHARD_PLANNER_STAGE_LAYOUT_H_

#include <cstdint>
#include <vector>

namespace bertshard::planner {

struct LayerSpan {
  int64_t start = 0;  // half-open [start, end) into encoder.layer
  int64_t end = 0;
  bool operator==(const LayerSpan& o) const { return start == o.start && end == o.end; }
};

// Splits `num_layers` over `num_stages * num_model_chunks` slots: each slot gets the quotient and
// the remainder goes, one each, to a window of slots centred in the middle, starting at slot
// P/2 - r/2 (floor divisions). Requires num_stages >= 1 and num_model_chunks >= 1.
std::vector<int64_t> DistributeLayers(int64_t num_layers, int64_t num_stages, int64_t num_model_chunks);

// The layer ranges of `stage`, one per model chunk in chunk order. Requires
// layers_per_slot.size() == num_stages * num_model_chunks and, with zbv, num_model_chunks == 2.
std::vector<LayerSpan> StageLayerRanges(const std::vector<int64_t>& layers_per_slot, int64_t stage, int64_t num_stages,
                                        int64_t num_model_chunks, bool zbv);

// The stage that runs pipeline slot `slot` on the route: slot k goes to stage k mod S
// (interleaved chunks come round again), or for the zero-bubble V down the stages and back up.
int64_t SlotStage(int64_t slot, int64_t num_stages, bool zbv);

}  // namespace bertshard::planner

#endif  // BERTSHARD_PLANNER_STAGE_LAYOUT_H_
