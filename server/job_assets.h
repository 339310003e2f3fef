// File: server/job_assets.h
// -----------------------------------------------------------------------------
// What serving a job needs from its checkpoint besides the weights: the WordPiece tokenizer and
// the ids it adds, the sentence-transformers pooling configuration (BertModel jobs) and the
// classification labels. Read once, when the job is submitted (or taken back after a restart),
// through the checkpoint directory's descriptors (common/checkpoint_dir.h): the files that were
// checked are the ones served, whatever becomes of their names later, and no request ever waits
// on a file read (server/job_serving.h holds the assets without a lock).
//
// Example:
//   ASSIGN_OR_RETURN(auto dir, common::CheckpointDir::Open(model_root, "bert-base-uncased"));
//   std::shared_ptr<const JobAssets> assets = LoadJobAssets(plan, *dir);
//   if (assets->tokenizer == nullptr) return assets->tokenizer_status;
//
// Failure model: loading never fails as a whole; each missing or malformed piece keeps its error,
// which only the requests that need that piece see.
//
// Thread safety: the assets are immutable once loaded; the functions are thread-safe.
#ifndef BERTSHARD_SERVER_JOB_ASSETS_H_
#define BERTSHARD_SERVER_JOB_ASSETS_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "bertshard/v1/plan.pb.h"
#include "common/checkpoint_dir.h"
#include "serving/heads.h"
#include "serving/pooling.h"
#include "tokenizer/wordpiece.h"

namespace bertshard::server {

// Missing pieces are errors only for the requests that need them.
struct JobAssets {
  // The checkpoint's WordPiece tokenizer (vocab.txt, tokenizer_config.json); null when it could
  // not be built, and then `tokenizer_status` says why.
  std::unique_ptr<tokenizer::WordPieceTokenizer> tokenizer;
  absl::Status tokenizer_status;
  // Ids the tokenizer adds ([CLS], [SEP], [PAD]) and [MASK]; -1 when the vocabulary lacks them.
  int64_t cls_id = -1, sep_id = -1, pad_id = -1, mask_id = -1;
  // The sentence-transformers configuration (BertModel jobs): pooling, normalisation, maximum
  // length.
  absl::StatusOr<serving::EmbeddingConfig> embedding = absl::UnknownError("not read");
  // config.json's labels (classification heads).
  absl::StatusOr<serving::Labels> labels = absl::UnknownError("not read");
};

// Reads what it can; never fails as a whole (see JobAssets).
std::shared_ptr<const JobAssets> LoadJobAssets(const v1::ShardPlan& plan, const common::CheckpointDir& checkpoint);
// Assets of a checkpoint that cannot be read (`why`: refused by the model root, gone after a
// restart): each part says why.
std::shared_ptr<const JobAssets> RefusedJobAssets(const absl::Status& why);

}  // namespace bertshard::server

#endif  // BERTSHARD_SERVER_JOB_ASSETS_H_
