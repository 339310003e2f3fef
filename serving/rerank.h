// File: serving/rerank.h
// -----------------------------------------------------------------------------
// Re-ranking with a cross-encoder: a sequence classifier with one label (sentence-transformers'
// CrossEncoder, TEI's re-ranker) gives one logit per (query, text) pair, and the texts are ranked
// by it, best first, scored as TEI's /rerank scores them: the sigmoid, or the logit with
// raw_scores (what CrossEncoder.predict gives for checkpoints whose activation is Identity, such
// as the cross-encoder/ms-marco-* family; the order is the same either way). The one place both the gRPC Rerank
// (server/job_serving.h) and HTTP's /rerank (http/tei_routes.cc) turn logits into ranks, so the two always agree. Plain
// C++ on floats.
//
// Example:
//   const std::vector<RankedText> ranks = RankByScore(logits, /*raw_scores=*/false);
//   for (const RankedText& r : ranks) printf("%d %f\n", r.index, r.score);
//
// Failure model: none (any finite or non-finite logits are ranked; NaN sorts last).
// Thread safety: thread-safe (no state).
#ifndef BERTSHARD_SERVING_RERANK_H_
#define BERTSHARD_SERVING_RERANK_H_

#include <vector>

#include "absl/types/span.h"

namespace bertshard::serving {

struct RankedText {
  int index = 0;  // the text's place in the request
  float score = 0;
};

// The texts ranked by score, highest first, ties in request order. The score is the logit's
// sigmoid (TEI's and CrossEncoder's default for one label), or the logit itself with `raw_scores`.
std::vector<RankedText> RankByScore(absl::Span<const float> logits, bool raw_scores);

}  // namespace bertshard::serving

#endif  // BERTSHARD_SERVING_RERANK_H_
