// File: client/cluster_commands.h
// -----------------------------------------------------------------------------
// shardctl's commands against a running coordinator (--server, default $BERTSHARD_SERVER or
// 127.0.0.1:50051): submit [--watch], jobs, job ID, watch ID, cancel ID, workers,
// infer ID --text "..." | --input FILE.json, embed ID TEXT... | --file FILE | --input FILE.json.
//
// Thread safety: thread-compatible.
#ifndef BERTSHARD_CLIENT_CLUSTER_COMMANDS_H_
#define BERTSHARD_CLIENT_CLUSTER_COMMANDS_H_

#include <cstdio>
#include <set>
#include <string>

#include "client/command_line.h"

namespace bertshard::client {

// Whether `command` is one of these commands.
bool IsClusterCommand(const std::string& command);
const std::set<std::string>& ClusterValueFlags(const std::string& command);
const std::set<std::string>& ClusterSwitchFlags(const std::string& command);

// Exit status: 0 ok, 1 coordinator unreachable or the job failed, 2 invalid input, 3 not found.
int RunClusterCommand(const CommandLine& command_line, std::FILE* out, std::FILE* err);

}  // namespace bertshard::client

#endif  // BERTSHARD_CLIENT_CLUSTER_COMMANDS_H_
