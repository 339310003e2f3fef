// File: client/run_command.h
// -----------------------------------------------------------------------------
// `shardctl run --local`: plans a request for a checkpoint, validates the inputs, starts the
// tp x pp rank processes (worker/shard-rank, spawn + exec) on loopback with a Gloo rendezvous,
// waits for them (stopping all of them as soon as one fails: no hangs), and reports per-rank
// timing, peak RSS and checkpoint bytes read (also as JSON with --report FILE). The head stage
// writes the outputs (float32, HF names) to --output.
//
// Input JSON: {"input_ids": [[...]], "attention_mask": [[...]], "token_type_ids": [[...]]}
// ([batch, choices, seq] for BertForMultipleChoice); the mask defaults to ones, token types to
// zeros. Bad input is refused before any rank starts.
//
// Thread safety: not thread-safe (starts and reaps child processes).
#ifndef BERTSHARD_CLIENT_RUN_COMMAND_H_
#define BERTSHARD_CLIENT_RUN_COMMAND_H_

#include <cstdio>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "bertshard/v1/plan.pb.h"
#include "client/command_line.h"

namespace bertshard::client {

// The request flags (PlanRequestFlags) and run's own.
const std::vector<Flag>& RunFlags();

// Validated inputs, flattened row-major to [rows, seq] (rows = batch x choices).
struct RunInputs {
  int64_t batch = 0, choices = 1, seq = 0;
  std::vector<int64_t> input_ids, attention_mask, token_type_ids;
};

// Parses input JSON and checks it against the plan (planner::CheckInputsAgainstPlan): shape ([batch, seq],
// or [batch, choices, seq] for BertForMultipleChoice), integers only, ids < vocab_size, token
// types < type_vocab_size, mask of 0/1, seq <= max_position_embeddings, split_gather
// divisibility. INVALID_ARGUMENT says which.
absl::StatusOr<RunInputs> ParseRunInputs(const std::string& json, const v1::ShardPlan& plan);

// The structural part of that: known fields, integers, rectangular, `depth` 2 ([batch, seq]) or
// 3 ([batch, choices, seq]); 0 reads the depth off input_ids.
absl::StatusOr<RunInputs> ParseTokenJson(const std::string& json, int depth);

int RunRunCommand(const CommandLine& command_line, std::FILE* out, std::FILE* err);

}  // namespace bertshard::client

#endif  // BERTSHARD_CLIENT_RUN_COMMAND_H_
