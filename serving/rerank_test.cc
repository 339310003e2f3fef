#include "serving/rerank.h"

#include <cmath>
#include <limits>
#include <vector>

#include "gtest/gtest.h"

namespace bertshard::serving {
namespace {

std::vector<int> Order(const std::vector<RankedText>& ranks) {
  std::vector<int> order;
  for (const RankedText& r : ranks) order.push_back(r.index);
  return order;
}

TEST(RankByScore, SigmoidOfEachLogitBestFirst) {
  const std::vector<float> logits = {-1.0f, 2.5f, 0.0f};
  const std::vector<RankedText> ranks = RankByScore(logits, /*raw_scores=*/false);
  EXPECT_EQ(Order(ranks), (std::vector<int>{1, 2, 0}));
  EXPECT_FLOAT_EQ(ranks[0].score, static_cast<float>(1.0 / (1.0 + std::exp(-2.5))));
  EXPECT_FLOAT_EQ(ranks[1].score, 0.5f);
  EXPECT_FLOAT_EQ(ranks[2].score, static_cast<float>(1.0 / (1.0 + std::exp(1.0))));
}

TEST(RankByScore, RawScoresAreTheLogits) {
  const std::vector<float> logits = {-1.0f, 2.5f, 0.0f};
  const std::vector<RankedText> ranks = RankByScore(logits, /*raw_scores=*/true);
  EXPECT_EQ(Order(ranks), (std::vector<int>{1, 2, 0}));
  EXPECT_FLOAT_EQ(ranks[0].score, 2.5f);
  EXPECT_FLOAT_EQ(ranks[2].score, -1.0f);
}

TEST(RankByScore, TiesKeepRequestOrderAndNanGoesLast) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> logits = {nan, 1.0f, 1.0f, 3.0f, nan, -2.0f};
  EXPECT_EQ(Order(RankByScore(logits, true)), (std::vector<int>{3, 1, 2, 5, 0, 4}));
  EXPECT_TRUE(RankByScore({}, false).empty());
}

}  // namespace
}  // namespace bertshard::serving
