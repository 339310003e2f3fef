#include "server/job_assets.h"

#include <utility>

namespace bertshard::server {

std::shared_ptr<const JobAssets> LoadJobAssets(const v1::ShardPlan& plan, const common::CheckpointDir& checkpoint) {
  auto assets = std::make_shared<JobAssets>();
  auto options = tokenizer::ReadTokenizerConfig(checkpoint);
  if (!options.ok()) {
    assets->tokenizer_status = options.status();
  } else {
    auto tok = tokenizer::WordPieceTokenizer::FromCheckpoint(checkpoint, *options);
    if (tok.ok()) {
      assets->tokenizer = *std::move(tok);
    } else {
      assets->tokenizer_status = tok.status();
    }
  }
  if (assets->tokenizer != nullptr) {
    auto id = [&](absl::string_view token) { return assets->tokenizer->TokenToId(token).value_or(-1); };
    assets->cls_id = id("[CLS]");
    assets->sep_id = id("[SEP]");
    assets->pad_id = id("[PAD]");
    assets->mask_id = id("[MASK]");
  }
  if (assets->pad_id < 0) assets->pad_id = plan.config().pad_token_id();
  if (plan.variant() == v1::BERT_MODEL) assets->embedding = serving::ReadEmbeddingConfig(checkpoint);
  assets->labels = serving::ReadLabels(checkpoint);
  return assets;
}

std::shared_ptr<const JobAssets> RefusedJobAssets(const absl::Status& why) {
  auto assets = std::make_shared<JobAssets>();
  assets->tokenizer_status = why;
  assets->embedding = why;
  assets->labels = why;
  return assets;
}

}  // namespace bertshard::server
