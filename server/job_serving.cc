#include "server/job_serving.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "common/status_macros.h"
#include "planner/model_config.h"
#include "server/input_preparation.h"
#include "server/output_decoding.h"
#include "serving/pooling.h"
#include "serving/rerank.h"

namespace bertshard::server {
namespace {

// Counts a call on a job from its start to its end (the queue-depth gauge).
class CallCount {
 public:
  explicit CallCount(std::atomic<int>* calls) : calls_(calls) { calls_->fetch_add(1); }
  ~CallCount() { calls_->fetch_sub(1); }
  CallCount(const CallCount&) = delete;
  CallCount& operator=(const CallCount&) = delete;

 private:
  std::atomic<int>* const calls_;
};

v1::BatchInfo ToBatchInfo(const BatchResult& result) {
  v1::BatchInfo info;
  info.set_requests(result.batch.requests);
  info.set_rows(result.batch.rows);
  info.set_padded_tokens(result.batch.tokens);
  info.set_queue_seconds(absl::ToDoubleSeconds(result.queued));
  info.set_response_bytes(result.response_bytes);
  info.set_forward_seconds(result.forward_seconds);
  return info;
}

BatchPadding PaddingFor(const v1::ShardPlan& plan) {
  BatchPadding padding;
  padding.pad_token_id = plan.config().pad_token_id();
  if (plan.shard_config().sp_mode() == v1::SPLIT_GATHER) {
    padding.seq_multiple = std::max(1, plan.shard_config().tensor_parallel_size());
  }
  padding.max_seq = plan.config().max_position_embeddings();
  return padding;
}

}  // namespace

JobServing::JobServing(std::string job_id, v1::ShardPlan plan, std::shared_ptr<const JobAssets> assets,
                       ForwardTargets* targets, const JobServingOptions& options)
    : job_id_(std::move(job_id)),
      version_(options.version),
      plan_(std::move(plan)),
      assets_(std::move(assets)),
      targets_(targets),
      forward_timeout_(options.forward_timeout),
      input_bounds_{options.batching.max_batch_tokens, options.batching.max_request_text_bytes},
      queue_(
          options.batching, PaddingFor(plan_),
          [this](const v1::TokenInputs& merged, int micro_batches, absl::Time callers_deadline,
                 const v1::ForwardWant& want) { return Forward(merged, micro_batches, callers_deadline, want); },
          [variant = plan_.variant()](const std::string& name) { return PerTokenOutput(variant, name); },
          options.batch_observer) {}

void JobServing::Close(const std::string& reason) { queue_.Close(reason); }

void JobServing::SetConcurrency(int lanes) { queue_.SetConcurrency(lanes); }

int DefaultMicroBatches(int64_t groups, int64_t seq, int stages) {
  if (stages <= 1 || groups <= 1 || seq < 1) return 1;
  const int64_t rows_each = (kMinMicroBatchTokens + seq - 1) / seq;
  return static_cast<int>(std::clamp<int64_t>(groups / rows_each, 1, 4 * static_cast<int64_t>(stages - 1)));
}

absl::StatusOr<BatchOutputs> JobServing::Forward(const v1::TokenInputs& merged, int micro_batches,
                                                 absl::Time callers_deadline, const v1::ForwardWant& want) {
  // Not the callers' deadline: a rank call cut short by one fails the group (the ranks' order can no
  // longer be vouched for), and the workers finish the forward anyway. Callers whose deadline passes
  // get DEADLINE_EXCEEDED from the batch queue at once; the forward itself is bounded by the
  // server's own limit (the workers' collectives time out well before it when a peer is gone).
  const absl::Time now = absl::Now();
  // How long the batch may wait for a group while the job's is placed again: up to shortly before
  // the callers' latest deadline, so that they hear UNAVAILABLE and why rather than a bare timeout.
  const absl::Duration margin =
      std::max(absl::ZeroDuration(), std::min(absl::Seconds(1), (callers_deadline - now) / 10));
  const absl::Time wait_until = std::min(now + forward_timeout_, callers_deadline - margin);
  ForwardTarget target;
  ForwardOutcome outcome;
  v1::ForwardRequest forward;
  std::string cause;  // why the last attempt's group was lost
  for (int attempt = 0;; ++attempt) {
    // It may have ended while this batch waited (its queue is closed by now too).
    absl::StatusOr<ForwardTarget> next = targets_->NextForward(job_id_, version_, wait_until);
    if (!next.ok()) {
      // After a loss, the job may have ended of it (past --max_restarts) or been cancelled: the
      // callers hear the loss, not only that the job no longer serves.
      if (attempt == 0) return next.status();
      return absl::UnavailableError(absl::StrCat("inference failed: ", cause, "; ", next.status().message()));
    }
    target = *std::move(next);
    // The forward's own bound starts when a group is there: a batch that waited for the group to be
    // placed again must not give the new group only what is left of it (its ranks would time out,
    // and a healthy group be dropped).
    const absl::Time deadline = absl::Now() + forward_timeout_;
    forward.Clear();
    forward.set_sequence(target.sequence);
    forward.set_job_id(target.shard_key.empty() ? job_id_ : target.shard_key);
    *forward.mutable_inputs() = merged;
    // A request that asked for micro-batches runs alone with them; any other batch fills the
    // pipeline of the replica it got.
    const int64_t groups = merged.rows() / std::max<int64_t>(1, merged.choices());
    forward.set_micro_batches(micro_batches > 1 ? micro_batches
                                                : DefaultMicroBatches(groups, merged.seq(), target.pipeline_stages));
    *forward.mutable_want() = want;
    outcome = ForwardOnAllRanks(target.ranks, forward, deadline, target.abort.get());
    // The replica takes its next forward once this one is settled: at once when it answered or
    // refused the request, only after the loss is reported when it failed (else another lane
    // could lease the failing replica while its cause is looked for, and spend its retry on it).
    if (outcome.refused || (!outcome.aborted && outcome.failed_rank < 0)) {
      targets_->EndForward(job_id_, target.replica, target.generation);
    }
    if (outcome.refused) {
      // The workers refused the request itself before any collective, each taking its number: the
      // group serves on (losing it would spend a restart per bad request, and the retry would be
      // refused alike); the batch's callers get the refusal.
      const RankStub& rank = target.ranks[static_cast<size_t>(outcome.failed_rank)];
      return absl::InvalidArgumentError(absl::StrCat("worker ", rank.worker_id, " (rank ", outcome.failed_rank,
                                                     ") refused forward ", forward.sequence(), ": ",
                                                     outcome.status.error_message()));
    }
    if (!outcome.aborted && outcome.failed_rank < 0) break;
    if (outcome.aborted) {
      // The group was lost meanwhile (the scheduler says why) or the job ended.
      cause = outcome.status.error_message();
    } else {
      // The ranks may be out of step now: the group is dropped at once, the survivors unload, and
      // the job is placed again.
      const RankStub& failed = target.ranks[static_cast<size_t>(outcome.failed_rank)];
      const std::string first = absl::StrCat("worker ", failed.worker_id, " (rank ", outcome.failed_rank, ") at ",
                                             failed.address, ": forward ", forward.sequence(),
                                             " failed: ", common::FromGrpcStatus(outcome.status).ToString());
      const UnreachableRank down = FindUnreachableRank(target.ranks);
      cause = down.rank >= 0 ? down.cause : first;
      targets_->LoseGroup(job_id_, target.replica, target.generation, cause,
                          down.rank >= 0 ? target.ranks[static_cast<size_t>(down.rank)].worker_id : "");
    }
    // Lost now (or already, when aborted): the end of a placement that no longer serves.
    targets_->EndForward(job_id_, target.replica, target.generation);
    // Inference is idempotent: the batch is sent once more, on the group that replaces the lost
    // one, before its callers hear of the loss.
    if (attempt >= 1) return absl::UnavailableError(absl::StrCat("inference failed: ", cause));
  }
  // Nothing a worker sends back is served unchecked: a wrong shape would hand callers a wrong
  // slice, a NaN a wrong answer. The job goes on (the ranks are in step), the batch's callers get
  // INTERNAL naming the worker.
  for (size_t r = 0; r < outcome.responses.size(); ++r) {
    if (absl::Status bad = CheckForwardResponse(plan_, merged, want, outcome.responses[r]); !bad.ok()) {
      const RankStub& rank = target.ranks[r];
      return absl::InternalError(
          absl::StrCat("worker ", rank.worker_id, " (rank ", r, ") at ", rank.address, " answered forward ",
                       forward.sequence(), " with outputs that do not fit the request, not served: ", bad.message()));
    }
  }
  BatchOutputs out;
  for (auto& rr : outcome.responses) {
    out.response_bytes += static_cast<int64_t>(rr.ByteSizeLong());
    if (want.has_sparse()) {
      // Every rank of the last stage answers for its slice of the vocabulary, in rank order.
      if (rr.rows_size() > 0) {
        if (absl::Status s = JoinSparseRows(&rr, &out.rows); !s.ok()) {
          return absl::InternalError(absl::StrCat("the workers' sparse rows for forward ", forward.sequence(),
                                                  " do not fit together, not served: ", s.message()));
        }
      }
      out.forward_seconds = std::max(out.forward_seconds, rr.forward_seconds());
      continue;
    }
    // The rank holding the heads answers with the results; a want of nothing leaves its time.
    if (rr.outputs_size() > 0 || rr.rows_size() > 0) {
      out.outputs.assign(std::make_move_iterator(rr.mutable_outputs()->begin()),
                         std::make_move_iterator(rr.mutable_outputs()->end()));
      out.rows.assign(std::make_move_iterator(rr.mutable_rows()->begin()),
                      std::make_move_iterator(rr.mutable_rows()->end()));
      out.forward_seconds = rr.forward_seconds();
    } else if (out.outputs.empty() && out.rows.empty()) {
      out.forward_seconds = std::max(out.forward_seconds, rr.forward_seconds());
    }
  }
  return out;
}

absl::StatusOr<v1::InferResponse> JobServing::Infer(const v1::InferRequest& request, absl::Time deadline,
                                                    const std::function<bool()>& cancelled, const Caller& caller) {
  CallCount count(&calls_);
  const std::shared_ptr<const JobAssets>& assets = assets_;
  if (request.top_k() < 0) return absl::InvalidArgumentError(absl::StrCat("top_k must be >= 0, got ", request.top_k()));
  const absl::Time prepare_start = absl::Now();
  ASSIGN_OR_RETURN(PreparedInput input, PrepareInput(request.has_tokens() ? &request.tokens() : nullptr,
                                                     request.has_text() ? &request.text() : nullptr, plan_, *assets,
                                                     plan_.config().max_position_embeddings(), request.truncate(),
                                                     input_bounds_, request.truncate_from_start()));
  const absl::Duration tokenization = absl::Now() - prepare_start;
  const int64_t batch = input.tokens.rows() / std::max<int64_t>(1, input.tokens.choices());
  if (request.micro_batches() < 0 || request.micro_batches() > batch) {
    return absl::InvalidArgumentError(absl::StrCat("micro_batches must be in 0..batch ", batch));
  }
  const v1::ForwardWant want = InferWant(plan_, *assets, request.top_k(), request.predictions_only());
  ASSIGN_OR_RETURN(BatchResult result,
                   queue_.Submit(input.tokens, deadline, cancelled, request.micro_batches(), want, caller));
  v1::InferResponse response;
  google::protobuf::RepeatedPtrField<v1::NamedTensor> outputs;
  for (auto& t : result.outputs) *outputs.Add() = std::move(t);
  ASSIGN_OR_RETURN(std::vector<v1::Prediction> predictions,
                   Predict(plan_, *assets, input.tokens, outputs, result.rows));
  // Predictions only: what they were made from (classification logits) stays here.
  if (!request.predictions_only()) response.mutable_outputs()->Swap(&outputs);
  for (auto& p : predictions) *response.add_predictions() = std::move(p);
  response.set_forward_seconds(result.forward_seconds);
  *response.mutable_batch() = ToBatchInfo(result);
  response.mutable_batch()->set_tokenization_seconds(absl::ToDoubleSeconds(tokenization));
  for (bool t : input.truncated) response.add_truncated(t);
  *response.mutable_tokens() = std::move(input.tokens);
  return response;
}

absl::StatusOr<v1::EmbedResponse> JobServing::Embed(const v1::EmbedRequest& request, absl::Time deadline,
                                                    const std::function<bool()>& cancelled, const Caller& caller) {
  CallCount count(&calls_);
  const std::shared_ptr<const JobAssets>& assets = assets_;
  // Sparse embeddings read the sentence-transformers files where they can (prompts, the maximum
  // length); a SPLADE checkpoint saved as sentence-transformers' SparseEncoder has modules this
  // reader does not know, and is served as a plain HF checkpoint.
  const serving::EmbeddingConfig plain;
  const serving::EmbeddingConfig* config = assets->embedding.ok() ? &*assets->embedding : &plain;
  EmbeddingMode mode;
  if (request.sparse()) {
    if (plan_.variant() != v1::BERT_FOR_MASKED_LM) {
      return absl::FailedPreconditionError(
          absl::StrCat("job ", request.job_id(), " runs ", planner::HfClassName(plan_.variant()),
                       "; sparse embeddings (SPLADE) need a BertForMaskedLM job, whose LM head scores the vocabulary"));
    }
    if (request.pooling() != v1::POOLING_UNSPECIFIED || request.normalize() != v1::NORMALIZE_UNSPECIFIED ||
        request.dimensions() != 0) {
      return absl::InvalidArgumentError(
          "pooling, normalize and dimensions do not apply to sparse embeddings (SPLADE pools by its maximum)");
    }
  } else {
    if (plan_.variant() != v1::BERT_MODEL) {
      return absl::FailedPreconditionError(
          absl::StrCat("job ", request.job_id(), " runs ", planner::HfClassName(plan_.variant()),
                       ", whose outputs are the head's, not the encoder's hidden states; Embed needs a BertModel job"));
    }
    if (!assets->embedding.ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat("the checkpoint's sentence-transformers configuration: ", assets->embedding.status().message()));
    }
    ASSIGN_OR_RETURN(mode, ResolveEmbeddingMode(request, *config));
    RETURN_IF_ERROR(CheckDimensions(request.dimensions(), plan_.config().hidden_size()));
  }
  // sentence-transformers truncates at max_seq_length (the length the model was trained for); the
  // position table bounds the rest.
  const int64_t max_length = std::min(config->max_seq_length.value_or(plan_.config().max_position_embeddings()),
                                      plan_.config().max_position_embeddings());
  if (request.has_tokens() && !request.prompt_name().empty()) {
    return absl::InvalidArgumentError("prompt_name applies to text input; token rows are taken as they are");
  }
  // The prompt goes before each text, as sentence-transformers puts it; pairs take none.
  const v1::TextInput* text = request.has_text() ? &request.text() : nullptr;
  v1::TextInput prompted;
  if (text != nullptr) {
    ASSIGN_OR_RETURN(const std::string prompt, serving::PromptFor(*config, request.prompt_name()));
    const bool by_default = request.prompt_name().empty();
    const std::string& chosen = by_default ? config->default_prompt_name : request.prompt_name();
    if (!chosen.empty() && text->text_pairs_size() > 0) {
      // As TEI refuses it: sentence-transformers says nothing of where a prompt goes in a pair.
      return absl::InvalidArgumentError(absl::StrCat("a prompt (", by_default ? "the model's default, " : "", chosen,
                                                     ") cannot be applied to text pairs"));
    }
    if (!prompt.empty()) {
      // Refused from its counts first, as PrepareInput would: a huge request is never copied.
      RETURN_IF_ERROR(CheckInputBounds(nullptr, text, input_bounds_));
      prompted = *text;
      for (std::string& t : *prompted.mutable_texts()) t.insert(0, prompt);
      text = &prompted;
    }
  }
  const absl::Time prepare_start = absl::Now();
  ASSIGN_OR_RETURN(PreparedInput input,
                   PrepareInput(request.has_tokens() ? &request.tokens() : nullptr, text, plan_, *assets, max_length,
                                request.truncate(), input_bounds_, request.truncate_from_start()));
  const absl::Duration tokenization = absl::Now() - prepare_start;
  if (request.has_tokens() && input.tokens.seq() > max_length) {
    // Token rows are the caller's own; the embedding model's limit still holds for them.
    for (int32_t n : input.token_counts) {
      if (n > max_length) {
        return absl::InvalidArgumentError(absl::StrCat("a token row has ", n,
                                                       " tokens; the embedding model takes at most ", max_length,
                                                       " (sentence_bert_config.json max_seq_length)"));
      }
    }
  }
  const int64_t rows = input.tokens.rows();
  v1::ForwardWant want;
  if (request.sparse()) {
    want.mutable_sparse();
  } else {
    want = EmbedWant(mode);
  }
  ASSIGN_OR_RETURN(BatchResult result, queue_.Submit(std::move(input.tokens), deadline, cancelled, 0, want, caller));
  v1::EmbedResponse response;
  if (request.sparse()) {
    RETURN_IF_ERROR(SetSparseEmbeddings(rows, &result.rows, &response));
  } else {
    RETURN_IF_ERROR(SetEmbeddings(mode, rows, result.rows, &response));
    RETURN_IF_ERROR(TruncateEmbeddings(request.dimensions(), &response));
  }
  response.set_max_length(static_cast<int32_t>(max_length));
  for (int32_t n : input.token_counts) response.add_token_counts(n);
  for (bool t : input.truncated) response.add_truncated(t);
  *response.mutable_batch() = ToBatchInfo(result);
  response.mutable_batch()->set_tokenization_seconds(absl::ToDoubleSeconds(tokenization));
  return response;
}

