// File: client/shardctl_commands.h
// -----------------------------------------------------------------------------
// shardctl's subcommands in one table (name, usage, what it does, its flags, how it runs), and
// the dispatch over it: `shardctl --help` lists them, `shardctl COMMAND --help` (or `shardctl help
// COMMAND`) prints that command's usage and flags only, `shardctl --version` the version
// (client/version.h), and an unknown command is answered with the real ones.
//
// Example:
//   int main(int argc, char** argv) {
//     return RunShardctl(std::vector<std::string>(argv + 1, argv + argc), stdout, stderr);
//   }
//
// Failure model: returns the exit status; usage errors print to `err` and return 2.
// Thread safety: thread-compatible (the commands write to the FILE*s they are given; `run`
// starts child processes).
#ifndef BERTSHARD_CLIENT_SHARDCTL_COMMANDS_H_
#define BERTSHARD_CLIENT_SHARDCTL_COMMANDS_H_

#include <cstdio>
#include <string>
#include <vector>

#include "client/command_line.h"

namespace bertshard::client {

struct Subcommand {
  std::string name;
  std::string usage;        // after "usage: shardctl "
  std::string description;  // a paragraph or two
  const std::vector<Flag>* flags;
  int (*run)(const CommandLine& command_line, std::FILE* out, std::FILE* err);
};

const std::vector<Subcommand>& Subcommands();

// The help of one subcommand: its usage, what it does and its flags.
std::string SubcommandHelp(const Subcommand& command);

// shardctl with `args` (argv without the program name). Exit status: 0 ok, 1 the coordinator
// could not be reached, a job failed or another refusal, output errors; 2 invalid request or
// usage; 3 an unknown job.
int RunShardctl(const std::vector<std::string>& args, std::FILE* out, std::FILE* err);

}  // namespace bertshard::client

#endif  // BERTSHARD_CLIENT_SHARDCTL_COMMANDS_H_
