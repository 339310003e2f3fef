// File: common/model_root.h
// -----------------------------------------------------------------------------
// Where checkpoints may be read from, and how much of their small files is read. A shared
// coordinator or worker reads whatever directory a client names; with a model root
// (`--model_root`) it reads only inside that directory tree. The root is opened once, here
// (O_DIRECTORY), and every checkpoint is then opened beneath that descriptor and read only through
// descriptors (common/checkpoint_dir.h): a path is never checked and then opened again, so nothing
// swapped in between (a rename, a symbolic link) can lead a read out of the root. Symbolic links are
// followed only while they stay inside the root; a regular file must have a link count of 1 (a
// hard link to a file outside the root is that file, wherever the link was made). Refusals name
// the path and the problem, never a file's contents.
//
// Without a root nothing is confined (one user's machine: `shardctl run`, the local demo); the
// limits below and the regular-file rule still hold.
//
// Example:
//   ASSIGN_OR_RETURN(ModelRoot root, ModelRoot::Open("/models", {.max_vocab_bytes = 16 << 20}));
//   ASSIGN_OR_RETURN(auto dir, CheckpointDir::Open(root, "bert-base-uncased"));  // checkpoint_dir.h
//
// Failure model: Open fails with INVALID_ARGUMENT when the root is not an existing directory.
//
// Thread safety: immutable after Open (copies share the root's descriptor); thread-safe.
#ifndef BERTSHARD_COMMON_MODEL_ROOT_H_
#define BERTSHARD_COMMON_MODEL_ROOT_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/file.h"

namespace bertshard::common {

// The most bytes read whole of a checkpoint's small files (servers' flags; common/file.h's
// constants by default). The weights are mapped, not read whole: their headers are bounded by the
// safetensors reader.
struct CheckpointFileLimits {
  // config.json, tokenizer_config.json, the sentence-transformers files, the safetensors index.
  int64_t max_json_bytes = kMaxCheckpointJsonBytes;
  int64_t max_vocab_bytes = kMaxVocabBytes;  // vocab.txt
};

class ModelRoot {
 public:
  ModelRoot() = default;  // unconfined, default limits

  // `root` empty: unconfined. INVALID_ARGUMENT when it is not an existing directory, or a limit is
  // not positive.
  static absl::StatusOr<ModelRoot> Open(const std::string& root, const CheckpointFileLimits& limits = {});

  bool confined() const { return !root_.empty(); }
  const std::string& root() const { return root_; }  // canonical; empty when unconfined
  // The root's descriptor (O_DIRECTORY, opened once by Open); -1 when unconfined.
  int fd() const { return fd_ == nullptr ? -1 : fd_->get(); }
  const CheckpointFileLimits& limits() const { return limits_; }

  // Most entries a checkpoint directory tree may hold (CheckpointDir::Open checks them all).
  static constexpr int kMaxEntries = 4096;

 private:
  ModelRoot(std::string root, std::shared_ptr<const ScopedFd> fd, const CheckpointFileLimits& limits)
      : root_(std::move(root)), fd_(std::move(fd)), limits_(limits) {}
  std::string root_;
  std::shared_ptr<const ScopedFd> fd_;
  CheckpointFileLimits limits_;
};

}  // namespace bertshard::common

#endif  // BERTSHARD_COMMON_MODEL_ROOT_H_
