// File: checkpoint/checkpoint.h
// -----------------------------------------------------------------------------
// A HuggingFace model directory: config.json plus either model.safetensors or a sharded
// model.safetensors.index.json ({"weight_map": {tensor: file}}) with its shard files. Finds
// tensors by state-dict name across shards and reads slices of them (see safetensors.h).
//
// Example:
//   ASSIGN_OR_RETURN(auto ckpt, Checkpoint::Open("/models/bert-base-uncased"));
//   ASSIGN_OR_RETURN(auto ckpt, Checkpoint::Open(*dir));  // a CheckpointDir (common/checkpoint_dir.h)
//   ASSIGN_OR_RETURN(auto where, ckpt->Find("bert.pooler.dense.weight", {}));
//
// Thread safety: thread-compatible after Open.
#ifndef BERTSHARD_CHECKPOINT_CHECKPOINT_H_
#define BERTSHARD_CHECKPOINT_CHECKPOINT_H_

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "checkpoint/safetensors.h"
#include "common/checkpoint_dir.h"

namespace bertshard::checkpoint {

struct TensorLocation {
  const SafetensorsFile* file = nullptr;
  const TensorInfo* info = nullptr;
};

class Checkpoint {
 public:
  // Opens the weights of `directory` (config.json is read by the planner). When both
  // model.safetensors and model.safetensors.index.json exist, model.safetensors is read and the
  // index ignored, as transformers' from_pretrained does. NOT_FOUND when neither exists, or when
  // the index names shard files that do not (the message lists them); INVALID_ARGUMENT for a
  // malformed index (no weight_map object, an empty one, a shard name that is not a bare file
  // name) or shard, or a tensor stored in two shards.
  static absl::StatusOr<std::unique_ptr<Checkpoint>> Open(const std::string& directory);
  // As above, from a directory opened (and, under a model root, confined) beforehand: every file
  // is opened through it and mapped from its descriptor (common/checkpoint_dir.h), so a name
  // swapped for a link after the check is never followed. INVALID_ARGUMENT as the directory's
  // reads refuse (a link leading out, a hard link under a root, anything but a regular file).
  static absl::StatusOr<std::unique_ptr<Checkpoint>> Open(const common::CheckpointDir& dir);

  // The tensor stored under `name`, or else under the first of `aliases` that is stored (HF
  // stores tied tensors once), or else under the legacy LayerNorm names (gamma, beta) of these.
  // NOT_FOUND names the tensor and the aliases tried.
  absl::StatusOr<TensorLocation> Find(const std::string& name, const std::vector<std::string>& aliases) const;

  // Bytes copied out of all shard files so far.
  uint64_t bytes_read() const;

 private:
  std::string directory_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, const SafetensorsFile*> index_;  // tensor name -> file holding it
};

}  // namespace bertshard::checkpoint

#endif  // BERTSHARD_CHECKPOINT_CHECKPOINT_H_
