// File: client/cluster_commands.h
// -----------------------------------------------------------------------------
// shardctl's job commands against a running coordinator (client/coordinator_connection.h says
// which): submit [--watch], jobs, job ID, watch ID, cancel ID, workers; and the runner that all
// coordinator commands (these, infer and embed) go through.
//
// Example:
//   return RunCoordinatorCommand(command_line, &JobsCommand, stdout, stderr);
//
// Failure model: each command returns a status (INVALID_ARGUMENT for bad input, NOT_FOUND for an
// unknown job, ABORTED for a watched job that failed, the coordinator's code otherwise);
// RunCoordinatorCommand prints it and turns it into the exit status.
// Thread safety: thread-compatible.
#ifndef BERTSHARD_CLIENT_CLUSTER_COMMANDS_H_
#define BERTSHARD_CLIENT_CLUSTER_COMMANDS_H_

#include <cstdio>
#include <vector>

#include "absl/status/status.h"
#include "client/command_line.h"

namespace bertshard::client {

// submit's flags: the request flags, the connection flags, --backend, --watch and --no-wait. The
// other job commands take ConnectionFlags().
const std::vector<Flag>& SubmitFlags();
const std::vector<Flag>& ScaleFlags();   // --replicas, --watch and the connection's
const std::vector<Flag>& UpdateFlags();  // the request flags, --watch, --abort and the connection's

absl::Status SubmitCommand(const CommandLine& command_line, std::FILE* out);   // prints the job id
absl::Status JobsCommand(const CommandLine& command_line, std::FILE* out);     // a table of jobs
absl::Status JobCommand(const CommandLine& command_line, std::FILE* out);      // one job as JSON
absl::Status WatchCommand(const CommandLine& command_line, std::FILE* out);    // states until settled
absl::Status CancelCommand(const CommandLine& command_line, std::FILE* out);   // cancels a job
absl::Status ScaleCommand(const CommandLine& command_line, std::FILE* out);    // a job's replica count
absl::Status UpdateCommand(const CommandLine& command_line, std::FILE* out);   // a live update of its shape
absl::Status WorkersCommand(const CommandLine& command_line, std::FILE* out);  // a table of workers

// Checks the token and TLS files (INVALID_ARGUMENT, exit 2, before any call), runs `command` and
// returns its exit status: 0 ok, 2 invalid input, 3 an unknown job, 1 anything else (the
// coordinator unreachable, the job failed, a refusal).
int RunCoordinatorCommand(const CommandLine& command_line, absl::Status (*command)(const CommandLine&, std::FILE*),
                          std::FILE* out, std::FILE* err);

}  // namespace bertshard::client

#endif  // BERTSHARD_CLIENT_CLUSTER_COMMANDS_H_
