// File: client/plan_command.h
// -----------------------------------------------------------------------------
// `shardctl plan`: builds a PlanRequest from a JSON file and/or flags, plans it in-process or on a
// coordinator, and prints a table, the contract JSON or a Graphviz diagram; `--batch` plans one
// JSON request per line.
//
// Thread safety: thread-compatible (writes to the FILE*s it is given).
#ifndef BERTSHARD_CLIENT_PLAN_COMMAND_H_
#define BERTSHARD_CLIENT_PLAN_COMMAND_H_

#include <cstdio>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "bertshard/v1/plan.pb.h"
#include "client/command_line.h"

namespace bertshard::client {

// Exit statuses of shardctl.
inline constexpr int kExitOk = 0;
inline constexpr int kExitFailure = 1;       // anything else: the coordinator could not be reached,
                                             // a job failed, refusals (FAILED_PRECONDITION, ...), I/O
inline constexpr int kExitInvalidInput = 2;  // invalid request or command line
inline constexpr int kExitNotFound = 3;      // an unknown job

// Prints "shardctl: CODE: message" to `err` and returns the exit status for `status`.
int ReportError(std::FILE* err, const absl::Status& status);

// The flags that build a PlanRequest (ApplyPlanFlags reads them), which plan, submit, run and
// init-checkpoint share.
const std::vector<Flag>& PlanRequestFlags();
// Everything `shardctl plan` takes: those, the request file, --local, the connection flags,
// --output and --batch.
const std::vector<Flag>& PlanFlags();

// Parses a PlanRequest in the contract's JSON. Besides the enum names it accepts the HF class
// name for `variant` (BertForMaskedLM) and lower-case pp_style / sp_mode ("zbv",
// "split_gather"); `config` may be a whole HF config.json (fields bertshard does not use are
// ignored, `architectures[0]` gives the variant if the request has none). Unknown fields
// elsewhere are errors (typos). INVALID_ARGUMENT says what could not be read.
absl::StatusOr<v1::PlanRequest> ParsePlanRequestJson(absl::string_view json);

// Applies the command-line flags on top of `request` (flags win).
absl::Status ApplyPlanFlags(const CommandLine& command_line, v1::PlanRequest* request);

// Runs `shardctl plan` with parsed arguments (positional[0] is "plan"); returns the exit status.
int RunPlanCommand(const CommandLine& command_line, std::FILE* out, std::FILE* err);

}  // namespace bertshard::client

#endif  // BERTSHARD_CLIENT_PLAN_COMMAND_H_
