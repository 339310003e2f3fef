// File: server/serving_test_util.h
// -----------------------------------------------------------------------------
// A small plan and a checkpoint's serving assets built in memory, for the serving unit tests
// (input_preparation_test, output_decoding_test, job_serving_test): no checkpoint on disk.
//
// Example:
//   const v1::ShardPlan plan = SmallPlan(v1::BERT_FOR_MASKED_LM);
//   std::shared_ptr<JobAssets> assets = SmallAssets();  // [MASK] is id 4
//
// Failure model: test-only; a plan the planner refuses is an empty plan (the test then fails).
//
// Thread safety: the functions are; what they return is the caller's.
#ifndef BERTSHARD_SERVER_SERVING_TEST_UTIL_H_
#define BERTSHARD_SERVER_SERVING_TEST_UTIL_H_

#include <memory>
#include <string>
#include <vector>

#include "planner/planner.h"
#include "server/job_assets.h"

namespace bertshard::server {

// The ids of SmallAssets' vocabulary.
constexpr int64_t kPad = 0, kCls = 2, kSep = 3, kMask = 4, kThe = 5, kPlay = 9;

// A 2-layer, 8-wide model of `variant` on one rank, 18 words, 16 positions, `labels` classes.
inline v1::ShardPlan SmallPlan(v1::ModelVariant variant, int labels = 2) {
  v1::PlanRequest request;
  request.set_variant(variant);
  auto* c = request.mutable_config();
  c->set_vocab_size(18);
  c->set_hidden_size(8);
  c->set_num_hidden_layers(2);
  c->set_num_attention_heads(2);
  c->set_intermediate_size(16);
  c->set_max_position_embeddings(16);
  c->set_type_vocab_size(2);
  c->set_num_labels(labels);
  return planner::Plan(request).value_or(v1::ShardPlan());
}

// A tokenizer over 18 word pieces, with [CLS], [SEP], [PAD] and [MASK]; no labels, mean pooling.
inline std::shared_ptr<JobAssets> SmallAssets() {
  auto assets = std::make_shared<JobAssets>();
  std::vector<std::string> vocab = {"[PAD]", "[UNK]", "[CLS]",  "[SEP]", "[MASK]", "the", "a", "##s", "##ing",
                                    "play",  "un",    "##able", "x",     "y",      "!",   ",", "1",   "##2"};
  assets->tokenizer = tokenizer::WordPieceTokenizer::FromVocab(vocab, {}).value();
  assets->cls_id = kCls;
  assets->sep_id = kSep;
  assets->pad_id = kPad;
  assets->mask_id = kMask;
  assets->embedding = serving::EmbeddingConfig();
  assets->labels = absl::NotFoundError("no config.json");
  return assets;
}

}  // namespace bertshard::server

#endif  // BERTSHARD_SERVER_SERVING_TEST_UTIL_H_
