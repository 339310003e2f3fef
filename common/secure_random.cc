#include "common/secure_random.h"

#include <fcntl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace bertshard::common {

absl::StatusOr<std::string> SecureRandomBytes(size_t n) {
  std::string bytes(n, '\0');
  size_t filled = 0;
  while (filled < n) {
    // Up to 256 bytes per call never return short once the pool is up; larger ones may, hence the loop.
    const ssize_t got = getrandom(bytes.data() + filled, n - filled, 0);
    if (got < 0) {
      if (errno == EINTR) continue;
      return absl::InternalError(absl::StrCat("getrandom: ", std::strerror(errno)));
    }
    filled += static_cast<size_t>(got);
  }
  return bytes;
}

absl::Status WriteSecretFile(const std::string& path, absl::string_view secret) {
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) {
    const std::string why = absl::StrCat("cannot create the secret file ", path, ": ", std::strerror(errno));
    return errno == EEXIST ? absl::AlreadyExistsError(why) : absl::InternalError(why);
  }
  const std::string text = absl::StrCat(absl::BytesToHexString(secret), "\n");
  const bool written = write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size());
  const bool closed = close(fd) == 0;
  if (!written || !closed) return absl::InternalError(absl::StrCat("cannot write the secret file ", path));
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadSecretFile(const std::string& path) {
  constexpr off_t kMaxBytes = 1024;
  const int fd = open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    const std::string why = absl::StrCat("cannot open the secret file ", path, ": ", std::strerror(errno));
    return errno == ENOENT ? absl::NotFoundError(why) : absl::FailedPreconditionError(why);
  }
  struct stat st {};
  std::string text;
  absl::Status status;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_uid != geteuid()) {
    status =
        absl::FailedPreconditionError(absl::StrCat("the secret file ", path, " is not a regular file of this user"));
  } else if ((st.st_mode & 077) != 0) {
    status = absl::FailedPreconditionError(absl::StrCat("the secret file ", path, " may be read by others (mode ",
                                                        absl::Hex(st.st_mode & 0777), " hex); it must be 0600"));
  } else if (st.st_size > kMaxBytes) {
    status = absl::InvalidArgumentError(absl::StrCat("the secret file ", path, " is over ", kMaxBytes, " bytes"));
  } else {
    text.resize(static_cast<size_t>(st.st_size));
    if (read(fd, text.data(), text.size()) != static_cast<ssize_t>(text.size())) {
      status = absl::InternalError(absl::StrCat("cannot read the secret file ", path));
    }
  }
  close(fd);
  if (!status.ok()) return status;
  const absl::string_view hex = absl::StripAsciiWhitespace(text);
  const bool is_hex = !hex.empty() && hex.size() % 2 == 0 &&
                      std::all_of(hex.begin(), hex.end(), [](char c) { return absl::ascii_isxdigit(c); });
  if (!is_hex) return absl::InvalidArgumentError(absl::StrCat("the secret file ", path, " does not hold hex"));
  return absl::HexStringToBytes(hex);
}

}  // namespace bertshard::common
