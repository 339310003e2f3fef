// File: client/serving_commands.h
// -----------------------------------------------------------------------------
// shardctl's serving commands against a READY job on a coordinator: `infer ID --text "..."
// [--text-pair "..."] | --input FILE.json` prints the tokens the model ran on, the head's
// predictions and the outputs' shapes; `embed ID TEXT... | --file FILE | --input FILE.json`
// prints one vector per text and their cosine similarities. Run through RunCoordinatorCommand
// (client/cluster_commands.h).
//
// Example:
//   return RunCoordinatorCommand(command_line, &EmbedCommand, stdout, stderr);
//
// Failure model: INVALID_ARGUMENT for bad input (checked here where the coordinator could not say
// it well: texts that are not UTF-8, a pair without its first text), else the coordinator's
// status.
// Thread safety: thread-compatible.
#ifndef BERTSHARD_CLIENT_SERVING_COMMANDS_H_
#define BERTSHARD_CLIENT_SERVING_COMMANDS_H_

#include <cstdio>
#include <vector>

#include "absl/status/status.h"
#include "client/command_line.h"

namespace bertshard::client {

// The connection flags and each command's own.
const std::vector<Flag>& InferFlags();
const std::vector<Flag>& EmbedFlags();
const std::vector<Flag>& RerankFlags();

absl::Status InferCommand(const CommandLine& command_line, std::FILE* out);
absl::Status EmbedCommand(const CommandLine& command_line, std::FILE* out);
absl::Status RerankCommand(const CommandLine& command_line, std::FILE* out);

}  // namespace bertshard::client

#endif  // BERTSHARD_CLIENT_SERVING_COMMANDS_H_
