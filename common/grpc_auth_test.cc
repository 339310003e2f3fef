// Token loading (files, the environment, what a token may hold); the access rules themselves are
// tested through real servers (server/coordinator_server_test, worker/worker_service_test).
#include "common/grpc_auth.h"

#include <cstdlib>
#include <fstream>
#include <string>

#include "gtest/gtest.h"

namespace bertshard::common {
namespace {

std::string File(const std::string& name, const std::string& text) {
  const std::string path = testing::TempDir() + "/" + name;
  std::ofstream(path) << text;
  return path;
}

TEST(LoadToken, FromAFileTrimmedElseTheEnvironmentElseNone) {
  unsetenv("BERTSHARD_TEST_TOKEN");
  EXPECT_EQ(*LoadToken("", "BERTSHARD_TEST_TOKEN"), "");
  EXPECT_EQ(*LoadToken("", nullptr), "");
  setenv("BERTSHARD_TEST_TOKEN", " from-env\n", 1);
  EXPECT_EQ(*LoadToken("", "BERTSHARD_TEST_TOKEN"), "from-env");
  // The file wins over the environment.
  EXPECT_EQ(*LoadToken(File("token", "from-file\n"), "BERTSHARD_TEST_TOKEN"), "from-file");
  unsetenv("BERTSHARD_TEST_TOKEN");
}

TEST(LoadToken, RefusesMissingEmptyAndUnsendableTokensWithoutQuotingThem) {
  EXPECT_EQ(LoadToken("/no/such/token", nullptr).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(LoadToken(File("empty", " \n"), nullptr).status().code(), absl::StatusCode::kInvalidArgument);
  const auto spaced = LoadToken(File("spaced", "two words-secret"), nullptr);
  EXPECT_EQ(spaced.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(std::string(spaced.status().message()).find("secret"), std::string::npos);
  EXPECT_EQ(LoadToken(File("binary", std::string("a\x01"
                                                 "b")),
                      nullptr)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace bertshard::common
