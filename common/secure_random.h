// File: common/secure_random.h
// -----------------------------------------------------------------------------
// Bytes from the kernel's cryptographic random source (getrandom(2)), for secrets and nonces: a
// job's rendezvous secret (made by the coordinator per load attempt, by shardctl per local run),
// the rendezvous handshake's nonces. Not for simulation or tests' inputs (use a seeded engine).
// And the file a secret is handed to another process through (never argv, which every user of the
// host can read in /proc): hex, mode 0600, refused when others may read it.
//
// Example:
//   ASSIGN_OR_RETURN(std::string secret, common::SecureRandomBytes(32));
//   RETURN_IF_ERROR(common::WriteSecretFile(dir + "/rendezvous_secret", secret));
//   ASSIGN_OR_RETURN(std::string same, common::ReadSecretFile(dir + "/rendezvous_secret"));
//
// Failure model: INTERNAL when the kernel refuses (no getrandom, a seccomp filter); it never
// returns fewer bytes than asked, and never blocks once the system's pool is initialised (at boot).
// Secret files: errors name the path, never the secret.
//
// Thread safety: thread-safe.
#ifndef BERTSHARD_COMMON_SECURE_RANDOM_H_
#define BERTSHARD_COMMON_SECURE_RANDOM_H_

#include <cstddef>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace bertshard::common {

// `n` random bytes (binary, not text).
absl::StatusOr<std::string> SecureRandomBytes(size_t n);

// Creates `path` (it must not exist; a link is not followed) with mode 0600 holding `secret` in hex.
// ALREADY_EXISTS, or INTERNAL when it cannot be written.
absl::Status WriteSecretFile(const std::string& path, absl::string_view secret);
// The secret WriteSecretFile wrote. NOT_FOUND; FAILED_PRECONDITION when it is not a regular file
// owned by this user, or group or others may read it; INVALID_ARGUMENT when it is not hex (or
// over 1 KiB).
absl::StatusOr<std::string> ReadSecretFile(const std::string& path);

}  // namespace bertshard::common

#endif  // BERTSHARD_COMMON_SECURE_RANDOM_H_