absl::StatusOr<v1::RerankResponse> JobServing::Rerank(const v1::RerankRequest& request, absl::Time deadline,
                                                      const std::function<bool()>& cancelled, const Caller& caller) {
  const JobAssets& assets = *assets_;
  // A cross-encoder: one logit per pair (sentence-transformers' CrossEncoder, TEI's re-ranker).
  const size_t labels = assets.labels.ok() ? assets.labels->names.size() : 0;
  if (plan_.variant() != v1::BERT_FOR_SEQUENCE_CLASSIFICATION || labels != 1) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job ", request.job_id(), " runs ", planner::HfClassName(plan_.variant()),
        plan_.variant() == v1::BERT_FOR_SEQUENCE_CLASSIFICATION ? absl::StrCat(" with ", labels, " labels") : "",
        "; Rerank needs a cross-encoder: a BertForSequenceClassification with one label"));
  }
  if (request.query().empty()) return absl::InvalidArgumentError("Rerank needs a query (it is empty)");
  if (request.texts().empty()) return absl::InvalidArgumentError("Rerank needs at least one text to rank");
  // The query goes into every pair: the bounds hold for what the pairs will be before it is
  // copied (a long query and many short texts must not cost their product first).
  int64_t bytes = static_cast<int64_t>(request.query().size()) * request.texts_size();
  for (const std::string& text : request.texts()) bytes += static_cast<int64_t>(text.size());
  RETURN_IF_ERROR(CheckTextBounds(request.texts_size(), bytes, input_bounds_));
  v1::InferRequest infer;
  infer.set_job_id(request.job_id());
  infer.set_truncate(request.truncate());
  infer.set_truncate_from_start(request.truncate_from_start());
  for (int i = 0; i < request.texts_size(); ++i) {
    if (request.texts(i).empty()) return absl::InvalidArgumentError(absl::StrCat("text ", i, " is empty"));
    infer.mutable_text()->add_texts(request.query());
    infer.mutable_text()->add_text_pairs(request.texts(i));
  }
  ASSIGN_OR_RETURN(v1::InferResponse answer, Infer(infer, deadline, cancelled, caller));
  const v1::NamedTensor* logits = nullptr;
  for (const v1::NamedTensor& t : answer.outputs()) {
    if (t.name() == "logits") logits = &t;
  }
  if (logits == nullptr || logits->values_size() != request.texts_size()) {
    return absl::InternalError(absl::StrCat("job ", request.job_id(), " answered without one logit per text"));
  }
  v1::RerankResponse response;
  for (const serving::RankedText& r : serving::RankByScore(logits->values(), request.raw_scores())) {
    v1::RerankResult* result = response.add_results();
    result->set_index(r.index);
    result->set_score(r.score);
  }
  // Each pair's real tokens: its row of the attention mask (PrepareInput always fills it for text).
  const v1::TokenInputs& tokens = answer.tokens();
  const auto& mask = tokens.attention_mask();
  for (int64_t row = 0; row < tokens.rows() && (row + 1) * tokens.seq() <= mask.size(); ++row) {
    response.add_token_counts(static_cast<int32_t>(std::count_if(
        mask.begin() + row * tokens.seq(), mask.begin() + (row + 1) * tokens.seq(), [](int64_t m) { return m != 0; })));
  }
  for (bool t : answer.truncated()) response.add_truncated(t);
  *response.mutable_batch() = answer.batch();
  return response;
}

