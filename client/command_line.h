// File: client/command_line.h
// -----------------------------------------------------------------------------
// A small parser for shardctl's `SUBCOMMAND [POSITIONAL...] [--flag value | --flag=value |
// --switch]` command lines, and the help text of one subcommand. shardctl uses dashed names
// (--pp-style) and subcommands, which absl flags (global, underscore names) do not model; servers
// keep using ABSL_FLAG. A flag may have aliases (the servers' underscore spelling, --tls_ca for
// --tls-ca): the parsed command line holds the flag's own name whichever spelling was given.
//
// Kept by hand rather than CLI11 (tried on `submit`): the commands read flags as strings and check
// them with their own messages, so CLI11's typed options went unused, while its errors, exit
// codes and its refusal of positional texts that start with '-' each needed glue to keep
// shardctl's behaviour.
//
// Example:
//   const std::vector<Flag> flags = {{"tp", "N", "tensor parallel size"}, {"local", "", "plan here"}};
//   auto cl = ParseCommandLine({"plan", "--tp", "2", "--local"}, flags);
//   // cl->positional == {"plan"}; cl->values["tp"] == "2"; cl->switches has "local"
//   std::string help = FormatFlagHelp(flags);  // "  --tp N    tensor parallel size\n..."
//
// Failure model: INVALID_ARGUMENT values, never exits.
// Thread safety: thread-safe (pure functions).
#ifndef BERTSHARD_CLIENT_COMMAND_LINE_H_
#define BERTSHARD_CLIENT_COMMAND_LINE_H_

#include <initializer_list>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace bertshard::client {

// One flag a subcommand takes.
struct Flag {
  std::string name;                       // without the dashes: "tls-ca"
  std::string value_name;                 // what its value is ("FILE"); empty for a switch (--local, --local=false)
  std::string help;                       // one line or more; wrapped lines are indented under the first
  std::vector<std::string> aliases = {};  // other accepted names, e.g. {"tls_ca"}
};

struct CommandLine {
  std::vector<std::string> positional;
  std::map<std::string, std::string> values;  // --name value / --name=value, by the flag's name
  std::set<std::string> switches;             // --name (or --name=true); --name=false removes it
};

// Every subcommand also takes --help, a switch, without listing it.
// INVALID_ARGUMENT for an unknown flag, a missing value, a flag given more than once (under any of
// its names), or a switch given a value other than true/false.
absl::StatusOr<CommandLine> ParseCommandLine(const std::vector<std::string>& args, const std::vector<Flag>& flags);

// The flags' help: one entry per flag, "  --name VALUE, --alias" then the help in a column.
std::string FormatFlagHelp(const std::vector<Flag>& flags);

// The flags of each part, in order (a subcommand's flags from shared groups and its own).
std::vector<Flag> JoinFlags(std::initializer_list<std::vector<Flag>> parts);

// The flags of `flags` named in `names`, in their order there.
std::vector<Flag> SelectFlags(std::vector<Flag> flags, const std::set<std::string>& names);

}  // namespace bertshard::client

#endif  // BERTSHARD_CLIENT_COMMAND_LINE_H_
