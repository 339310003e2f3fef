// shardctl: the bertshard command line. Its subcommands, their help and the dispatch over them
// are in client/shardctl_commands.h: plan, run and init-checkpoint work on this machine; submit,
// jobs, job, watch, cancel, workers, infer and embed talk to a coordinator.
//
// Exit status: 0 ok; 1 the coordinator could not be reached, a job failed or another refusal
// (FAILED_PRECONDITION, PERMISSION_DENIED, ...), output errors; 2 invalid request or usage (and
// no command at all); 3 an unknown job.
#include <cstdio>
#include <string>
#include <vector>

#include "client/shardctl_commands.h"

int main(int argc, char** argv) {
  return bertshard::client::RunShardctl(std::vector<std::string>(argv + 1, argv + argc), stdout, stderr);
}
