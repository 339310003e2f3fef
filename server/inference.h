// File: server/inference.h
// -----------------------------------------------------------------------------
// The coordinator's parts of one inference, apart from the per-job batch queue that Cluster
// keeps: what a job needs from its checkpoint (tokenizer, pooling config, labels); turning an
// Infer or Embed request into the token batch every rank runs (text tokenised with the
// checkpoint's WordPiece vocabulary, truncated on request, padded; tokens validated against the
// plan); sending one numbered forward to every rank at once, returning as soon as any rank fails;
// and making the outputs useful (head predictions, pooled embeddings).
//
// Example:
//   auto assets = LoadJobAssets(plan, checkpoint);
//   ASSIGN_OR_RETURN(PreparedInput in, PrepareInput(nullptr, &request.text(), plan, *assets, 512, false));
//   ForwardOutcome out = ForwardOnAllRanks(ranks, forward, deadline);
//   if (out.failed_rank >= 0) ...  // out.status says what failed there; other calls were cancelled
//
// Thread safety: thread-safe.
#ifndef BERTSHARD_SERVER_INFERENCE_H_
#define BERTSHARD_SERVER_INFERENCE_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "bertshard/v1/coordinator.pb.h"
#include "bertshard/v1/worker.grpc.pb.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "serving/heads.h"
#include "serving/pooling.h"
#include "tokenizer/wordpiece.h"

namespace bertshard::server {

// What serving a job needs from its checkpoint besides the weights, read once on first use.
// Missing pieces are errors only for the requests that need them.
struct JobAssets {
  // The checkpoint's WordPiece tokenizer (vocab.txt, tokenizer_config.json); null when it could
  // not be built, and then `tokenizer_status` says why.
  std::unique_ptr<tokenizer::WordPieceTokenizer> tokenizer;
  absl::Status tokenizer_status;
  // Ids the tokenizer adds ([CLS], [SEP], [PAD]) and [MASK]; -1 when the vocabulary lacks them.
  int64_t cls_id = -1, sep_id = -1, pad_id = -1, mask_id = -1;
  // The sentence-transformers configuration (BertModel jobs): pooling, normalisation, maximum
  // length.
  absl::StatusOr<serving::EmbeddingConfig> embedding = absl::UnknownError("not read");
  // config.json's labels (classification heads).
  absl::StatusOr<serving::Labels> labels = absl::UnknownError("not read");
};

// Reads what it can; never fails as a whole (see JobAssets).
std::shared_ptr<const JobAssets> LoadJobAssets(const v1::ShardPlan& plan, const std::string& checkpoint);
// Assets of a checkpoint that may not be read (`why`: outside the model root): each part says why.
std::shared_ptr<const JobAssets> RefusedJobAssets(const absl::Status& why);

// One request's token batch, ready for the batch queue.
struct PreparedInput {
  v1::TokenInputs tokens;
  std::vector<bool> truncated;        // per text (empty for token input)
  std::vector<int32_t> token_counts;  // per row: tokens with attention 1
};

// The batch an Infer or Embed request asks for: its tokens (attention mask defaulting to ones,
// token types to zeros) or its texts tokenised and padded to the longest. `max_length` bounds each
// text (with [CLS]/[SEP]); longer ones are cut to it when `truncate`, else INVALID_ARGUMENT saying
// both lengths. INVALID_ARGUMENT for input the plan cannot run (says what is valid) and for empty
// texts; FAILED_PRECONDITION for text when the checkpoint has no usable vocab.txt.
absl::StatusOr<PreparedInput> PrepareInput(const v1::TokenInputs* tokens, const v1::TextInput* text,
                                           const v1::ShardPlan& plan, const JobAssets& assets, int64_t max_length,
                                           bool truncate);

// Whether output `name` of `variant` has a sequence axis at dim 1 (so batching pads and cuts it).
bool PerTokenOutput(v1::ModelVariant variant, const std::string& name);

// The head's outputs made readable, one Prediction per batch entry (per choice group for multiple
// choice); empty for BertModel. `top_k` (0: 5) for masked LM heads.
absl::StatusOr<std::vector<v1::Prediction>> Predict(const v1::ShardPlan& plan, const JobAssets& assets,
                                                    const v1::TokenInputs& tokens,
                                                    const google::protobuf::RepeatedPtrField<v1::NamedTensor>& outputs,
                                                    int top_k);

// How a request's embeddings are pooled: its overrides, else the checkpoint's. Resolved before the
// forward, so an unknown pooling or normalize value (INVALID_ARGUMENT) costs no compute.
struct EmbeddingMode {
  serving::Pooling pooling = serving::Pooling::kMean;
  bool normalize = false;
};
absl::StatusOr<EmbeddingMode> ResolveEmbeddingMode(const v1::EmbedRequest& request,
                                                   const serving::EmbeddingConfig& config);

// The embeddings of `tokens` from a BertModel's last_hidden_state, pooled as `mode` says. Fills
// embeddings, pooling and normalized of `response`.
absl::Status PoolEmbeddings(const EmbeddingMode& mode, const v1::TokenInputs& tokens,
                            const google::protobuf::RepeatedPtrField<v1::NamedTensor>& outputs,
                            v1::EmbedResponse* response);

// A rank of a job and the worker serving it.
struct RankStub {
  std::string worker_id;
  std::string address;
  std::shared_ptr<v1::Worker::Stub> stub;
  std::string token;  // sent with each call (the workers' bearer token; empty: none)
  // The worker's gRPC health service on the same channel: whether it answers at all.
  std::shared_ptr<grpc::health::v1::Health::Stub> health;
};

struct ForwardOutcome {
  std::vector<v1::ForwardResponse> responses;  // one per rank when every call succeeded
  int failed_rank = -1;                        // the first rank whose call failed; -1 if none
  grpc::Status status;                         // that call's status, or the abort's reason
  bool aborted = false;                        // ended by ForwardAbort::Abort
};

// Lets another thread end a job's forwards early: when the job fails for another reason (a worker
// went silent), its forward in flight would otherwise wait for the surviving ranks' collective
// timeout. One per job; its forwards run one at a time.
class ForwardAbort {
 public:
  // Cancels the forward in flight, if any, and every later one, each ending with `reason`.
  void Abort(const std::string& reason) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  friend ForwardOutcome ForwardOnAllRanks(const std::vector<RankStub>&, const v1::ForwardRequest&, absl::Time,
                                          ForwardAbort*);
  absl::Mutex mu_;  // taken before a fan-out's own lock, never after
  bool aborted_ ABSL_GUARDED_BY(mu_) = false;
  std::string reason_ ABSL_GUARDED_BY(mu_);
  std::function<void(const std::string&)> in_flight_ ABSL_GUARDED_BY(mu_);  // cancels the running one
};

// Calls Forward(`forward`) on every rank in parallel, each with `deadline`. Returns when all have
// answered, at the first failure (a dead worker answers UNAVAILABLE at once), or when `abort`
// (optional) is aborted: the calls still running are then cancelled and finish in the background,
// owning what they use.
ForwardOutcome ForwardOnAllRanks(const std::vector<RankStub>& ranks, const v1::ForwardRequest& forward,
                                 absl::Time deadline, ForwardAbort* abort = nullptr);

}  // namespace bertshard::server

#endif  // BERTSHARD_SERVER_INFERENCE_H_
