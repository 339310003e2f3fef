#include "server/job_names.h"

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace bertshard::server {

absl::Status CheckJobName(const std::string& name) {
  const auto invalid = [](const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat("job name ", why, ": a name is 1..", kMaxJobNameLength,
                                                   " of letters, digits and ._-/: starting with a letter or digit, "
                                                   "and not job-... (what ids look like)"));
  };
  if (name.empty() || name.size() > static_cast<size_t>(kMaxJobNameLength)) {
    return invalid(absl::StrCat("of ", name.size(), " characters"));
  }
  if (!absl::ascii_isalnum(static_cast<unsigned char>(name[0]))) return invalid("starts with a separator");
  for (const char c : name) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '_' && c != '-' && c != '/' &&
        c != ':') {
      return invalid("has a character other than letters, digits and ._-/:");
    }
  }
  if (absl::StartsWithIgnoreCase(name, "job-")) return invalid(absl::StrCat("'", name, "' reads as a job id"));
  return absl::OkStatus();
}

}  // namespace bertshard::server
