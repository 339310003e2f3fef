#include "common/model_root.h"

#include <fcntl.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <system_error>

#include "absl/strings/str_cat.h"

namespace bertshard::common {

absl::StatusOr<ModelRoot> ModelRoot::Open(const std::string& root, const CheckpointFileLimits& limits) {
  if (limits.max_json_bytes <= 0 || limits.max_vocab_bytes <= 0) {
    return absl::InvalidArgumentError("the limits on a checkpoint's small files must be positive");
  }
  if (root.empty()) return ModelRoot(std::string(), nullptr, limits);
  std::error_code ec;
  const std::filesystem::path canonical = std::filesystem::canonical(root, ec);
  if (ec) return absl::InvalidArgumentError(absl::StrCat("model root ", root, " is not an existing directory"));
  // Opened once: every checkpoint is walked beneath this descriptor, whatever later happens to the
  // path that named it.
  auto fd = std::make_shared<ScopedFd>(open(canonical.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!fd->valid()) {
    return absl::InvalidArgumentError(
        absl::StrCat("model root ", root, " is not an existing directory: ", std::strerror(errno)));
  }
  return ModelRoot(canonical.string(), std::move(fd), limits);
}

}  // namespace bertshard::common
