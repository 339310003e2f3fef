#include "serving/rerank.h"

#include <algorithm>
#include <cmath>

namespace bertshard::serving {

std::vector<RankedText> RankByScore(absl::Span<const float> logits, bool raw_scores) {
  std::vector<RankedText> ranks;
  ranks.reserve(logits.size());
  for (size_t i = 0; i < logits.size(); ++i) {
    const float logit = logits[i];
    // In double, as transformers' sigmoid on float32 rounds once at the end.
    const float score = raw_scores ? logit : static_cast<float>(1.0 / (1.0 + std::exp(-static_cast<double>(logit))));
    ranks.push_back({static_cast<int>(i), score});
  }
  // NaN last: a comparison with NaN is false both ways, which would break the sort's ordering.
  std::stable_sort(ranks.begin(), ranks.end(), [](const RankedText& a, const RankedText& b) {
    if (std::isnan(a.score) || std::isnan(b.score)) return !std::isnan(a.score) && std::isnan(b.score);
    return a.score > b.score;
  });
  return ranks;
}

}  // namespace bertshard::serving