absl::StatusOr<std::vector<TokenPiece>> JobServing::Tokenize(absl::string_view text, bool add_special_tokens) const {
  const JobAssets& assets = *assets_;
  if (assets.tokenizer == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("the checkpoint has no usable vocabulary to tokenise with: ", assets.tokenizer_status.message()));
  }
  ASSIGN_OR_RETURN(std::vector<std::string> pieces, assets.tokenizer->Tokenize(text));
  std::vector<TokenPiece> tokens;
  tokens.reserve(pieces.size() + 2);
  const auto special = [&](int64_t id) {
    const std::string* token = assets.tokenizer->IdToToken(id);
    tokens.push_back({id, token != nullptr ? *token : std::string(), true});
  };
  if (add_special_tokens && assets.cls_id >= 0) special(assets.cls_id);
  for (std::string& piece : pieces) {
    const std::optional<int64_t> id = assets.tokenizer->TokenToId(piece);
    if (!id.has_value()) {
      return absl::InternalError(absl::StrCat("the tokenizer made '", piece, "', which its vocabulary lacks"));
    }
    tokens.push_back({*id, std::move(piece), false});
  }
  if (add_special_tokens && assets.sep_id >= 0) special(assets.sep_id);
  return tokens;
}

absl::StatusOr<std::string> JobServing::Decode(const std::vector<int64_t>& ids) const {
  const JobAssets& assets = *assets_;
  if (assets.tokenizer == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("the checkpoint has no usable vocabulary to decode with: ", assets.tokenizer_status.message()));
  }
  const int64_t vocab = assets.tokenizer->vocab_size();
  for (const int64_t id : ids) {
    if (id < 0 || assets.tokenizer->IdToToken(id) == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("token id ", id, " is outside the vocabulary (0..", vocab - 1, ")"));
    }
  }
  return assets.tokenizer->Decode(ids);
}

}  // namespace bertshard::server
