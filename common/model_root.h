// File: common/model_root.h
// -----------------------------------------------------------------------------
// Where checkpoints may be read from. A shared coordinator or worker reads whatever directory a
// client names; with a model root (`--model_root`) it reads only inside that directory tree. A path
// is resolved with every symbolic link followed, and the checkpoint directory must lie inside the
// root -- and so must everything under it: a config.json (or a shard, a vocab.txt, a 1_Pooling/
// config.json) that is a symbolic link leading out of the root refuses the whole checkpoint, before
// any of it is read. Refusals name the path and the problem, never a file's contents.
//
// Without a root nothing is confined (one user's machine: `shardctl run`, the local demo).
//
// Thread safety: immutable after Open; Resolve is thread-safe.
#ifndef BERTSHARD_COMMON_MODEL_ROOT_H_
#define BERTSHARD_COMMON_MODEL_ROOT_H_

#include <string>

#include "absl/status/statusor.h"

namespace bertshard::common {

class ModelRoot {
 public:
  ModelRoot() = default;  // unconfined

  // `root` empty: unconfined. INVALID_ARGUMENT when it is not an existing directory.
  static absl::StatusOr<ModelRoot> Open(const std::string& root);

  bool confined() const { return !root_.empty(); }
  const std::string& root() const { return root_; }  // canonical; empty when unconfined

  // The canonical path of the checkpoint directory `path` names: relative paths are taken under the
  // root (without one, under the working directory). Unconfined, `path` itself, unchanged.
  // INVALID_ARGUMENT when it does not exist, is not a directory, or it or anything under it
  // resolves outside the root, or it holds more than a checkpoint's share of files (kMaxEntries).
  absl::StatusOr<std::string> Resolve(const std::string& path) const;

  static constexpr int kMaxEntries = 4096;

 private:
  explicit ModelRoot(std::string root) : root_(std::move(root)) {}
  std::string root_;
};

}  // namespace bertshard::common

#endif  // BERTSHARD_COMMON_MODEL_ROOT_H_
