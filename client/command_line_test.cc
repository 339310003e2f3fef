#include "client/command_line.h"

#include "gtest/gtest.h"

namespace bertshard::client {
namespace {

TEST(CommandLine, ParsesValuesSwitchesAndPositionals) {
  auto cl = ParseCommandLine({"plan", "req.json", "--tp", "2", "--pp-style=zbv", "--local", "--fp8=false"},
                             {"tp", "pp-style"}, {"local", "fp8"});
  ASSERT_TRUE(cl.ok()) << cl.status();
  EXPECT_EQ(cl->positional, (std::vector<std::string>{"plan", "req.json"}));
  EXPECT_EQ(cl->values.at("tp"), "2");
  EXPECT_EQ(cl->values.at("pp-style"), "zbv");
  EXPECT_TRUE(cl->switches.count("local"));
  EXPECT_FALSE(cl->switches.count("fp8"));
}

TEST(CommandLine, RejectsUnknownMissingRepeatedAndBadSwitchValues) {
  EXPECT_EQ(ParseCommandLine({"--tpp", "2"}, {"tp"}, {}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseCommandLine({"--tp"}, {"tp"}, {}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseCommandLine({"--tp", "1", "--tp=2"}, {"tp"}, {}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseCommandLine({"--local=yes"}, {}, {"local"}).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace bertshard::client
