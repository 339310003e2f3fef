// File: worker/forward_outputs.h
// -----------------------------------------------------------------------------
// What the rank holding a forward's outputs sends back to the coordinator: the outputs the
// ForwardRequest's want names, and the small per-row results it asks for (pooled embeddings,
// masked LM top-k ids and probabilities, the best answer span), computed here with the very
// functions the coordinator used before (serving/pooling.h, serving/heads.h), so that a 12 MB
// last_hidden_state crosses the network as 49 KB of vectors. Token texts and label names are the
// coordinator's (it has the tokenizer and the labels); results carry ids and scores. SPLADE's
// sparse rows come from every tensor-parallel rank of the last stage, each for its own slice of
// the vocabulary (AddSparseRows). Plain
// protobuf and floats: no LibTorch here.
//
// Example:
//   RETURN_IF_ERROR(CheckForwardWant(request.want()));  // on every rank, before the forward
//   ... forward; the last stage's outputs into response->outputs ...
//   RETURN_IF_ERROR(ApplyForwardWant(request.inputs(), request.want(), response));
//
// Failure model: a want the functions cannot honour is INVALID_ARGUMENT from CheckForwardWant
// (before any compute); outputs that do not fit the want (missing, wrong shape) are INTERNAL from
// ApplyForwardWant.
//
// Thread safety: thread-safe (no state).
#ifndef BERTSHARD_WORKER_FORWARD_OUTPUTS_H_
#define BERTSHARD_WORKER_FORWARD_OUTPUTS_H_

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "bertshard/v1/worker.pb.h"

namespace bertshard::worker {

// INVALID_ARGUMENT for an unknown pooling, a masked LM want with top_k < 1 or vocab_limit < 0, or
// one without its output's name, and a sparse want with anything else asked beside it.
absl::Status CheckForwardWant(const v1::ForwardWant& want);

// SparseWant's rows: `weights` is this rank's "sparse_embedding" ([rows, width] row-major, for the
// vocabulary ids first_id .. first_id + width - 1); adds one ForwardRow per row to `response` with
// the ids whose weight is not 0, ascending. INTERNAL for a size that is not rows x width.
absl::Status AddSparseRows(absl::Span<const float> weights, int64_t rows, int64_t width, int64_t first_id,
                           v1::ForwardResponse* response);

// Adds to `response` (holding the model's outputs for `inputs`) one ForwardRow per input row when
// `want` asks for per-row results, then drops the outputs `want` does not ask for.
absl::Status ApplyForwardWant(const v1::TokenInputs& inputs, const v1::ForwardWant& want,
                              v1::ForwardResponse* response);

}  // namespace bertshard::worker

#endif  // BERTSHARD_WORKER_FORWARD_OUTPUTS_H_
