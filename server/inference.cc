#include "server/inference.h"

#include <algorithm>
#include <optional>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/status_macros.h"
#include "grpcpp/grpcpp.h"
#include "planner/token_check.h"

namespace bertshard::server {

absl::StatusOr<v1::TokenInputs> PrepareTokens(const v1::InferRequest& request, const v1::ShardPlan& plan,
                                              const std::string& checkpoint,
                                              std::unique_ptr<tokenizer::WordPieceTokenizer>* tokenizer) {
  v1::TokenInputs tokens;
  if (request.has_text()) {
    if (plan.variant() == v1::BERT_FOR_MULTIPLE_CHOICE) {
      return absl::InvalidArgumentError("text input is not supported for BertForMultipleChoice; send tokens");
    }
    if (request.text().texts_size() == 0) return absl::InvalidArgumentError("text input needs at least one text");
    if (request.text().text_pairs_size() > 0 && request.text().text_pairs_size() != request.text().texts_size()) {
      return absl::InvalidArgumentError("text_pairs needs one entry per text");
    }
    if (*tokenizer == nullptr) {
      ASSIGN_OR_RETURN(tokenizer::TokenizerOptions options, tokenizer::ReadTokenizerConfig(checkpoint));
      auto tok = tokenizer::WordPieceTokenizer::FromVocabFile(checkpoint + "/vocab.txt", options);
      if (!tok.ok()) {
        return absl::FailedPreconditionError(absl::StrCat("text input needs the checkpoint's vocab.txt: ", tok.status().message()));
      }
      *tokenizer = *std::move(tok);
    }
    std::vector<tokenizer::Encoding> encodings;
    int64_t longest = 0;
    for (int i = 0; i < request.text().texts_size(); ++i) {
      std::optional<absl::string_view> pair;
      if (request.text().text_pairs_size() > 0) pair = request.text().text_pairs(i);
      ASSIGN_OR_RETURN(tokenizer::Encoding e,
                       (*tokenizer)->Encode(request.text().texts(i), pair, plan.config().max_position_embeddings()));
      longest = std::max<int64_t>(longest, static_cast<int64_t>(e.input_ids.size()));
      encodings.push_back(std::move(e));
    }
    // Pad the batch to its longest text; padding is masked out.
    const int tp = std::max(1, plan.shard_config().tensor_parallel_size());
    if (plan.shard_config().sp_mode() == v1::SPLIT_GATHER) longest = (longest + tp - 1) / tp * tp;
    if (longest > plan.config().max_position_embeddings()) {
      return absl::InvalidArgumentError("the padded batch exceeds max_position_embeddings");
    }
    tokens.set_rows(static_cast<int64_t>(encodings.size()));
    tokens.set_seq(longest);
    tokens.set_choices(1);
    for (const auto& e : encodings) {
      for (int64_t i = 0; i < longest; ++i) {
        const bool real = i < static_cast<int64_t>(e.input_ids.size());
        tokens.add_input_ids(real ? e.input_ids[static_cast<size_t>(i)] : plan.config().pad_token_id());
        tokens.add_token_type_ids(real ? e.token_type_ids[static_cast<size_t>(i)] : 0);
        tokens.add_attention_mask(real ? 1 : 0);
      }
    }
  } else if (request.has_tokens()) {
    tokens = request.tokens();
    if (tokens.attention_mask_size() == 0) tokens.mutable_attention_mask()->Resize(tokens.input_ids_size(), 1);
    if (tokens.token_type_ids_size() == 0) tokens.mutable_token_type_ids()->Resize(tokens.input_ids_size(), 0);
  } else {
    return absl::InvalidArgumentError("infer needs tokens or text");
  }
  RETURN_IF_ERROR(planner::CheckTokens({tokens.rows(), tokens.seq(), std::max<int64_t>(1, tokens.choices()),
                                        tokens.input_ids(), tokens.attention_mask(), tokens.token_type_ids()},
                                       plan));
  return tokens;
}

namespace {

// What the calls of one fan-out share; each call's thread holds it, so it outlives an early return.
struct FanOut {
  explicit FanOut(size_t n) : responses(n), contexts(n) {}
  absl::Mutex mu;
  std::vector<v1::ForwardResponse> responses;                 // each written by its own call only
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts;  // set before any call starts
  size_t answered ABSL_GUARDED_BY(mu) = 0;
  int failed_rank ABSL_GUARDED_BY(mu) = -1;
  grpc::Status failure ABSL_GUARDED_BY(mu);
};

}  // namespace

ForwardOutcome ForwardOnAllRanks(const std::vector<RankStub>& ranks, const v1::ForwardRequest& forward,
                                 absl::Time deadline) {
  auto fan = std::make_shared<FanOut>(ranks.size());
  auto request = std::make_shared<const v1::ForwardRequest>(forward);
  for (auto& context : fan->contexts) {
    context = std::make_unique<grpc::ClientContext>();
    context->set_deadline(absl::ToChronoTime(deadline));
  }
  for (size_t r = 0; r < ranks.size(); ++r) {
    // Detached: after an early return the remaining calls end by cancellation on their own.
    std::thread([fan, request, stub = ranks[r].stub, r] {
      v1::ForwardResponse response;
      const grpc::Status status = stub->Forward(fan->contexts[r].get(), *request, &response);
      absl::MutexLock lock(&fan->mu);
      fan->responses[r] = std::move(response);
      ++fan->answered;
      if (!status.ok() && fan->failed_rank < 0) {
        fan->failed_rank = static_cast<int>(r);
        fan->failure = status;
      }
    }).detach();
  }
  ForwardOutcome outcome;
  absl::MutexLock lock(&fan->mu);
  auto settled = [&fan, n = ranks.size()] {
    return fan->failed_rank >= 0 || fan->answered == n;
  };
  fan->mu.Await(absl::Condition(&settled));
  if (fan->failed_rank >= 0) {
    for (auto& context : fan->contexts) context->TryCancel();
    outcome.failed_rank = fan->failed_rank;
    outcome.status = fan->failure;
    return outcome;
  }
  outcome.responses = std::move(fan->responses);
  return outcome;
}

}  // namespace bertshard::server
