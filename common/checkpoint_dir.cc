#include "common/checkpoint_dir.h"

#include <dirent.h>
#include <fcntl.h>
#include <limits.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <deque>
#include <optional>
#include <set>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/status_macros.h"

namespace bertshard::common {
namespace {

using Step = CheckpointDir::Step;

// Links followed (and retries after a component changed under the walk) in one walk; the
// kernel's own bound on a path's links.
constexpr int kMaxLinks = 40;

enum class Want { kDirectory, kFile, kAny };

// Where a walk ended: the directories down to it (and including it, for a directory), and for a
// file its descriptor; `st` describes what it reached.
struct Walked {
  std::vector<Step> steps;
  ScopedFd file;
  struct stat st {};
};

int CurrentFd(const ModelRoot& root, const std::vector<Step>& steps) {
  return steps.empty() ? root.fd() : steps.back().fd->get();
}

void PushFront(std::deque<std::string>* pending, absl::string_view path) {
  std::vector<std::string> parts = absl::StrSplit(path, '/', absl::SkipEmpty());
  pending->insert(pending->begin(), parts.begin(), parts.end());
}

// `absolute` with the root's path taken off ("" for the root itself); nullopt when it does not
// lie under the root (compared by components: /models-old is not under /models).
std::optional<std::string> UnderRoot(const std::string& root, absl::string_view absolute) {
  if (root == "/") return std::string(absolute.substr(1));
  if (!absl::StartsWith(absolute, root)) return std::nullopt;
  absl::string_view rest = absolute.substr(root.size());
  if (!rest.empty() && rest.front() != '/') return std::nullopt;
  return std::string(rest);
}

absl::Status System(const std::string& shown, int err) {
  return absl::InvalidArgumentError(absl::StrCat(shown, " cannot be opened: ", std::strerror(err)));
}

absl::Status CheckLinkCount(const struct stat& st, const std::string& shown) {
  if (st.st_nlink == 1) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(shown, " has ", st.st_nlink,
                   " hard links; under a model root a checkpoint's files must have one (a hard link to a file outside "
                   "the root is that file)"));
}

// `relative` walked beneath the root from `steps`, one component at a time, every step opened
// with O_NOFOLLOW from the descriptor of the one before; links read and followed while they stay
// inside the root. `shown` names what is walked in errors.
absl::StatusOr<Walked> Walk(const ModelRoot& root, std::vector<Step> steps, absl::string_view relative, Want want,
                            const std::string& shown) {
  std::deque<std::string> pending;
  PushFront(&pending, relative);
  int links = 0;    // followed
  int retries = 0;  // components that changed between fstatat and openat
  const auto outside = [&] {
    return absl::InvalidArgumentError(absl::StrCat(
        shown, links > 0 ? " is a symbolic link that leads outside the model root" : " is outside the model root"));
  };
  const auto again = [&](const std::string& c, std::deque<std::string>* pending) -> absl::Status {
    if (++retries > kMaxLinks) return absl::InvalidArgumentError(absl::StrCat(shown, " keeps changing"));
    pending->push_front(c);
    return absl::OkStatus();
  };
  Walked walked;
  bool stopped_at_non_directory = false;
  while (!pending.empty()) {
    const std::string c = std::move(pending.front());
    pending.pop_front();
    if (c == ".") continue;
    if (c == "..") {
      if (steps.empty()) return outside();
      steps.pop_back();
      continue;
    }
    const int at = CurrentFd(root, steps);
    const bool last = pending.empty();
    struct stat st {};
    if (fstatat(at, c.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
      if (errno != ENOENT) return System(shown, errno);
      return absl::NotFoundError(
          absl::StrCat(shown, links > 0 ? " is a symbolic link to nothing" : " does not exist under the model root"));
    }
    if (S_ISLNK(st.st_mode)) {
      if (++links > kMaxLinks) {
        return absl::InvalidArgumentError(absl::StrCat(shown, " has too many levels of symbolic links"));
      }
      char target[PATH_MAX];
      const ssize_t n = readlinkat(at, c.c_str(), target, sizeof(target) - 1);
      if (n < 0 && errno == EINVAL) {  // no longer a link: look again
        RETURN_IF_ERROR(again(c, &pending));
        continue;
      }
      if (n <= 0) return System(shown, n < 0 ? errno : ENOENT);
      if (static_cast<size_t>(n) >= sizeof(target) - 1) return System(shown, ENAMETOOLONG);  // maybe cut short
      const absl::string_view to(target, static_cast<size_t>(n));
      if (to.front() == '/') {
        std::optional<std::string> rest = UnderRoot(root.root(), to);
        if (!rest.has_value()) return outside();
        steps.clear();
        PushFront(&pending, *rest);
      } else {
        PushFront(&pending, to);
      }
      continue;
    }
    if (!last || want == Want::kDirectory || (want == Want::kAny && S_ISDIR(st.st_mode))) {
      if (!S_ISDIR(st.st_mode)) return absl::InvalidArgumentError(absl::StrCat(shown, " is not a directory"));
      ScopedFd fd(openat(at, c.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
      if (!fd.valid()) {
        if (errno != ELOOP && errno != ENOTDIR && errno != ENOENT) return System(shown, errno);
        RETURN_IF_ERROR(again(c, &pending));  // replaced since fstatat
        continue;
      }
      steps.push_back({c, std::make_shared<const ScopedFd>(std::move(fd))});
      continue;
    }
    if (want == Want::kAny) {
      walked.st = st;
      stopped_at_non_directory = true;
      break;
    }
    if (S_ISDIR(st.st_mode)) return absl::InvalidArgumentError(absl::StrCat(shown, " is a directory, not a file"));
    if (!S_ISREG(st.st_mode)) {
      return absl::InvalidArgumentError(
          absl::StrCat(shown, " is not a regular file (a FIFO, device or socket); a checkpoint's files must be"));
    }
    // O_NONBLOCK: should it have become a FIFO since fstatat, the open does not wait for a writer.
    ScopedFd fd(openat(at, c.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY | O_CLOEXEC));
    if (!fd.valid()) {
      if (errno != ELOOP && errno != ENOENT) return System(shown, errno);
      RETURN_IF_ERROR(again(c, &pending));  // became a link (or went) since fstatat
      continue;
    }
    if (fstat(fd.get(), &walked.st) != 0) return System(shown, errno);
    if (!S_ISREG(walked.st.st_mode)) {
      return absl::InvalidArgumentError(
          absl::StrCat(shown, " is not a regular file (a FIFO, device or socket); a checkpoint's files must be"));
    }
    RETURN_IF_ERROR(CheckLinkCount(walked.st, shown));
    walked.file = std::move(fd);
  }
  if (want == Want::kFile && !walked.file.valid()) {
    return absl::InvalidArgumentError(absl::StrCat(shown, " is a directory, not a file"));
  }
  if (!walked.file.valid() && !stopped_at_non_directory && fstat(CurrentFd(root, steps), &walked.st) != 0) {
    return System(shown, errno);
  }
  walked.steps = std::move(steps);
  return walked;
}

std::string PathOf(const ModelRoot& root, const std::vector<Step>& steps) {
  std::string path = root.root();
  for (const Step& step : steps) absl::StrAppend(&path, path.back() == '/' ? "" : "/", step.name);
  return path;
}

// Everything under the checkpoint `steps` ends in, once: entries that link out of the root
// (symbolic or hard links), dangling links, more than kMaxEntries entries. Links to directories
// inside the root are followed and their contents checked too, each directory once.
absl::Status CheckTree(const ModelRoot& root, const std::vector<Step>& top, const std::string& path) {
  // A directory still to list: named from its parent's steps, and opened only when listed, so that
  // a wide tree holds a few descriptors at a time (its parents'), not one per directory found.
  struct Pending {
    std::vector<Step> parent;
    std::string name;      // "" for the checkpoint itself
    std::string relative;  // "" or "sub/"
  };
  std::vector<Pending> pending = {{top, "", ""}};
  std::set<std::pair<dev_t, ino_t>> visited;
  struct stat top_st {};
  if (fstat(CurrentFd(root, top), &top_st) == 0) visited.insert({top_st.st_dev, top_st.st_ino});
  int entries = 0;
  while (!pending.empty()) {
    Pending current = std::move(pending.back());
    pending.pop_back();
    std::vector<Step> steps = std::move(current.parent);
    if (!current.name.empty()) {
      const std::string shown = absl::StrCat("checkpoint ", path, ": ", current.relative);
      absl::StatusOr<Walked> reached = Walk(root, steps, current.name, Want::kAny, shown);
      if (!reached.ok()) return absl::InvalidArgumentError(reached.status().message());
      if (!S_ISDIR(reached->st.st_mode)) continue;  // changed since it was found; read time decides
      steps = std::move(reached->steps);
    }
    const int at = CurrentFd(root, steps);
    // A descriptor of its own to list with: a dup would share the read position with other lists.
    DIR* listing = fdopendir(openat(at, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    if (listing == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("checkpoint ", path, " cannot be listed: ", std::strerror(errno)));
    }
    std::vector<std::string> names;
    while (const dirent* entry = readdir(listing)) {
      const std::string name = entry->d_name;
      if (name == "." || name == "..") continue;
      if (++entries > ModelRoot::kMaxEntries) {
        closedir(listing);
        return absl::InvalidArgumentError(
            absl::StrCat("checkpoint ", path, " holds more than ", ModelRoot::kMaxEntries, " files"));
      }
      names.push_back(name);
    }
    closedir(listing);
    const auto parent = std::make_shared<const std::vector<Step>>(std::move(steps));
    for (const std::string& name : names) {
      const std::string relative = absl::StrCat(current.relative, name);
      const std::string shown = absl::StrCat("checkpoint ", path, ": ", relative);
      struct stat st {};
      if (fstatat(at, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) continue;  // gone meanwhile
      if (S_ISREG(st.st_mode)) {
        RETURN_IF_ERROR(CheckLinkCount(st, shown));
        continue;
      }
      if (!S_ISLNK(st.st_mode) && !S_ISDIR(st.st_mode)) continue;  // refused when read, if read
      absl::StatusOr<Walked> reached = Walk(root, *parent, name, Want::kAny, shown);
      if (!reached.ok()) {
        // A dangling link reads as nothing; refused anyway, since what it names may appear later.
        return absl::InvalidArgumentError(reached.status().message());
      }
      if (S_ISREG(reached->st.st_mode)) RETURN_IF_ERROR(CheckLinkCount(reached->st, shown));
      // Linked directories too (what is read through a link must be checked as well), each once:
      // links between directories cannot make the walk loop.
      if (S_ISDIR(reached->st.st_mode) && visited.insert({reached->st.st_dev, reached->st.st_ino}).second) {
        pending.push_back({*parent, name, absl::StrCat(relative, "/")});
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::shared_ptr<const CheckpointDir>> CheckpointDir::Open(const ModelRoot& root,
                                                                         const std::string& path) {
  // A NUL ends the name the kernel sees but not the one compared here ("..\0" is not ".." to the
  // walk, and is to openat): refused before anything is opened, with or without a root.
  if (path.find('\0') != std::string::npos) return absl::InvalidArgumentError("the checkpoint path holds a NUL byte");
  if (!root.confined()) {
    auto dir = std::make_shared<const ScopedFd>(open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    const int err = dir->valid() ? 0 : errno;
    return std::shared_ptr<const CheckpointDir>(new CheckpointDir(root, {}, dir->valid() ? dir : nullptr, path, err));
  }
  if (path.empty()) return absl::InvalidArgumentError("the checkpoint path is empty");
  std::string relative = path;
  if (path.front() == '/') {
    // Named by an absolute path: taken under the root as it is spelled, or else where it leads
    // (the root may be reached through a link); only the walk below decides what is read.
    std::optional<std::string> rest = UnderRoot(root.root(), path);
    if (!rest.has_value()) {
      char resolved[PATH_MAX];
      // Outside the root whether it exists or not: no probing which paths exist elsewhere.
      // One message whether or not it exists there.
      const std::string refusal = absl::StrCat("checkpoint ", path, " is outside the model root");
      if (realpath(path.c_str(), resolved) == nullptr) return absl::InvalidArgumentError(refusal);
      rest = UnderRoot(root.root(), resolved);
      if (!rest.has_value()) return absl::InvalidArgumentError(refusal);
    }
    relative = *rest;
  }
  absl::StatusOr<Walked> walked = Walk(root, {}, relative, Want::kDirectory, absl::StrCat("checkpoint ", path));
  if (!walked.ok()) return absl::InvalidArgumentError(walked.status().message());
  std::string canonical = PathOf(root, walked->steps);
  RETURN_IF_ERROR(CheckTree(root, walked->steps, path));
  std::shared_ptr<const ScopedFd> dir =
      walked->steps.empty() ? nullptr : walked->steps.back().fd;  // null: the root itself
  return std::shared_ptr<const CheckpointDir>(
      new CheckpointDir(root, std::move(walked->steps), std::move(dir), std::move(canonical), 0));
}

absl::StatusOr<MappableFile> CheckpointDir::OpenFile(absl::string_view name) const {
  // As in Open: a name from the checkpoint's own files (modules.json's Pooling path, the index's
  // shard names) may carry a NUL that would cut the kernel's name short of the walk's.
  if (name.find('\0') != absl::string_view::npos) {
    return absl::InvalidArgumentError(absl::StrCat("a file name in checkpoint ", path_, " holds a NUL byte"));
  }
  const std::string shown = absl::StrCat(path_, "/", name);
  MappableFile file;
  file.path = shown;
  struct stat st {};
  if (confined()) {
    if (name.empty() || name.front() == '/') {
      return absl::InvalidArgumentError(absl::StrCat(shown, ": a checkpoint's files are named relative to it"));
    }
    ASSIGN_OR_RETURN(Walked walked, Walk(root_, steps_, name, Want::kFile, shown));
    file.fd = std::move(walked.file);
    st = walked.st;
  } else {
    if (dir_ == nullptr) {
      const std::string why = absl::StrCat("cannot read ", shown, ": ", std::strerror(open_errno_));
      return open_errno_ == ENOENT || open_errno_ == ENOTDIR ? absl::NotFoundError(why)
                                                             : absl::InvalidArgumentError(why);
    }
    // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer, for good.
    file.fd = ScopedFd(openat(dir_->get(), std::string(name).c_str(), O_RDONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC));
    if (!file.fd.valid()) {
      const std::string why = absl::StrCat("cannot read ", shown, ": ", std::strerror(errno));
      return errno == ENOENT ? absl::NotFoundError(why) : absl::InvalidArgumentError(why);
    }
    if (fstat(file.fd.get(), &st) != 0 || !S_ISREG(st.st_mode)) {
      return absl::InvalidArgumentError(
          absl::StrCat(shown, " is not a regular file (a FIFO, device or directory); a checkpoint's files must be"));
    }
  }
  file.size = static_cast<int64_t>(st.st_size);
  return file;
}

absl::StatusOr<std::string> CheckpointDir::ReadSmallFile(absl::string_view name, int64_t max_bytes) const {
  ASSIGN_OR_RETURN(MappableFile file, OpenFile(name));
  return ReadOpenRegularFile(file.fd.get(), file.path, max_bytes);
}

absl::StatusOr<MappableFile> CheckpointDir::OpenForMap(absl::string_view name) const { return OpenFile(name); }

}  // namespace bertshard::common
