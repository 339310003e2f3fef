// File: common/file.h
// -----------------------------------------------------------------------------
// Reading a whole (small) file: one a user named on the command line (request JSON, inputs,
// configs, reports: any readable file, pipes included), or one of a checkpoint's small files, which
// must be a regular file of bounded size, so that a FIFO cannot park a server thread and /dev/zero
// or a sparse gigabyte cannot fill its memory. Servers read checkpoints through
// common/checkpoint_dir.h (descriptors opened beneath the model root), which reads with
// ReadOpenRegularFile; ReadCheckpointFile is the same rule for a file named by path (tools).
//
// Example:
//   ASSIGN_OR_RETURN(std::string text, ReadFileToString(path, "request file"));
//   ASSIGN_OR_RETURN(std::string config, ReadCheckpointFile(dir + "/config.json", kMaxCheckpointJsonBytes));
//
// Failure model: errors are statuses naming the path; nothing is read past the cap.
//
// Thread safety: thread-safe. A ScopedFd is thread-compatible (one owner).
#ifndef BERTSHARD_COMMON_FILE_H_
#define BERTSHARD_COMMON_FILE_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace bertshard::common {

// The file's bytes. INVALID_ARGUMENT "cannot read <what> <path>" when it cannot be opened: the
// path was the caller's argument.
absl::StatusOr<std::string> ReadFileToString(const std::string& path, absl::string_view what);

// The most bytes read of a checkpoint's JSON files (config.json, tokenizer_config.json): HF's are
// a few KiB.
inline constexpr int64_t kMaxCheckpointJsonBytes = int64_t{4} << 20;
// The most bytes read of a vocab.txt: bert-base's is 226 KiB, multilingual BERT's under 1 MiB.
inline constexpr int64_t kMaxVocabBytes = int64_t{64} << 20;

// A checkpoint file's bytes, read only when it is a regular file of at most `max_bytes`: opened
// without blocking (a FIFO is refused, not waited on) and without reading past the cap. NOT_FOUND
// when it cannot be opened (callers say what it should have been); INVALID_ARGUMENT for anything
// but a regular file, and for a larger one (both sizes said).
absl::StatusOr<std::string> ReadCheckpointFile(const std::string& path, int64_t max_bytes);

// A file descriptor that is closed when it goes. Move-only; -1 holds nothing.
class ScopedFd {
 public:
  ScopedFd() = default;
  explicit ScopedFd(int fd) : fd_(fd) {}
  ~ScopedFd();
  ScopedFd(ScopedFd&& other) noexcept : fd_(other.release()) {}
  ScopedFd& operator=(ScopedFd&& other) noexcept;
  ScopedFd(const ScopedFd&) = delete;
  ScopedFd& operator=(const ScopedFd&) = delete;

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release() {
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }

 private:
  int fd_ = -1;
};

// The bytes of the open file `fd` (`path` names it in errors), read as ReadCheckpointFile reads
// them: INVALID_ARGUMENT for anything but a regular file and for one over `max_bytes`; never read
// past the size fstat says (a file growing meanwhile is read as it was).
absl::StatusOr<std::string> ReadOpenRegularFile(int fd, const std::string& path, int64_t max_bytes);

}  // namespace bertshard::common

#endif  // BERTSHARD_COMMON_FILE_H_
