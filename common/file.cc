#include "common/file.h"

#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"

namespace bertshard::common {

absl::StatusOr<std::string> ReadFileToString(const std::string& path, absl::string_view what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::InvalidArgumentError(absl::StrCat("cannot read ", what, " ", path));
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) return absl::InvalidArgumentError(absl::StrCat("error reading ", what, " ", path));
  return text.str();
}

}  // namespace bertshard::common
