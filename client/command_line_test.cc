#include "client/command_line.h"

#include "absl/strings/match.h"
#include "gtest/gtest.h"

namespace bertshard::client {
namespace {

const std::vector<Flag> kFlags = {
    {"tp", "N", "tensor parallel size"},      {"pp-style", "S", "1f1b, interleaved, zbv"},
    {"tls-ca", "FILE", "the CA", {"tls_ca"}}, {"local", "", "plan here"},
    {"fp8", "", "fp8 communication"},
};

TEST(CommandLine, ParsesValuesSwitchesAndPositionals) {
  auto cl = ParseCommandLine({"plan", "req.json", "--tp", "2", "--pp-style=zbv", "--local", "--fp8=false"}, kFlags);
  ASSERT_TRUE(cl.ok()) << cl.status();
  EXPECT_EQ(cl->positional, (std::vector<std::string>{"plan", "req.json"}));
  EXPECT_EQ(cl->values.at("tp"), "2");
  EXPECT_EQ(cl->values.at("pp-style"), "zbv");
  EXPECT_TRUE(cl->switches.count("local"));
  EXPECT_FALSE(cl->switches.count("fp8"));
}

TEST(CommandLine, RejectsUnknownMissingRepeatedAndBadSwitchValues) {
  EXPECT_EQ(ParseCommandLine({"--tpp", "2"}, kFlags).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseCommandLine({"--tp"}, kFlags).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseCommandLine({"--tp", "1", "--tp=2"}, kFlags).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseCommandLine({"--local=yes"}, kFlags).status().code(), absl::StatusCode::kInvalidArgument);
}

// The servers' underscore spelling reads as the flag itself, and counts as giving it.
TEST(CommandLine, AliasesFillTheFlagsOwnName) {
  auto cl = ParseCommandLine({"jobs", "--tls_ca", "ca.pem"}, kFlags);
  ASSERT_TRUE(cl.ok()) << cl.status();
  EXPECT_EQ(cl->values.at("tls-ca"), "ca.pem");
  EXPECT_EQ(cl->values.count("tls_ca"), 0u);
  auto twice = ParseCommandLine({"jobs", "--tls-ca", "a.pem", "--tls_ca=b.pem"}, kFlags);
  EXPECT_EQ(twice.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(twice.status().message(), "--tls-ca is given more than once")) << twice.status();
}

TEST(CommandLine, EveryCommandTakesHelp) {
  auto cl = ParseCommandLine({"plan", "--help"}, kFlags);
  ASSERT_TRUE(cl.ok()) << cl.status();
  EXPECT_TRUE(cl->switches.count("help"));
}

TEST(CommandLine, HelpListsEachFlagWithItsValueAliasesAndWrappedHelp) {
  const std::string help =
      FormatFlagHelp({{"tls-ca", "FILE", "the CA\nthat signed it", {"tls_ca"}}, {"local", "", "x"}});
  EXPECT_EQ(help,
            "  --tls-ca FILE, --tls_ca   the CA\n"
            "                            that signed it\n"
            "  --local                   x\n");
  const std::string long_name = FormatFlagHelp({{"layers-per-stage", "A,B,C,D,E", "counts"}});
  EXPECT_EQ(long_name, "  --layers-per-stage A,B,C,D,E\n                            counts\n");
}

TEST(CommandLine, SelectFlagsKeepsTheNamedInOrder) {
  const std::vector<Flag> picked = SelectFlags(kFlags, {"local", "tp"});
  ASSERT_EQ(picked.size(), 2u);
  EXPECT_EQ(picked[0].name, "tp");
  EXPECT_EQ(picked[1].name, "local");
}

}  // namespace
}  // namespace bertshard::client
