#include "server/group_restarts.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace bertshard::server {

absl::Duration GroupRestarts::Backoff(const RestartPolicy& policy, int k) {
  if (k <= 1) return absl::ZeroDuration();
  absl::Duration wait = policy.backoff_initial;
  for (int i = 2; i < k && wait < policy.backoff_max; ++i) wait *= 2;  // bounded: no overflow
  return std::min(wait, policy.backoff_max);
}

GroupRestarts::Decision GroupRestarts::Lost(const std::string& cause, absl::Time now) {
  if (served_since_.has_value() && now - *served_since_ >= policy_.reset_after) {
    causes_.clear();
    losses_ = 0;
  }
  served_since_.reset();
  causes_.push_back(cause);
  ++losses_;
  // Bounded: a --max_restarts of thousands must not grow the coordinator nor the failure cause.
  if (causes_.size() > kCausesKept) causes_.erase(causes_.begin());
  Decision decision;
  decision.restart = restarts();
  if (decision.restart > policy_.max_restarts) {
    decision.give_up = true;
    const int first = losses_ - static_cast<int>(causes_.size());  // losses no longer named
    std::string all;
    if (first > 0) absl::StrAppend(&all, "the first ", first, " not kept; ");
    for (size_t i = 0; i < causes_.size(); ++i) {
      absl::StrAppend(&all, i == 0 ? "" : "; ", first + static_cast<int>(i) + 1, ") ", causes_[i]);
    }
    decision.cause = absl::StrCat("lost its workers ", losses_,
                                  " times in a row (--max_restarts=", policy_.max_restarts, "): ", all);
    recovering_ = false;
    return decision;
  }
  recovering_ = true;
  not_before_ = now + Backoff(policy_, decision.restart);
  decision.not_before = not_before_;
  return decision;
}

void GroupRestarts::Served(absl::Time now) {
  served_since_ = now;
  recovering_ = false;
}

void GroupRestarts::KeepTrying(absl::Time now) {
  recovering_ = true;
  not_before_ = now + policy_.backoff_max;
}

std::string GroupRestarts::Describe() const {
  if (!recovering_) return "";
  if (restarts() > policy_.max_restarts) {
    return absl::StrCat("lost ", last_cause(), " (restart ", restarts(), ", past --max_restarts=", policy_.max_restarts,
                        "; again every ", absl::FormatDuration(policy_.backoff_max), " while other replicas serve)");
  }
  return absl::StrCat("lost ", last_cause(), " (restart ", restarts(), " of at most ", policy_.max_restarts, ")");
}

}  // namespace bertshard::server
