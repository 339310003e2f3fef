#include "client/coordinator_connection.h"

#include <cstdlib>

#include "absl/strings/match.h"
#include "gtest/gtest.h"

namespace bertshard::client {
namespace {

TEST(ResolveServerAddress, FlagThenEnvironmentThenDefaultSayingWhich) {
  ASSERT_EQ(unsetenv("BERTSHARD_SERVER"), 0);
  CommandLine cl;
  EXPECT_EQ(ResolveServerAddress(cl).address, "127.0.0.1:50051");
  EXPECT_EQ(ResolveServerAddress(cl).source, "the default");
  ASSERT_EQ(setenv("BERTSHARD_SERVER", "coordinator:9", 1), 0);
  EXPECT_EQ(ResolveServerAddress(cl).address, "coordinator:9");
  EXPECT_EQ(ResolveServerAddress(cl).source, "$BERTSHARD_SERVER");
  cl.values["server"] = "10.0.0.1:7";
  EXPECT_EQ(ResolveServerAddress(cl).address, "10.0.0.1:7");
  EXPECT_EQ(ResolveServerAddress(cl).source, "--server");
  ASSERT_EQ(unsetenv("BERTSHARD_SERVER"), 0);
}

TEST(DescribeCallError, AnUnreachableCoordinatorIsNamedWithHowToGiveIt) {
  const absl::Status s = DescribeCallError(absl::UnavailableError("failed to connect to all addresses"),
                                           {"127.0.0.1:1", "$BERTSHARD_SERVER"}, /*connected=*/false);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(s.message(),
            "coordinator at 127.0.0.1:1 ($BERTSHARD_SERVER) could not be reached: failed to connect to all "
            "addresses; is it running there? Give its address with --server HOST:PORT or $BERTSHARD_SERVER");
  EXPECT_EQ(DescribeCallError(absl::DeadlineExceededError("late"), {"h:1", "--server"}, false).code(),
            absl::StatusCode::kDeadlineExceeded);
}

// A coordinator that answered UNAVAILABLE (a job recovering) was reached: its message stands.
TEST(DescribeCallError, ACoordinatorThatAnsweredKeepsItsMessage) {
  const absl::Status recovering = absl::UnavailableError("job job-1 is recovering");
  EXPECT_EQ(DescribeCallError(recovering, {"h:1", "--server"}, /*connected=*/true), recovering);
  const absl::Status not_found = absl::NotFoundError("no job x");
  EXPECT_EQ(DescribeCallError(not_found, {"h:1", "--server"}, /*connected=*/false), not_found);
}

// Nothing listens on port 1: a real call says so with the address.
TEST(CoordinatorConnection, ACallToNothingNamesTheAddressTried) {
  CommandLine cl;
  cl.values["server"] = "127.0.0.1:1";
  cl.values["timeout"] = "5";
  auto c = CoordinatorConnection::Open(cl, ResolveServerAddress(cl));
  ASSERT_TRUE(c.ok()) << c.status();
  v1::ListJobsResponse jobs;
  const absl::Status s = c->Check(c->stub()->ListJobs(c->Context(30).get(), v1::ListJobsRequest(), &jobs));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "coordinator at 127.0.0.1:1 (--server) could not be reached")) << s;
}

TEST(CoordinatorConnection, UnusableTokenOrTlsFilesAreRefusedBeforeAnyCall) {
  CommandLine token;
  token.values["token-file"] = "/nonexistent/token";
  EXPECT_EQ(CoordinatorConnection::Open(token, ResolveServerAddress(token)).status().code(),
            absl::StatusCode::kInvalidArgument);
  CommandLine tls;
  tls.values["tls-ca"] = "/nonexistent/ca.pem";
  EXPECT_EQ(CoordinatorConnection::Open(tls, ResolveServerAddress(tls)).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// The underscore spellings; none is the servers' --auth_token_file, which is another thing.
TEST(ConnectionFlags, TakeTheUnderscoreSpellingsOfTheServers) {
  std::vector<std::string> aliases;
  for (const Flag& f : ConnectionFlags()) aliases.insert(aliases.end(), f.aliases.begin(), f.aliases.end());
  EXPECT_EQ(aliases, (std::vector<std::string>{"token_file", "tls_ca", "tls_cert", "tls_key"}));
}

}  // namespace
}  // namespace bertshard::client
