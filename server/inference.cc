#include "server/inference.h"

#include <algorithm>
#include <optional>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/grpc_auth.h"
#include "common/status_macros.h"
#include "grpcpp/grpcpp.h"
#include "planner/token_check.h"

namespace bertshard::server {

std::shared_ptr<const JobAssets> LoadJobAssets(const v1::ShardPlan& plan, const std::string& checkpoint) {
  auto assets = std::make_shared<JobAssets>();
  auto options = tokenizer::ReadTokenizerConfig(checkpoint);
  if (!options.ok()) {
    assets->tokenizer_status = options.status();
  } else {
    auto tok = tokenizer::WordPieceTokenizer::FromVocabFile(checkpoint + "/vocab.txt", *options);
    if (tok.ok()) {
      assets->tokenizer = *std::move(tok);
    } else {
      assets->tokenizer_status = tok.status();
    }
  }
  if (assets->tokenizer != nullptr) {
    auto id = [&](absl::string_view token) { return assets->tokenizer->TokenToId(token).value_or(-1); };
    assets->cls_id = id("[CLS]");
    assets->sep_id = id("[SEP]");
    assets->pad_id = id("[PAD]");
    assets->mask_id = id("[MASK]");
  }
  if (assets->pad_id < 0) assets->pad_id = plan.config().pad_token_id();
  if (plan.variant() == v1::BERT_MODEL) assets->embedding = serving::ReadEmbeddingConfig(checkpoint);
  assets->labels = serving::ReadLabels(checkpoint);
  return assets;
}

std::shared_ptr<const JobAssets> RefusedJobAssets(const absl::Status& why) {
  auto assets = std::make_shared<JobAssets>();
  assets->tokenizer_status = why;
  assets->embedding = why;
  assets->labels = why;
  return assets;
}

absl::StatusOr<PreparedInput> PrepareInput(const v1::TokenInputs* tokens, const v1::TextInput* text,
                                           const v1::ShardPlan& plan, const JobAssets& assets, int64_t max_length,
                                           bool truncate) {
  PreparedInput prepared;
  v1::TokenInputs& out = prepared.tokens;
  if (text != nullptr) {
    if (plan.variant() == v1::BERT_FOR_MULTIPLE_CHOICE) {
      return absl::InvalidArgumentError("text input is not supported for BertForMultipleChoice; send tokens");
    }
    if (text->texts_size() == 0) return absl::InvalidArgumentError("text input needs at least one text");
    if (text->text_pairs_size() > 0 && text->text_pairs_size() != text->texts_size()) {
      return absl::InvalidArgumentError(absl::StrCat("text_pairs needs one entry per text: ", text->texts_size(),
                                                     " texts, ", text->text_pairs_size(), " pairs"));
    }
    if (assets.tokenizer == nullptr) {
      return absl::FailedPreconditionError(
          absl::StrCat("text input needs the checkpoint's vocab.txt: ", assets.tokenizer_status.message()));
    }
    std::vector<tokenizer::Encoding> encodings;
    int64_t longest = 0;
    for (int i = 0; i < text->texts_size(); ++i) {
      std::optional<absl::string_view> pair;
      if (text->text_pairs_size() > 0) pair = text->text_pairs(i);
      tokenizer::EncodeOptions options;
      options.max_length = max_length;
      options.truncation = truncate;
      auto e = assets.tokenizer->Encode(text->texts(i), pair, options);
      if (!e.ok()) {
        return absl::Status(e.status().code(), absl::StrCat("text ", i, ": ", e.status().message()));
      }
      // A segment that is empty after cleaning (nothing but whitespace or control characters)
      // would run as its [SEP] alone: almost certainly a client bug, so it is refused. Segment 0
      // holds [CLS] and its [SEP]; segment 1 its [SEP].
      const auto type0 = std::count(e->token_type_ids.begin(), e->token_type_ids.end(), 0);
      const auto type1 = static_cast<decltype(type0)>(e->token_type_ids.size()) - type0;
      if (type0 <= 2) {
        return absl::InvalidArgumentError(absl::StrCat("text ", i, " is empty (no tokens after cleaning)"));
      }
      if (pair.has_value() && type1 <= 1) {
        return absl::InvalidArgumentError(absl::StrCat("text_pairs ", i, " is empty (no tokens after cleaning)"));
      }
      longest = std::max<int64_t>(longest, static_cast<int64_t>(e->input_ids.size()));
      prepared.truncated.push_back(e->truncated);
      prepared.token_counts.push_back(static_cast<int32_t>(e->input_ids.size()));
      encodings.push_back(*std::move(e));
    }
    // Pad the batch to its longest text; padding is masked out.
    const int tp = std::max(1, plan.shard_config().tensor_parallel_size());
    if (plan.shard_config().sp_mode() == v1::SPLIT_GATHER) longest = (longest + tp - 1) / tp * tp;
    if (longest > plan.config().max_position_embeddings()) {
      return absl::InvalidArgumentError(absl::StrCat("the padded batch (", longest,
                                                     " tokens) exceeds max_position_embeddings ",
                                                     plan.config().max_position_embeddings()));
    }
    out.set_rows(static_cast<int64_t>(encodings.size()));
    out.set_seq(longest);
    out.set_choices(1);
    for (const auto& e : encodings) {
      for (int64_t i = 0; i < longest; ++i) {
        const bool real = i < static_cast<int64_t>(e.input_ids.size());
        out.add_input_ids(real ? e.input_ids[static_cast<size_t>(i)] : assets.pad_id);
        out.add_token_type_ids(real ? e.token_type_ids[static_cast<size_t>(i)] : 0);
        out.add_attention_mask(real ? 1 : 0);
      }
    }
  } else if (tokens != nullptr) {
    out = *tokens;
    if (out.attention_mask_size() == 0) out.mutable_attention_mask()->Resize(out.input_ids_size(), 1);
    if (out.token_type_ids_size() == 0) out.mutable_token_type_ids()->Resize(out.input_ids_size(), 0);
  } else {
    return absl::InvalidArgumentError("the request needs tokens or text");
  }
  RETURN_IF_ERROR(planner::CheckTokens({out.rows(), out.seq(), std::max<int64_t>(1, out.choices()), out.input_ids(),
                                        out.attention_mask(), out.token_type_ids()},
                                       plan));
  if (text == nullptr) {
    for (int64_t r = 0; r < out.rows(); ++r) {
      int32_t count = 0;
      for (int64_t i = 0; i < out.seq(); ++i) count += out.attention_mask(static_cast<int>(r * out.seq() + i)) != 0;
      if (count == 0)
        return absl::InvalidArgumentError(absl::StrCat("token row ", r, " has no token with attention 1"));
      prepared.token_counts.push_back(count);
    }
  }
  return prepared;
}

bool PerTokenOutput(v1::ModelVariant variant, const std::string& name) {
  if (name == "last_hidden_state" || name == "prediction_logits" || name == "start_logits" || name == "end_logits") {
    return true;
  }
  if (name != "logits") return false;
  return variant == v1::BERT_FOR_MASKED_LM || variant == v1::BERT_LM_HEAD_MODEL ||
         variant == v1::BERT_FOR_TOKEN_CLASSIFICATION;
}

namespace {

const v1::NamedTensor* FindOutput(const google::protobuf::RepeatedPtrField<v1::NamedTensor>& outputs,
                                  const std::string& name) {
  for (const auto& t : outputs) {
    if (t.name() == name) return &t;
  }
  return nullptr;
}

absl::StatusOr<const v1::NamedTensor*> Output(const google::protobuf::RepeatedPtrField<v1::NamedTensor>& outputs,
                                              const std::string& name, size_t dims) {
  const v1::NamedTensor* t = FindOutput(outputs, name);
  if (t == nullptr) return absl::InternalError(absl::StrCat("the model returned no ", name));
  if (static_cast<size_t>(t->shape_size()) != dims) {
    return absl::InternalError(absl::StrCat(name, " has ", t->shape_size(), " dimensions, expected ", dims));
  }
  return t;
}

absl::Span<const float> Values(const v1::NamedTensor& t) {
  return {t.values().data(), static_cast<size_t>(t.values_size())};
}

void SetLabel(const serving::LabelScore& from, v1::LabelScore* to) {
  to->set_id(static_cast<int32_t>(from.id));
  to->set_label(from.label);
  to->set_score(static_cast<float>(from.score));
}

absl::Status AddLabels(const std::vector<std::vector<serving::LabelScore>>& rows,
                       std::vector<v1::Prediction>* predictions) {
  predictions->resize(std::max(predictions->size(), rows.size()));
  for (size_t r = 0; r < rows.size(); ++r) {
    for (const auto& l : rows[r]) SetLabel(l, (*predictions)[r].add_labels());
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::vector<v1::Prediction>> Predict(const v1::ShardPlan& plan, const JobAssets& assets,
                                                    const v1::TokenInputs& tokens,
                                                    const google::protobuf::RepeatedPtrField<v1::NamedTensor>& outputs,
                                                    int top_k) {
  std::vector<v1::Prediction> predictions;
  const serving::TokenRows rows{tokens.rows(),
                                tokens.seq(),
                                1,
                                {tokens.input_ids().data(), static_cast<size_t>(tokens.input_ids_size())},
                                {tokens.attention_mask().data(), static_cast<size_t>(tokens.attention_mask_size())},
                                {tokens.token_type_ids().data(), static_cast<size_t>(tokens.token_type_ids_size())}};
  auto token_text = [&assets](int64_t id) -> std::string {
    const std::string* t = assets.tokenizer == nullptr ? nullptr : assets.tokenizer->IdToToken(id);
    return t == nullptr ? absl::StrCat("<", id, ">") : *t;
  };
  std::vector<int64_t> specials;
  for (int64_t id : {assets.cls_id, assets.sep_id, assets.pad_id}) {
    if (id >= 0) specials.push_back(id);
  }
  auto labels = [&](int64_t classes) -> std::vector<std::string> {
    if (assets.labels.ok() && static_cast<int64_t>(assets.labels->names.size()) == classes) return assets.labels->names;
    std::vector<std::string> names;
    for (int64_t i = 0; i < classes; ++i) names.push_back(absl::StrCat("LABEL_", i));
    return names;
  };
  switch (plan.variant()) {
    case v1::BERT_FOR_MASKED_LM:
    case v1::BERT_LM_HEAD_MODEL:
    case v1::BERT_FOR_PRE_TRAINING: {
      const std::string name = plan.variant() == v1::BERT_FOR_PRE_TRAINING ? "prediction_logits" : "logits";
      ASSIGN_OR_RETURN(const v1::NamedTensor* logits, Output(outputs, name, 3));
      predictions.resize(static_cast<size_t>(tokens.rows()));
      if (assets.mask_id >= 0) {
        serving::FillMaskOptions options;
        options.top_k = top_k > 0 ? top_k : 5;
        if (assets.tokenizer != nullptr) options.vocab_limit = assets.tokenizer->vocab_size();
        ASSIGN_OR_RETURN(auto fills, serving::MaskedLmTopK(Values(*logits), logits->shape(2), rows, assets.mask_id,
                                                           options, token_text));
        for (size_t r = 0; r < fills.size(); ++r) {
          for (const auto& fill : fills[r]) {
            v1::MaskPrediction* m = predictions[r].add_masks();
            m->set_position(fill.position);
            for (const auto& t : fill.top) {
              v1::TokenScore* ts = m->add_top();
              ts->set_id(t.id);
              ts->set_token(t.token);
              ts->set_score(static_cast<float>(t.score));
            }
          }
        }
      }
      if (plan.variant() == v1::BERT_FOR_PRE_TRAINING) {
        ASSIGN_OR_RETURN(const v1::NamedTensor* nsp, Output(outputs, "seq_relationship_logits", 2));
        ASSIGN_OR_RETURN(auto scored,
                         serving::Classify(Values(*nsp), nsp->shape(0), nsp->shape(1), serving::NextSentenceLabels()));
        RETURN_IF_ERROR(AddLabels(scored, &predictions));
      }
      break;
    }
    case v1::BERT_FOR_NEXT_SENTENCE_PREDICTION:
    case v1::BERT_FOR_SEQUENCE_CLASSIFICATION:
    case v1::BERT_FOR_MULTIPLE_CHOICE: {
      ASSIGN_OR_RETURN(const v1::NamedTensor* logits, Output(outputs, "logits", 2));
      const int64_t classes = logits->shape(1);
      std::vector<std::string> names = plan.variant() == v1::BERT_FOR_NEXT_SENTENCE_PREDICTION
                                           ? serving::NextSentenceLabels()
                                       : plan.variant() == v1::BERT_FOR_MULTIPLE_CHOICE ? serving::IndexLabels(classes)
                                                                                        : labels(classes);
      serving::ScoreFunction function = serving::ScoreFunction::kSoftmax;
      if (plan.variant() == v1::BERT_FOR_SEQUENCE_CLASSIFICATION && assets.labels.ok()) {
        function = serving::DefaultScoreFunction(*assets.labels);
      }
      ASSIGN_OR_RETURN(auto scored, serving::Classify(Values(*logits), logits->shape(0), classes, names, function));
      RETURN_IF_ERROR(AddLabels(scored, &predictions));
      break;
    }
    case v1::BERT_FOR_TOKEN_CLASSIFICATION: {
      ASSIGN_OR_RETURN(const v1::NamedTensor* logits, Output(outputs, "logits", 3));
      ASSIGN_OR_RETURN(auto per_row, serving::ClassifyTokens(Values(*logits), rows, logits->shape(2),
                                                             labels(logits->shape(2)), specials));
      predictions.resize(per_row.size());
      for (size_t r = 0; r < per_row.size(); ++r) {
        for (const auto& t : per_row[r]) {
          v1::TokenLabel* tl = predictions[r].add_token_labels();
          tl->set_position(t.position);
          tl->set_token(token_text(t.token_id));
          tl->mutable_label()->set_id(static_cast<int32_t>(t.label_id));
          tl->mutable_label()->set_label(t.label);
          tl->mutable_label()->set_score(static_cast<float>(t.score));
        }
      }
      break;
    }
    case v1::BERT_FOR_QUESTION_ANSWERING: {
      ASSIGN_OR_RETURN(const v1::NamedTensor* start, Output(outputs, "start_logits", 2));
      ASSIGN_OR_RETURN(const v1::NamedTensor* end, Output(outputs, "end_logits", 2));
      serving::QaOptions options;
      options.cls_token_id = assets.cls_id;
      options.special_ids = specials;
      ASSIGN_OR_RETURN(auto spans, serving::QuestionAnswerSpans(Values(*start), Values(*end), rows, options));
      predictions.resize(spans.size());
      for (size_t r = 0; r < spans.size(); ++r) {
        if (spans[r].start < 0) continue;  // no candidate in this row
        v1::AnswerSpan* a = predictions[r].mutable_answer();
        a->set_start(spans[r].start);
        a->set_end(spans[r].end);
        a->set_score(static_cast<float>(spans[r].score));
        if (assets.tokenizer != nullptr) {
          const auto* ids = tokens.input_ids().data() + r * static_cast<size_t>(tokens.seq());
          a->set_text(assets.tokenizer->Decode(std::vector<int64_t>(ids + spans[r].start, ids + spans[r].end + 1)));
        }
      }
      break;
    }
    default:
      break;  // BertModel: the hidden states are the output (see Embed)
  }
  return predictions;
}

absl::StatusOr<EmbeddingMode> ResolveEmbeddingMode(const v1::EmbedRequest& request,
                                                   const serving::EmbeddingConfig& config) {
  EmbeddingMode mode{config.pooling, config.normalize};
  switch (request.pooling()) {
    case v1::POOLING_UNSPECIFIED:
      break;
    case v1::POOLING_MEAN:
      mode.pooling = serving::Pooling::kMean;
      break;
    case v1::POOLING_CLS:
      mode.pooling = serving::Pooling::kCls;
      break;
    case v1::POOLING_MAX:
      mode.pooling = serving::Pooling::kMax;
      break;
    case v1::POOLING_MEAN_SQRT_LEN:
      mode.pooling = serving::Pooling::kMeanSqrtLen;
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("unknown pooling ", request.pooling(),
                       " (valid: MEAN, CLS, MAX, MEAN_SQRT_LEN, or unset for the checkpoint's)"));
  }
  switch (request.normalize()) {
    case v1::NORMALIZE_UNSPECIFIED:
      break;
    case v1::NORMALIZE_ON:
      mode.normalize = true;
      break;
    case v1::NORMALIZE_OFF:
      mode.normalize = false;
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("unknown normalize ", request.normalize(), " (valid: ON, OFF, unset)"));
  }
  return mode;
}

absl::Status PoolEmbeddings(const EmbeddingMode& mode, const v1::TokenInputs& tokens,
                            const google::protobuf::RepeatedPtrField<v1::NamedTensor>& outputs,
                            v1::EmbedResponse* response) {
  ASSIGN_OR_RETURN(const v1::NamedTensor* hidden, Output(outputs, "last_hidden_state", 3));
  ASSIGN_OR_RETURN(auto vectors,
                   serving::Pool(Values(*hidden), hidden->shape(0), hidden->shape(1), hidden->shape(2),
                                 {tokens.attention_mask().data(), static_cast<size_t>(tokens.attention_mask_size())},
                                 mode.pooling, mode.normalize));
  for (auto& v : vectors) response->add_embeddings()->mutable_values()->Add(v.begin(), v.end());
  switch (mode.pooling) {
    case serving::Pooling::kMean:
      response->set_pooling(v1::POOLING_MEAN);
      break;
    case serving::Pooling::kCls:
      response->set_pooling(v1::POOLING_CLS);
      break;
    case serving::Pooling::kMax:
      response->set_pooling(v1::POOLING_MAX);
      break;
    case serving::Pooling::kMeanSqrtLen:
      response->set_pooling(v1::POOLING_MEAN_SQRT_LEN);
      break;
  }
  response->set_normalized(mode.normalize);
  return absl::OkStatus();
}

namespace {

// What the calls of one fan-out share; every call's completion holds it, so it outlives an early
// return.
struct FanOut {
  FanOut(size_t n, const v1::ForwardRequest& forward) : request(forward), responses(n), contexts(n) {}
  const v1::ForwardRequest request;
  absl::Mutex mu;
  std::vector<v1::ForwardResponse> responses;                  // each written by its own call only
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts;  // set before any call starts
  size_t answered ABSL_GUARDED_BY(mu) = 0;
  int failed_rank ABSL_GUARDED_BY(mu) = -1;
  grpc::Status failure ABSL_GUARDED_BY(mu);
  bool aborted ABSL_GUARDED_BY(mu) = false;
};

}  // namespace

void ForwardAbort::Abort(const std::string& reason) {
  absl::MutexLock lock(&mu_);
  if (aborted_) return;
  aborted_ = true;
  reason_ = reason;
  if (in_flight_) in_flight_(reason);
}

ForwardOutcome ForwardOnAllRanks(const std::vector<RankStub>& ranks, const v1::ForwardRequest& forward,
                                 absl::Time deadline, ForwardAbort* abort) {
  auto fan = std::make_shared<FanOut>(ranks.size(), forward);
  if (abort != nullptr) {
    absl::MutexLock lock(&abort->mu_);
    if (abort->aborted_) {
      ForwardOutcome outcome;
      outcome.aborted = true;
      outcome.status = grpc::Status(grpc::StatusCode::UNAVAILABLE, abort->reason_);
      return outcome;
    }
    abort->in_flight_ = [fan](const std::string& reason) {
      absl::MutexLock fan_lock(&fan->mu);
      if (fan->failed_rank >= 0 || fan->aborted) return;
      fan->aborted = true;
      fan->failure = grpc::Status(grpc::StatusCode::UNAVAILABLE, reason);
    };
  }
  for (auto& context : fan->contexts) {
    context = std::make_unique<grpc::ClientContext>();
    context->set_deadline(absl::ToChronoTime(deadline));
  }
  for (size_t r = 0; r < ranks.size(); ++r) common::AttachToken(fan->contexts[r].get(), ranks[r].token);
  for (size_t r = 0; r < ranks.size(); ++r) {
    // gRPC's callback API: no thread per rank and forward. The completion owns the fan-out and the
    // stub (so the channel), so after an early return the remaining calls end by cancellation on
    // their own.
    ranks[r].stub->async()->Forward(fan->contexts[r].get(), &fan->request, &fan->responses[r],
                                    [fan, stub = ranks[r].stub, r](grpc::Status status) {
                                      absl::MutexLock lock(&fan->mu);
                                      ++fan->answered;
                                      if (!status.ok() && fan->failed_rank < 0) {
                                        fan->failed_rank = static_cast<int>(r);
                                        fan->failure = std::move(status);
                                      }
                                    });
  }
  ForwardOutcome outcome;
  {
    absl::MutexLock lock(&fan->mu);
    auto settled = [&fan, n = ranks.size()] { return fan->failed_rank >= 0 || fan->aborted || fan->answered == n; };
    fan->mu.Await(absl::Condition(&settled));
    if (fan->failed_rank >= 0 || fan->aborted) {
      for (auto& context : fan->contexts) context->TryCancel();
      outcome.failed_rank = fan->aborted ? -1 : fan->failed_rank;
      outcome.aborted = fan->aborted;
      outcome.status = fan->failure;
    } else {
      outcome.responses = std::move(fan->responses);
    }
  }
  if (abort != nullptr) {
    // Off the fan-out's lock: Abort takes its own lock first, then the fan-out's.
    absl::MutexLock lock(&abort->mu_);
    abort->in_flight_ = nullptr;
  }
  return outcome;
}

}  // namespace bertshard::server
