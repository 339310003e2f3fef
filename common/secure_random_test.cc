#include "common/secure_random.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <set>
#include <string>

#include "absl/strings/match.h"
#include "gtest/gtest.h"

namespace bertshard::common {
namespace {

TEST(SecureRandomBytes, GivesTheLengthAskedAndNeverRepeats) {
  std::set<std::string> seen;
  for (int i = 0; i < 100; ++i) {
    absl::StatusOr<std::string> bytes = SecureRandomBytes(32);
    ASSERT_TRUE(bytes.ok()) << bytes.status();
    ASSERT_EQ(bytes->size(), 32u);
    EXPECT_TRUE(seen.insert(*bytes).second) << "a 32-byte value came twice";
  }
  // Long requests are filled whole (getrandom may return short above 256 bytes).
  absl::StatusOr<std::string> big = SecureRandomBytes(1 << 20);
  ASSERT_TRUE(big.ok()) << big.status();
  EXPECT_EQ(big->size(), size_t{1} << 20);
  EXPECT_NE(big->substr(0, 4096), std::string(4096, '\0'));
  EXPECT_NE(big->substr(big->size() - 4096), std::string(4096, '\0'));
}

TEST(SecretFile, RoundTripsOnlyThroughAPrivateFile) {
  const std::string dir = std::string(std::getenv("TEST_TMPDIR") ? std::getenv("TEST_TMPDIR") : "/tmp");
  const std::string path = dir + "/secret_round_trip";
  unlink(path.c_str());
  const std::string secret = std::string("\x00\x01\xfe\xff", 4) + std::string(28, 'a');
  ASSERT_TRUE(WriteSecretFile(path, secret).ok());
  struct stat st {};
  ASSERT_EQ(stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  absl::StatusOr<std::string> read = ReadSecretFile(path);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, secret);
  // Never overwritten: a file someone made beforehand (to learn the secret) is refused.
  EXPECT_EQ(WriteSecretFile(path, secret).code(), absl::StatusCode::kAlreadyExists);
  // Readable by others: refused, without quoting it.
  ASSERT_EQ(chmod(path.c_str(), 0644), 0);
  absl::Status open = ReadSecretFile(path).status();
  EXPECT_EQ(open.code(), absl::StatusCode::kFailedPrecondition) << open;
  EXPECT_FALSE(absl::StrContains(open.message(), "6161")) << open;
  // Not hex.
  const std::string junk = dir + "/secret_junk";
  unlink(junk.c_str());
  ASSERT_TRUE(WriteSecretFile(junk, "x").ok());
  std::ofstream(junk) << "not hex\n";
  EXPECT_EQ(ReadSecretFile(junk).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ReadSecretFile(dir + "/no_such_secret").status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace bertshard::common
