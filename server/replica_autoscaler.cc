#include "server/replica_autoscaler.h"

#include <algorithm>

namespace bertshard::server {

double ReplicaAutoscaler::Utilisation(absl::Duration window) const {
  if (samples_.empty()) return 0;
  const absl::Time from = samples_.back().end - window;
  absl::Duration busy, capacity;
  for (const Sample& s : samples_) {
    if (s.end - s.span < from) continue;
    busy += s.busy;
    capacity += s.span * s.serving;
  }
  return capacity > absl::ZeroDuration() ? absl::FDivDuration(busy, capacity) : 0;
}

bool ReplicaAutoscaler::Covers(absl::Time now, absl::Duration window) const {
  return !samples_.empty() && samples_.front().end - samples_.front().span <= now - window;
}

int ReplicaAutoscaler::Observe(absl::Time now, absl::Duration busy, int serving, int current, int min, int max) {
  if (last_ == absl::InfinitePast() || now <= last_) {
    last_ = std::max(last_, now);
    return std::clamp(current, min, max);
  }
  // Replicas still loading (or placed again after a loss) serve nothing yet: no decision until
  // every wanted one serves, and what the others did meanwhile is not the load the full set will
  // see (one replica doing two's work reads busy: kept, it would call for a third at once).
  if (serving < current) {
    Reset();
    last_ = now;
    return current;
  }
  samples_.push_back({now, now - last_, busy, serving});
  last_ = now;
  const absl::Duration keep = std::max(policy_.up_after, policy_.down_after);
  while (!samples_.empty() && samples_.front().end <= now - keep) samples_.pop_front();
  if (current < max && Covers(now, policy_.up_after) && Utilisation(policy_.up_after) > policy_.target) {
    Reset();
    return current + 1;
  }
  if (current > min && current > 1 && Covers(now, policy_.down_after) &&
      Utilisation(policy_.down_after) * current / (current - 1) < policy_.target) {
    Reset();
    return current - 1;
  }
  return std::clamp(current, min, max);
}

}  // namespace bertshard::server
