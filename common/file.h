// File: common/file.h
// -----------------------------------------------------------------------------
// Reading a whole (small) file that a user named: request JSON, inputs, configs, reports.
//
// Example:
//   ASSIGN_OR_RETURN(std::string text, ReadFileToString(path, "request file"));
//
// Thread safety: thread-safe.
#ifndef BERTSHARD_COMMON_FILE_H_
#define BERTSHARD_COMMON_FILE_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace bertshard::common {

// The file's bytes. INVALID_ARGUMENT "cannot read <what> <path>" when it cannot be opened: the
// path was the caller's argument.
absl::StatusOr<std::string> ReadFileToString(const std::string& path, absl::string_view what);

}  // namespace bertshard::common

#endif  // BERTSHARD_COMMON_FILE_H_
