#include "planner/stage_layout.h"

#include <cstddef>

namespace bertshard::planner {

std::vector<int64_t> DistributeLayers(int64_t num_layers, int64_t num_stages, int64_t num_model_chunks) {
  const int64_t slots = num_stages * num_model_chunks;
  const int64_t quotient = num_layers / slots;
  const int64_t remainder = num_layers % slots;
  std::vector<int64_t> layers(static_cast<size_t>(slots), quotient);
  // start + remainder <= slots always holds, so the window never wraps around.
  const int64_t start = slots / 2 - remainder / 2;
  for (int64_t i = start; i < start + remainder; ++i) ++layers[static_cast<size_t>(i)];
  return layers;
}

std::vector<LayerSpan> StageLayerRanges(const std::vector<int64_t>& layers_per_slot, int64_t stage, int64_t num_stages,
                                        int64_t num_model_chunks, bool zbv) {
  std::vector<int64_t> prefix(layers_per_slot.size() + 1, 0);
  for (size_t i = 0; i < layers_per_slot.size(); ++i) prefix[i + 1] = prefix[i] + layers_per_slot[i];
  auto slot_span = [&prefix](int64_t slot) {
    return LayerSpan{prefix[static_cast<size_t>(slot)], prefix[static_cast<size_t>(slot) + 1]};
  };
  if (zbv) {
    // The V: chunk 0 walks the stages forwards, chunk 1 walks them back to stage 0.
    return {slot_span(stage), slot_span(2 * num_stages - 1 - stage)};
  }
  std::vector<LayerSpan> ranges;
  ranges.reserve(static_cast<size_t>(num_model_chunks));
  for (int64_t chunk = 0; chunk < num_model_chunks; ++chunk) {
    ranges.push_back(slot_span(stage + chunk * num_stages));
  }
  return ranges;
}

int64_t SlotStage(int64_t slot, int64_t num_stages, bool zbv) {
  if (zbv) return slot < num_stages ? slot : 2 * num_stages - 1 - slot;
  return slot % num_stages;
}

}  // namespace bertshard::planner
