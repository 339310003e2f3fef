#include "client/shardctl_commands.h"

#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "client/captured_run.h"
#include "client/version.h"
#include "gtest/gtest.h"

namespace bertshard::client {
namespace {

CapturedRun Shardctl(const std::vector<std::string>& args) {
  return CaptureRun([&](std::FILE* out, std::FILE* err) { return RunShardctl(args, out, err); });
}

const Subcommand& Find(const std::string& name) {
  for (const Subcommand& c : Subcommands()) {
    if (c.name == name) return c;
  }
  ADD_FAILURE() << "no subcommand " << name;
  return Subcommands().front();
}

TEST(Shardctl, TheSubcommandsAreAllThere) {
  std::vector<std::string> names;
  for (const Subcommand& c : Subcommands()) names.push_back(c.name);
  EXPECT_EQ(names, (std::vector<std::string>{"plan", "run", "init-checkpoint", "submit", "jobs", "job", "watch",
                                             "cancel", "scale", "update", "workers", "infer", "embed", "rerank"}));
}

TEST(Shardctl, SubcommandHelpIsThatCommandsUsageAndFlagsOnly) {
  for (const std::vector<std::string>& args :
       {std::vector<std::string>{"submit", "--help"}, {"help", "submit"}, {"submit", "--checkpoint", "x", "--help"}}) {
    const CapturedRun r = Shardctl(args);
    EXPECT_EQ(r.exit_code, 0) << r.err;
    EXPECT_TRUE(r.err.empty()) << r.err;
    EXPECT_TRUE(absl::StartsWith(r.out, "usage: shardctl submit --checkpoint DIR")) << r.out;
    EXPECT_TRUE(absl::StrContains(r.out, "\n  --watch ")) << r.out;
    EXPECT_TRUE(absl::StrContains(r.out, "\n  --tls-ca FILE, --tls_ca ")) << r.out;
    EXPECT_TRUE(absl::StrContains(r.out, "\n  --help ")) << r.out;
    // Not the other commands' flags or usages, nor the whole list.
    for (const char* other :
         {"--pooling", "--text-pair", "--batch", "--rank-binary", "usage: shardctl embed", "Commands:"}) {
      EXPECT_FALSE(absl::StrContains(r.out, other)) << other << " in\n" << r.out;
    }
    // Every flag submit takes, and no more: one "  --" entry per flag, plus --help.
    const size_t entries = std::count_if(absl::StrSplit(r.out, '\n').begin(), absl::StrSplit(r.out, '\n').end(),
                                         [](absl::string_view line) { return absl::StartsWith(line, "  --"); });
    EXPECT_EQ(entries, Find("submit").flags->size() + 1) << r.out;
  }
  for (const Subcommand& c : Subcommands()) {
    const CapturedRun r = Shardctl({c.name, "--help"});
    EXPECT_EQ(r.exit_code, 0) << c.name;
    EXPECT_EQ(r.out, SubcommandHelp(c)) << c.name;
    EXPECT_LT(std::count(r.out.begin(), r.out.end(), '\n'), 60) << c.name << ":\n" << r.out;
    for (absl::string_view line : absl::StrSplit(r.out, '\n')) EXPECT_LE(line.size(), 110u) << c.name << ": " << line;
  }
}

TEST(Shardctl, TopLevelHelpListsEveryCommandOnce) {
  const CapturedRun r = Shardctl({"--help"});
  EXPECT_EQ(r.exit_code, 0);
  for (const Subcommand& c : Subcommands()) {
    EXPECT_TRUE(absl::StrContains(r.out, "\n  " + c.name + " ")) << c.name << " missing from\n" << r.out;
  }
  EXPECT_FALSE(absl::StrContains(r.out, "--layers-per-stage")) << "flags belong to each command's help";
  EXPECT_EQ(Shardctl({"help"}).out, r.out);
  EXPECT_EQ(Shardctl({"-h"}).out, r.out);
  const CapturedRun bare = Shardctl({});
  EXPECT_EQ(bare.exit_code, 2);
  EXPECT_EQ(bare.err, r.out);
  EXPECT_TRUE(bare.out.empty());
}

TEST(Shardctl, VersionIsTheOneConstant) {
  const CapturedRun r = Shardctl({"--version"});
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_EQ(r.out, std::string("shardctl ") + kShardctlVersion + "\n");
  EXPECT_TRUE(r.err.empty());
}

TEST(Shardctl, AnUnknownCommandListsTheRealOnes) {
  for (const std::vector<std::string>& args : {std::vector<std::string>{"frobnicate"}, {"help", "frobnicate"}}) {
    const CapturedRun r = Shardctl(args);
    EXPECT_EQ(r.exit_code, 2);
    EXPECT_TRUE(r.out.empty());
    EXPECT_EQ(r.err,
              "shardctl: unknown command 'frobnicate'; commands: plan, run, init-checkpoint, submit, jobs, job, "
              "watch, cancel, scale, update, workers, infer, embed, rerank (see shardctl --help)\n");
  }
}

TEST(Shardctl, ABadFlagPointsAtThatCommandsHelp) {
  const CapturedRun r = Shardctl({"jobs", "--pooling", "mean"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_TRUE(absl::StartsWith(r.err, "shardctl: unknown flag --pooling; known flags: --server")) << r.err;
  EXPECT_TRUE(absl::EndsWith(r.err, "(see shardctl jobs --help)\n")) << r.err;
}

TEST(Shardctl, AnUnreachableCoordinatorIsNamed) {
  const CapturedRun r = Shardctl({"jobs", "--server", "127.0.0.1:1", "--timeout", "5"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_TRUE(absl::StartsWith(r.err,
                               "shardctl: UNAVAILABLE: coordinator at 127.0.0.1:1 (--server) could not be "
                               "reached: "))
      << r.err;
  EXPECT_TRUE(absl::EndsWith(r.err, "Give its address with --server HOST:PORT or $BERTSHARD_SERVER\n")) << r.err;
  // plan asks a coordinator only with --server: its hint names that alone.
  const CapturedRun plan = Shardctl({"plan", "--variant", "BertModel", "--server", "127.0.0.1:1", "--timeout", "5"});
  EXPECT_EQ(plan.exit_code, 1);
  EXPECT_TRUE(absl::EndsWith(plan.err, "Give its address with --server HOST:PORT\n")) << plan.err;
}

TEST(Shardctl, TheServersTlsSpellingsWork) {
  // A CA that is not there: refused as the dashed spelling is, before any call.
  const CapturedRun r = Shardctl({"jobs", "--server", "127.0.0.1:1", "--tls_ca", "/nonexistent/ca.pem"});
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_TRUE(absl::StrContains(r.err, "/nonexistent/ca.pem")) << r.err;
  EXPECT_EQ(Shardctl({"jobs", "--server", "127.0.0.1:1", "--tls-ca", "/nonexistent/ca.pem"}).err, r.err);
}

}  // namespace
// A replica count that is not 1 or more is the caller's mistake: exit 2 with the rule, before any
// coordinator is asked (none listens on the port given).
TEST(Shardctl, ABadReplicaCountIsRefusedBeforeAnyCall) {
  for (const char* bad : {"0", "-2", "two", "1.5", ""}) {
    for (const std::vector<std::string>& args :
         {std::vector<std::string>{"submit", "--checkpoint", "/m", "--server", "127.0.0.1:1", "--replicas", bad},
          {"scale", "job-1", "--server", "127.0.0.1:1", "--replicas", bad}}) {
      const CapturedRun r = Shardctl(args);
      EXPECT_EQ(r.exit_code, 2) << args[0] << " " << bad << ": " << r.err;
      EXPECT_TRUE(absl::StrContains(r.err, "--replicas must be a whole number of 1 or more")) << r.err;
    }
  }
  const CapturedRun missing = Shardctl({"scale", "job-1", "--server", "127.0.0.1:1"});
  EXPECT_EQ(missing.exit_code, 2) << missing.err;
  EXPECT_TRUE(absl::StrContains(missing.err, "scale needs --replicas N")) << missing.err;
}

// rerank without a query or without texts is refused before any call (exit 2), saying what it needs.
TEST(Shardctl, ARerankWithoutQueryOrTextsIsRefusedBeforeAnyCall) {
  const CapturedRun no_query = Shardctl({"rerank", "job-1", "a text", "--server", "127.0.0.1:1"});
  EXPECT_EQ(no_query.exit_code, 2) << no_query.err;
  EXPECT_TRUE(absl::StrContains(no_query.err, "rerank needs --query")) << no_query.err;
  const CapturedRun no_texts = Shardctl({"rerank", "job-1", "--query", "q", "--server", "127.0.0.1:1"});
  EXPECT_EQ(no_texts.exit_code, 2) << no_texts.err;
  EXPECT_TRUE(absl::StrContains(no_texts.err, "rerank needs texts")) << no_texts.err;
  const CapturedRun bad_format =
      Shardctl({"rerank", "job-1", "--query", "q", "t", "--format", "yaml", "--server", "127.0.0.1:1"});
  EXPECT_EQ(bad_format.exit_code, 2) << bad_format.err;
  EXPECT_TRUE(absl::StrContains(bad_format.err, "--format must be table or json")) << bad_format.err;
}

}  // namespace bertshard::client
