// File: server/input_preparation.h
// -----------------------------------------------------------------------------
// Turning an Infer or Embed request into the token batch every rank runs: text tokenised with the
// checkpoint's WordPiece vocabulary (server/job_assets.h), truncated on request and padded to the
// longest; token rows completed (attention mask ones, token types zeros); either validated against
// the plan (planner/token_check.h) before anything is queued.
//
// Example:
//   ASSIGN_OR_RETURN(PreparedInput in, PrepareInput(nullptr, &request.text(), plan, *assets, 512, false));
//   // in.tokens: [rows, seq] row-major; in.token_counts: real tokens per row.
//
// Failure model: bad input is INVALID_ARGUMENT saying what is valid; text for a checkpoint
// without a usable vocabulary is FAILED_PRECONDITION. Nothing here aborts.
//
// Thread safety: thread-safe (no state).
#ifndef BERTSHARD_SERVER_INPUT_PREPARATION_H_
#define BERTSHARD_SERVER_INPUT_PREPARATION_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "bertshard/v1/coordinator.pb.h"
#include "server/job_assets.h"

namespace bertshard::server {

// One request's token batch, ready for the batch queue.
struct PreparedInput {
  v1::TokenInputs tokens;
  std::vector<bool> truncated;        // per text (empty for token input)
  std::vector<int32_t> token_counts;  // per row: tokens with attention 1
};

// What one request may be, checked from the message's own counts before anything is copied,
// scanned or tokenised (a 96 MB token request costs its parse, not seconds and gigabytes more).
struct InputBounds {
  // rows x seq of token input; texts x 3 (the fewest tokens a text can take) for text. 0: none.
  int64_t max_tokens = 0;
  // The bytes of every text and text pair together. 0: none.
  int64_t max_text_bytes = 0;
};

// The batch an Infer or Embed request asks for: its tokens (attention mask defaulting to ones,
// token types to zeros) or its texts tokenised and padded to the longest. `max_length` bounds each
// text (with [CLS]/[SEP]); longer ones are cut to it when `truncate`, else INVALID_ARGUMENT saying
// both lengths. INVALID_ARGUMENT for input the plan cannot run (says what is valid) and for empty
// texts; FAILED_PRECONDITION for text when the checkpoint has no usable vocab.txt. A request
// over `bounds` is INVALID_ARGUMENT before any work on its contents (saying the limit and flag).
// `truncate_from_start`: texts are cut from their start instead (their last tokens kept).
absl::StatusOr<PreparedInput> PrepareInput(const v1::TokenInputs* tokens, const v1::TextInput* text,
                                           const v1::ShardPlan& plan, const JobAssets& assets, int64_t max_length,
                                           bool truncate, const InputBounds& bounds = {},
                                           bool truncate_from_start = false);

// The checks of PrepareInput on the message's counts alone (no element read): token input with
// rows >= 1, seq >= 1, arrays of rows x seq (mask and types may be empty) and rows x seq within
// bounds.max_tokens; text within the text and byte bounds.
absl::Status CheckInputBounds(const v1::TokenInputs* tokens, const v1::TextInput* text, const InputBounds& bounds);
// Its text checks from the counts alone: `texts` texts (a pair counts once) of `bytes` bytes
// together, texts and pairs. For a request that has not been made into a TextInput yet (Rerank's
// pairs repeat the query: checked before it is copied once per text).
absl::Status CheckTextBounds(int64_t texts, int64_t bytes, const InputBounds& bounds);

}  // namespace bertshard::server

#endif  // BERTSHARD_SERVER_INPUT_PREPARATION_H_
