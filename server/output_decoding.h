// File: server/output_decoding.h
// -----------------------------------------------------------------------------
// Making a forward's results useful to the caller, on the coordinator's side: what to ask the
// workers for (a ForwardWant: the raw outputs only when the caller wants them, else just what the
// answer is made from), and turning what comes back into head predictions (token texts from the
// tokenizer, label names from the checkpoint) or pooled embeddings. The numerics (softmax, top-k,
// spans, pooling) ran on the worker holding the last stage (worker/forward_outputs.h), with the
// same functions this file once called itself.
//
// Example:
//   v1::ForwardWant want = InferWant(plan, assets, request.top_k(), request.predictions_only());
//   ... run the forward with `want` ...
//   ASSIGN_OR_RETURN(auto predictions, Predict(plan, assets, tokens, outputs, rows));
//
// Failure model: results that do not fit the request (a missing output, a row count that is not
// the batch's, a wrong shape, a NaN or infinity) are INTERNAL: no caller gets a wrong answer. Unknown enum values in a
// request are INVALID_ARGUMENT, resolved before the forward so they cost no compute.
//
// Thread safety: thread-safe (no state).
#ifndef BERTSHARD_SERVER_OUTPUT_DECODING_H_
#define BERTSHARD_SERVER_OUTPUT_DECODING_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "bertshard/v1/coordinator.pb.h"
#include "bertshard/v1/worker.pb.h"
#include "server/job_assets.h"
#include "serving/pooling.h"

namespace bertshard::server {

// Whether output `name` of `variant` has a sequence axis at dim 1 (so batching pads and cuts it).
bool PerTokenOutput(v1::ModelVariant variant, const std::string& name);

// Whether one rank's answer to a forward of `inputs` fits it before anything of it is served: every
// output with a batch axis of the batch's rows (rows / choices for multiple-choice logits), the
// padded seq at dim 1 for per-token outputs, the hidden size where the plan fixes it, as many
// values as its shape says; per-row results one per row when `want` asks for them (embeddings of
// the hidden size, [MASK] positions and ids inside the row and vocabulary, no more than top_k,
// sparse ids ascending inside the vocabulary with weights > 0);
// and every float finite. INTERNAL saying what is wrong (the caller names the worker).
absl::Status CheckForwardResponse(const v1::ShardPlan& plan, const v1::TokenInputs& inputs, const v1::ForwardWant& want,
                                  const v1::ForwardResponse& response);

// What an Infer asks the workers for: every output unless `predictions_only`, and what Predict
// reads: the masked LM's `top_k` (0: 5) per [MASK], the best answer span per row, or the
// classification logits.
v1::ForwardWant InferWant(const v1::ShardPlan& plan, const JobAssets& assets, int top_k, bool predictions_only);

// The head's results made readable, one Prediction per batch entry (per choice group for multiple
// choice); empty for BertModel. `outputs` and `rows` (one per row of `tokens`) came back for
// InferWant's want.
absl::StatusOr<std::vector<v1::Prediction>> Predict(const v1::ShardPlan& plan, const JobAssets& assets,
                                                    const v1::TokenInputs& tokens,
                                                    const google::protobuf::RepeatedPtrField<v1::NamedTensor>& outputs,
                                                    const std::vector<v1::ForwardRow>& rows);

// How a request's embeddings are pooled: its overrides, else the checkpoint's. Resolved before the
// forward, so an unknown pooling or normalize value (INVALID_ARGUMENT) costs no compute.
struct EmbeddingMode {
  serving::Pooling pooling = serving::Pooling::kMean;
  bool normalize = false;
};
absl::StatusOr<EmbeddingMode> ResolveEmbeddingMode(const v1::EmbedRequest& request,
                                                   const serving::EmbeddingConfig& config);

// What an Embed asks the workers for: the pooled vectors only.
v1::ForwardWant EmbedWant(const EmbeddingMode& mode);

// Fills embeddings, pooling and normalized of `response` from `rows` (EmbedWant's results, one
// per row of the request: INTERNAL otherwise).
absl::Status SetEmbeddings(const EmbeddingMode& mode, int64_t expected_rows, const std::vector<v1::ForwardRow>& rows,
                           v1::EmbedResponse* response);

// SPLADE (EmbedRequest.sparse): every rank of the last stage answers with sparse rows for its own
// slice of the vocabulary. Appends `response`'s rows to `rows` (moves them in when `rows` is empty;
// a response without rows, from another stage, adds nothing), joining each row's entries. Called
// in rank order, the ids stay ascending; INTERNAL when they would not (slices that overlap) or the
// row counts differ.
absl::Status JoinSparseRows(v1::ForwardResponse* response, std::vector<v1::ForwardRow>* rows);

// Fills `response`'s embeddings from the joined sparse rows (one per row of the request: INTERNAL
// otherwise), taking their entries.
absl::Status SetSparseEmbeddings(int64_t expected_rows, std::vector<v1::ForwardRow>* rows, v1::EmbedResponse* response);

// Matryoshka (EmbedRequest.dimensions): keeps the first `dimensions` values of every embedding,
// L2-normalised again when `response` is normalised (normalising the whole vector and then its cut
// equals normalising the cut: the scale drops out). 0: unchanged. INVALID_ARGUMENT below 0 or past
// `hidden_size` (checked before the forward by the caller too, so that the refusal costs nothing).
absl::Status CheckDimensions(int32_t dimensions, int64_t hidden_size);
absl::Status TruncateEmbeddings(int32_t dimensions, v1::EmbedResponse* response);

}  // namespace bertshard::server

#endif  // BERTSHARD_SERVER_OUTPUT_DECODING_H_
