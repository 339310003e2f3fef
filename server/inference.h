// File: server/inference.h
// -----------------------------------------------------------------------------
// The coordinator's two halves of one inference, apart from the per-job queue that Cluster keeps:
// turning an InferRequest into the token batch every rank runs (text tokenised with the
// checkpoint's WordPiece vocabulary and padded, tokens validated against the plan), and sending
// one numbered forward to every rank at once, returning as soon as any rank fails.
//
// Example:
//   ASSIGN_OR_RETURN(v1::TokenInputs tokens, PrepareTokens(request, plan, checkpoint, &tokenizer));
//   ForwardOutcome out = ForwardOnAllRanks(ranks, forward, deadline);
//   if (out.failed_rank >= 0) ...  // out.status says what failed there; other calls were cancelled
//
// Thread safety: thread-safe (PrepareTokens mutates only *tokenizer, which the caller guards).
#ifndef BERTSHARD_SERVER_INFERENCE_H_
#define BERTSHARD_SERVER_INFERENCE_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "bertshard/v1/coordinator.pb.h"
#include "bertshard/v1/worker.grpc.pb.h"
#include "tokenizer/wordpiece.h"

namespace bertshard::server {

// The batch `request` asks for: its tokens (attention mask defaulting to ones, token types to
// zeros) or its text tokenised (`*tokenizer` is created from the checkpoint's vocab.txt on first
// use). INVALID_ARGUMENT for input the plan cannot run (says what is valid);
// FAILED_PRECONDITION for text when the checkpoint has no vocab.txt.
absl::StatusOr<v1::TokenInputs> PrepareTokens(const v1::InferRequest& request, const v1::ShardPlan& plan,
                                              const std::string& checkpoint,
                                              std::unique_ptr<tokenizer::WordPieceTokenizer>* tokenizer);

// A rank of a job and the worker serving it.
struct RankStub {
  std::string worker_id;
  std::string address;
  std::shared_ptr<v1::Worker::Stub> stub;
};

struct ForwardOutcome {
  std::vector<v1::ForwardResponse> responses;  // one per rank when every call succeeded
  int failed_rank = -1;                        // the first rank whose call failed; -1 if none
  grpc::Status status;                         // that call's status
};

// Calls Forward(`forward`) on every rank in parallel, each with `deadline`. Returns when all have
// answered, or at the first failure (a dead worker answers UNAVAILABLE at once): the calls still
// running are then cancelled and finish in the background, owning what they use.
ForwardOutcome ForwardOnAllRanks(const std::vector<RankStub>& ranks, const v1::ForwardRequest& forward,
                                 absl::Time deadline);

}  // namespace bertshard::server

#endif  // BERTSHARD_SERVER_INFERENCE_H_
