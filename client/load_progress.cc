#include "client/load_progress.h"

#include <algorithm>

namespace bertshard::client {

int64_t PlanBytes(const v1::ShardPlan& plan) {
  int64_t total = 0;
  for (const v1::RankShard& rank : plan.ranks()) total += rank.param_bytes();
  return total;
}

LoadReading JobLoadProgress::Update(const v1::JobEvent& event) {
  for (const v1::RankProgress& r : event.ranks()) {
    // A rank that starts over (re-placed, or re-adopted after a coordinator restart) reports from
    // 0 again: what it had placed is kept, so the bar waits for it rather than going back.
    const std::pair<int, int> key{r.replica(), r.rank()};
    int64_t& loaded = loaded_[key];
    loaded = std::max(loaded, r.progress().bytes_loaded());
    if (r.progress().bytes_total() > 0) reported_[key] = r.progress().bytes_total();
  }
  LoadReading reading;
  int64_t reported = 0;
  for (const auto& [key, bytes] : loaded_) reading.loaded += bytes;
  for (const auto& [key, bytes] : reported_) reported += bytes;
  // The plan's total, unless the ranks say there is more (never less than what is placed).
  reading.total = std::max({plan_bytes_, reported, reading.loaded});
  const int percent = reading.total > 0 ? static_cast<int>(100 * reading.loaded / reading.total) : 0;
  percent_ = std::max(percent_, percent);
  reading.percent = percent_;
  return reading;
}

}  // namespace bertshard::client
