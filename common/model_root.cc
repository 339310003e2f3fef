#include "common/model_root.h"

#include <filesystem>
#include <set>
#include <system_error>
#include <vector>

#include "absl/strings/str_cat.h"

namespace bertshard::common {
namespace fs = std::filesystem;
namespace {

// `path` (canonical) is `root` (canonical) or below it. Compared by components, not characters:
// /models-old is not inside /models.
bool Inside(const fs::path& path, const fs::path& root) {
  auto p = path.begin();
  for (auto r = root.begin(); r != root.end(); ++r, ++p) {
    if (p == path.end() || *p != *r) return false;
  }
  return true;
}

}  // namespace

absl::StatusOr<ModelRoot> ModelRoot::Open(const std::string& root) {
  if (root.empty()) return ModelRoot();
  std::error_code ec;
  const fs::path canonical = fs::canonical(root, ec);
  if (ec || !fs::is_directory(canonical, ec)) {
    return absl::InvalidArgumentError(absl::StrCat("model root ", root, " is not an existing directory"));
  }
  return ModelRoot(canonical.string());
}

absl::StatusOr<std::string> ModelRoot::Resolve(const std::string& path) const {
  if (!confined()) return path;
  if (path.empty()) return absl::InvalidArgumentError("the checkpoint path is empty");
  const fs::path root(root_);
  const fs::path named = fs::path(path).is_absolute() ? fs::path(path) : root / path;
  std::error_code ec;
  const fs::path dir = fs::canonical(named, ec);
  // Outside the root is said before "does not exist": no probing which paths exist elsewhere.
  if (!ec && !Inside(dir, root)) {
    return absl::InvalidArgumentError(absl::StrCat("checkpoint ", path, " is outside the model root"));
  }
  if (ec) {
    return absl::InvalidArgumentError(absl::StrCat("checkpoint ", path, " does not exist under the model root"));
  }
  if (!fs::is_directory(dir, ec)) {
    return absl::InvalidArgumentError(absl::StrCat("checkpoint ", path, " is not a directory"));
  }
  // Everything under it: followed links are checked where they lead; directories are walked
  // (a link to a directory inside the root is fine, and its contents are checked too).
  int entries = 0;
  std::vector<fs::path> pending = {dir};
  std::set<std::string> visited = {dir.string()};
  while (!pending.empty()) {
    const fs::path current = pending.back();
    pending.pop_back();
    for (fs::directory_iterator it(current, ec), end; !ec && it != end; it.increment(ec)) {
      if (++entries > kMaxEntries) {
        return absl::InvalidArgumentError(
            absl::StrCat("checkpoint ", path, " holds more than ", kMaxEntries, " files"));
      }
      const fs::path relative = it->path().lexically_relative(dir);  // "../x/y" under a linked directory
      std::error_code link_ec;
      const fs::path target = fs::canonical(it->path(), link_ec);
      if (link_ec) {
        // A dangling link reads as nothing; refused anyway, since what it names may appear later.
        return absl::InvalidArgumentError(
            absl::StrCat("checkpoint ", path, ": ", relative.string(), " is a symbolic link to nothing"));
      }
      if (!Inside(target, root)) {
        return absl::InvalidArgumentError(absl::StrCat("checkpoint ", path, ": ", relative.string(),
                                                       " is a symbolic link that leads outside the model root"));
      }
      // Subdirectories, linked ones too (what is read through a link must be checked as well),
      // each once: links between directories cannot make the walk loop.
      if (fs::is_directory(target, link_ec) && visited.insert(target.string()).second) pending.push_back(target);
    }
    if (ec) {
      return absl::InvalidArgumentError(absl::StrCat("checkpoint ", path, " cannot be listed: ", ec.message()));
    }
  }
  return dir.string();
}

}  // namespace bertshard::common
