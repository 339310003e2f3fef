// File: common/checkpoint_dir.h
// -----------------------------------------------------------------------------
// One checkpoint directory, opened once and read only through descriptors. Every reader of a
// checkpoint (the planner's config.json, the tokenizer's vocab.txt, the sentence-transformers
// files, the safetensors weights) goes through one of these, so that what was checked is what is
// read: no file is named by path again after the check.
//
// Under a model root (common/model_root.h) the directory is walked beneath the root's descriptor
// one component at a time (openat with O_NOFOLLOW, each step from the descriptor of the one
// before): a symbolic link is read (readlinkat) and followed only while it stays inside the root,
// ".." never climbs above the root, and a file is opened with O_NOFOLLOW|O_NONBLOCK and checked on
// its descriptor (fstat): a regular file, link count 1, within the size cap. Open also checks the
// whole tree once (any entry that links out, symbolically or as a hard link, a dangling link, more
// than ModelRoot::kMaxEntries entries): such a checkpoint is refused before any of it is read.
// The files are checked again when they are opened, since anything may change after Open.
//
// Without a root the directory is opened as named (links followed), and files are opened beneath
// it; the regular-file, size and non-blocking rules hold all the same.
//
// Example:
//   ASSIGN_OR_RETURN(std::shared_ptr<const CheckpointDir> dir, CheckpointDir::Open(root, "bert"));
//   ASSIGN_OR_RETURN(std::string config, dir->ReadSmallFile("config.json", dir->limits().max_json_bytes));
//   ASSIGN_OR_RETURN(MappableFile weights, dir->OpenForMap("model.safetensors"));  // mmap(weights.fd)
//
// Failure model: Open: INVALID_ARGUMENT naming the path and the problem (outside the root, does not
// exist, not a directory, a link leading out). File reads: NOT_FOUND when the file is absent (the
// caller says what it should have been), INVALID_ARGUMENT for anything else that is refused.
// Messages never hold a file's contents.
//
// Thread safety: immutable after Open; every method is thread-safe.
#ifndef BERTSHARD_COMMON_CHECKPOINT_DIR_H_
#define BERTSHARD_COMMON_CHECKPOINT_DIR_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/file.h"
#include "common/model_root.h"

namespace bertshard::common {

// A checkpoint file opened to be mapped: its descriptor and size (from fstat on it).
struct MappableFile {
  ScopedFd fd;
  int64_t size = 0;
  std::string path;  // for messages
};

class CheckpointDir {
 public:
  // A directory on the way from the root to the checkpoint, held open (confined only).
  struct Step {
    std::string name;
    std::shared_ptr<const ScopedFd> fd;
  };

  // The checkpoint directory `path` names: under a root, relative paths are taken under it and
  // absolute ones must lead into it; unconfined, `path` as named (relative to the working
  // directory). Unconfined, a directory that cannot be opened is not refused here: each read says
  // the file cannot be read (NOT_FOUND), as reading by path did.
  static absl::StatusOr<std::shared_ptr<const CheckpointDir>> Open(const ModelRoot& root, const std::string& path);

  // Canonical under a root (no links, no ".."); the path as named without one.
  const std::string& path() const { return path_; }
  bool confined() const { return root_.confined(); }
  const CheckpointFileLimits& limits() const { return root_.limits(); }

  // The bytes of `name` (relative: "config.json", "1_Pooling/config.json"), a regular file of at
  // most `max_bytes`.
  absl::StatusOr<std::string> ReadSmallFile(absl::string_view name, int64_t max_bytes) const;
  // `name` opened for mapping: a regular file (of any size).
  absl::StatusOr<MappableFile> OpenForMap(absl::string_view name) const;

 private:
  CheckpointDir(ModelRoot root, std::vector<Step> steps, std::shared_ptr<const ScopedFd> dir, std::string path,
                int open_errno)
      : root_(std::move(root)),
        steps_(std::move(steps)),
        dir_(std::move(dir)),
        path_(std::move(path)),
        open_errno_(open_errno) {}
  // `name` opened read-only and checked (regular file; link count 1 under a root).
  absl::StatusOr<MappableFile> OpenFile(absl::string_view name) const;

  const ModelRoot root_;
  const std::vector<Step> steps_;              // from the root down to the checkpoint (confined)
  const std::shared_ptr<const ScopedFd> dir_;  // the checkpoint directory itself
  const std::string path_;
  const int open_errno_ = 0;  // unconfined: why the directory could not be opened (then dir_ is empty)
};

}  // namespace bertshard::common

#endif  // BERTSHARD_COMMON_CHECKPOINT_DIR_H_
