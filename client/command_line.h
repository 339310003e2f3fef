// File: client/command_line.h
// -----------------------------------------------------------------------------
// A small parser for shardctl's `SUBCOMMAND [POSITIONAL...] [--flag value | --flag=value |
// --switch]` command lines. shardctl uses dashed names (--pp-style) and subcommands, which
// absl flags (global, underscore names) do not model; servers keep using ABSL_FLAG.
//
// Example:
//   auto cl = ParseCommandLine({"plan", "--tp", "2", "--local"}, {"tp"}, {"local"});
//   // cl->positional == {"plan"}; cl->values["tp"] == "2"; cl->switches has "local"
//
// Thread safety: thread-safe (pure functions).
#ifndef BERTSHARD_CLIENT_COMMAND_LINE_H_
#define BERTSHARD_CLIENT_COMMAND_LINE_H_

#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace bertshard::client {

struct CommandLine {
  std::vector<std::string> positional;
  std::map<std::string, std::string> values;  // --name value / --name=value
  std::set<std::string> switches;             // --name (or --name=true); --name=false removes it
};

// `value_flags` take a value; `switch_flags` do not. INVALID_ARGUMENT for an unknown flag, a
// missing value, a repeated flag, or a switch given a value other than true/false.
absl::StatusOr<CommandLine> ParseCommandLine(const std::vector<std::string>& args,
                                             const std::set<std::string>& value_flags,
                                             const std::set<std::string>& switch_flags);

}  // namespace bertshard::client

#endif  // BERTSHARD_CLIENT_COMMAND_LINE_H_
