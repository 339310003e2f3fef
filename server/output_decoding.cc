#include "server/output_decoding.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "serving/heads.h"

namespace bertshard::server {

bool PerTokenOutput(v1::ModelVariant variant, const std::string& name) {
  if (name == "last_hidden_state" || name == "prediction_logits" || name == "start_logits" || name == "end_logits") {
    return true;
  }
  if (name != "logits") return false;
  return variant == v1::BERT_FOR_MASKED_LM || variant == v1::BERT_LM_HEAD_MODEL ||
         variant == v1::BERT_FOR_TOKEN_CLASSIFICATION;
}

namespace {

bool MaskedLmHead(v1::ModelVariant variant) {
  return variant == v1::BERT_FOR_MASKED_LM || variant == v1::BERT_LM_HEAD_MODEL || variant == v1::BERT_FOR_PRE_TRAINING;
}

// The ids the tokenizer adds, which are never a token label or part of an answer.
std::vector<int64_t> SpecialIds(const JobAssets& assets) {
  std::vector<int64_t> specials;
  for (int64_t id : {assets.cls_id, assets.sep_id, assets.pad_id}) {
    if (id >= 0) specials.push_back(id);
  }
  return specials;
}

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

absl::Status CheckRows(const std::vector<v1::ForwardRow>& rows, int64_t expected, const char* what) {
  if (static_cast<int64_t>(rows.size()) != expected) {
    return absl::InternalError(
        absl::StrCat("the workers returned ", what, " for ", rows.size(), " rows, expected ", expected));
  }
  return absl::OkStatus();
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

namespace {

// The index of the first value that is NaN or infinite; -1 if none.
template <typename Values>
int64_t FirstNonFinite(const Values& values) {
  for (int i = 0; i < values.size(); ++i) {
    if (!std::isfinite(values.Get(i))) return i;
  }
  return -1;
}

absl::Status CheckOutput(const v1::ShardPlan& plan, const v1::TokenInputs& inputs, const v1::NamedTensor& t) {
  const int64_t rows = inputs.rows();
  const int64_t choices = std::max<int64_t>(1, inputs.choices());
  if (t.shape_size() == 0) return absl::InternalError(absl::StrCat("output ", t.name(), " has no batch axis"));
  int64_t numel = 1;
  for (int64_t d : t.shape()) {
    if (d < 0 || (d > 0 && numel > INT32_MAX / d)) {
      return absl::InternalError(absl::StrCat("output ", t.name(), " has a bad dimension ", d));
    }
    numel *= d;
  }
  if (numel != t.values_size()) {
    return absl::InternalError(
        absl::StrCat("output ", t.name(), " has ", t.values_size(), " values for ", numel, " elements of its shape"));
  }
  if (t.shape(0) != rows && !(choices > 1 && t.shape(0) * choices == rows)) {
    return absl::InternalError(absl::StrCat("output ", t.name(), " has dim 0 = ", t.shape(0), " for a batch of ", rows,
                                            " rows (", choices, " choices)"));
  }
  if (PerTokenOutput(plan.variant(), t.name()) && (t.shape_size() < 2 || t.shape(1) != inputs.seq())) {
    return absl::InternalError(
        absl::StrCat("per-token output ", t.name(), " has no dim 1 = the batch's seq ", inputs.seq()));
  }
  const int64_t hidden = plan.config().hidden_size();
  if ((t.name() == "last_hidden_state" && (t.shape_size() != 3 || t.shape(2) != hidden)) ||
      (t.name() == "pooler_output" && (t.shape_size() != 2 || t.shape(1) != hidden))) {
    return absl::InternalError(absl::StrCat("output ", t.name(), " is not ", hidden, " wide (hidden_size)"));
  }
  if (const int64_t bad = FirstNonFinite(t.values()); bad >= 0) {
    return absl::InternalError(
        absl::StrCat("output ", t.name(), " has a non-finite value (", t.values(bad), " at element ", bad, ")"));
  }
  return absl::OkStatus();
}

absl::Status CheckRow(const v1::ShardPlan& plan, const v1::TokenInputs& inputs, const v1::ForwardWant& want,
                      const v1::ForwardRow& row, int64_t r) {
  const std::string where = absl::StrCat("row ", r, "'s result");
  if (want.has_embeddings()) {
    if (row.embedding_size() != plan.config().hidden_size()) {
      return absl::InternalError(absl::StrCat(where, " has an embedding of ", row.embedding_size(), " values, not ",
                                              plan.config().hidden_size(), " (hidden_size)"));
    }
    if (FirstNonFinite(row.embedding()) >= 0) return absl::InternalError(where + " has a non-finite embedding");
  }
  const int top_k = std::max(1, want.masked_lm().top_k());
  for (const v1::MaskTop& mask : row.masks()) {
    if (mask.position() < 0 || mask.position() >= inputs.seq() || mask.ids_size() != mask.scores_size() ||
        mask.ids_size() > top_k) {
      return absl::InternalError(absl::StrCat(where, " has a [MASK] entry that does not fit the row (position ",
                                              mask.position(), ", ", mask.ids_size(), " ids, ", mask.scores_size(),
                                              " scores, top_k ", top_k, ")"));
    }
    for (int64_t id : mask.ids()) {
      if (id < 0 || id >= plan.config().vocab_size()) {
        return absl::InternalError(absl::StrCat(where, " predicts id ", id, ", outside the vocabulary"));
      }
    }
    if (FirstNonFinite(mask.scores()) >= 0) return absl::InternalError(where + " has a non-finite [MASK] score");
  }
  if (row.sparse_indices_size() != row.sparse_values_size() || (!want.has_sparse() && row.sparse_indices_size() > 0)) {
    return absl::InternalError(absl::StrCat(where, " has ", row.sparse_indices_size(), " sparse ids and ",
                                            row.sparse_values_size(), " weights", want.has_sparse() ? "" : " unasked"));
  }
  for (int i = 0; i < row.sparse_indices_size(); ++i) {
    const int32_t id = row.sparse_indices(i);
    const float w = row.sparse_values(i);
    if (id < 0 || id >= plan.config().vocab_size() || (i > 0 && id <= row.sparse_indices(i - 1)) || !std::isfinite(w) ||
        w <= 0) {
      return absl::InternalError(absl::StrCat(where, " has a sparse entry that does not fit (id ", id, ", weight ", w,
                                              "): ids ascend within the vocabulary, weights are finite and > 0"));
    }
  }
  if (row.has_span() && row.span().start() >= 0) {
    const v1::SpanResult& span = row.span();
    if (span.end() < span.start() || span.end() >= inputs.seq() || !std::isfinite(span.score())) {
      return absl::InternalError(absl::StrCat(where, " has an answer span that does not fit the row (", span.start(),
                                              "..", span.end(), ", score ", span.score(), ")"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckForwardResponse(const v1::ShardPlan& plan, const v1::TokenInputs& inputs, const v1::ForwardWant& want,
                                  const v1::ForwardResponse& response) {
  for (const v1::NamedTensor& t : response.outputs()) RETURN_IF_ERROR(CheckOutput(plan, inputs, t));
  if (response.rows_size() == 0) return absl::OkStatus();
  if (!want.has_embeddings() && !want.has_masked_lm() && !want.has_answer_spans() && !want.has_sparse()) {
    return absl::InternalError(absl::StrCat(response.rows_size(), " per-row results that were not asked for"));
  }
  if (response.rows_size() != inputs.rows()) {
    return absl::InternalError(
        absl::StrCat("per-row results for ", response.rows_size(), " rows of the batch's ", inputs.rows()));
  }
  for (int r = 0; r < response.rows_size(); ++r) RETURN_IF_ERROR(CheckRow(plan, inputs, want, response.rows(r), r));
  return absl::OkStatus();
}

v1::ForwardWant InferWant(const v1::ShardPlan& plan, const JobAssets& assets, int top_k, bool predictions_only) {
  v1::ForwardWant want;
  want.set_all_outputs(!predictions_only);
  switch (plan.variant()) {
    case v1::BERT_FOR_MASKED_LM:
    case v1::BERT_LM_HEAD_MODEL:
    case v1::BERT_FOR_PRE_TRAINING:
      if (assets.mask_id >= 0) {
        v1::MaskedLmWant* masked = want.mutable_masked_lm();
        masked->set_output(plan.variant() == v1::BERT_FOR_PRE_TRAINING ? "prediction_logits" : "logits");
        masked->set_mask_token_id(assets.mask_id);
        masked->set_top_k(top_k > 0 ? top_k : 5);
        if (assets.tokenizer != nullptr) masked->set_vocab_limit(assets.tokenizer->vocab_size());
      }
      if (plan.variant() == v1::BERT_FOR_PRE_TRAINING) want.add_outputs("seq_relationship_logits");
      break;
    case v1::BERT_FOR_NEXT_SENTENCE_PREDICTION:
    case v1::BERT_FOR_SEQUENCE_CLASSIFICATION:
    case v1::BERT_FOR_MULTIPLE_CHOICE:
    case v1::BERT_FOR_TOKEN_CLASSIFICATION:
      want.add_outputs("logits");
      break;
    case v1::BERT_FOR_QUESTION_ANSWERING: {
      v1::AnswerSpanWant* spans = want.mutable_answer_spans();
      spans->set_cls_token_id(assets.cls_id);
      for (int64_t id : SpecialIds(assets)) spans->add_special_ids(id);
      break;
    }
    default:
      break;  // BertModel: no predictions
  }
  return want;
}

absl::StatusOr<std::vector<v1::Prediction>> Predict(const v1::ShardPlan& plan, const JobAssets& assets,
                                                    const v1::TokenInputs& tokens,
                                                    const google::protobuf::RepeatedPtrField<v1::NamedTensor>& outputs,
                                                    const std::vector<v1::ForwardRow>& rows) {
  std::vector<v1::Prediction> predictions;
  const serving::TokenRows token_rows{
      tokens.rows(),
      tokens.seq(),
      1,
      {tokens.input_ids().data(), static_cast<size_t>(tokens.input_ids_size())},
      {tokens.attention_mask().data(), static_cast<size_t>(tokens.attention_mask_size())},
      {tokens.token_type_ids().data(), static_cast<size_t>(tokens.token_type_ids_size())}};
  auto token_text = [&assets](int64_t id) -> std::string {
    const std::string* t = assets.tokenizer == nullptr ? nullptr : assets.tokenizer->IdToToken(id);
    return t == nullptr ? absl::StrCat("<", id, ">") : *t;
  };
  auto labels = [&](int64_t classes) -> std::vector<std::string> {
    if (assets.labels.ok() && static_cast<int64_t>(assets.labels->names.size()) == classes) return assets.labels->names;
    std::vector<std::string> names;
    for (int64_t i = 0; i < classes; ++i) names.push_back(absl::StrCat("LABEL_", i));
    return names;
  };
  if (MaskedLmHead(plan.variant())) {
    predictions.resize(static_cast<size_t>(tokens.rows()));
    if (assets.mask_id >= 0) {
      RETURN_IF_ERROR(CheckRows(rows, tokens.rows(), "masked LM top-k"));
      for (size_t r = 0; r < rows.size(); ++r) {
        for (const v1::MaskTop& fill : rows[r].masks()) {
          if (fill.ids_size() != fill.scores_size()) {
            return absl::InternalError(absl::StrCat("masked LM top-k of row ", r, " has ", fill.ids_size(), " ids and ",
                                                    fill.scores_size(), " scores"));
          }
          v1::MaskPrediction* m = predictions[r].add_masks();
          m->set_position(fill.position());
          for (int j = 0; j < fill.ids_size(); ++j) {
            v1::TokenScore* ts = m->add_top();
            ts->set_id(fill.ids(j));
            ts->set_token(token_text(fill.ids(j)));
            ts->set_score(static_cast<float>(fill.scores(j)));
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
    return predictions;
  }
  switch (plan.variant()) {
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
      ASSIGN_OR_RETURN(auto per_row, serving::ClassifyTokens(Values(*logits), token_rows, logits->shape(2),
                                                             labels(logits->shape(2)), SpecialIds(assets)));
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
      RETURN_IF_ERROR(CheckRows(rows, tokens.rows(), "answer spans"));
      predictions.resize(rows.size());
      for (size_t r = 0; r < rows.size(); ++r) {
        const v1::SpanResult& span = rows[r].span();
        if (!rows[r].has_span() || span.start() < 0) continue;  // no candidate in this row
        if (span.end() < span.start() || span.end() >= tokens.seq()) {
          return absl::InternalError(absl::StrCat("answer span ", span.start(), "..", span.end(), " of row ", r,
                                                  " is outside its ", tokens.seq(), " tokens"));
        }
        v1::AnswerSpan* a = predictions[r].mutable_answer();
        a->set_start(span.start());
        a->set_end(span.end());
        a->set_score(static_cast<float>(span.score()));
        if (assets.tokenizer != nullptr) {
          const auto* ids = tokens.input_ids().data() + r * static_cast<size_t>(tokens.seq());
          a->set_text(assets.tokenizer->Decode(std::vector<int64_t>(ids + span.start(), ids + span.end() + 1)));
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

v1::ForwardWant EmbedWant(const EmbeddingMode& mode) {
  v1::ForwardWant want;
  want.mutable_embeddings()->set_pooling(serving::PoolingName(mode.pooling));
  want.mutable_embeddings()->set_normalize(mode.normalize);
  return want;
}

absl::Status SetEmbeddings(const EmbeddingMode& mode, int64_t expected_rows, const std::vector<v1::ForwardRow>& rows,
                           v1::EmbedResponse* response) {
  RETURN_IF_ERROR(CheckRows(rows, expected_rows, "embeddings"));
  for (const v1::ForwardRow& row : rows) *response->add_embeddings()->mutable_values() = row.embedding();
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

absl::Status CheckDimensions(int32_t dimensions, int64_t hidden_size) {
  if (dimensions < 0 || dimensions > hidden_size) {
    return absl::InvalidArgumentError(absl::StrCat("dimensions must be in 1..", hidden_size,
                                                   " (the model's hidden size), or 0 for all; got ", dimensions));
  }
  return absl::OkStatus();
}

absl::Status TruncateEmbeddings(int32_t dimensions, v1::EmbedResponse* response) {
  if (dimensions == 0) return absl::OkStatus();
  for (v1::Embedding& embedding : *response->mutable_embeddings()) {
    auto* values = embedding.mutable_values();
    RETURN_IF_ERROR(CheckDimensions(dimensions, values->size()));
    values->Truncate(dimensions);
    if (!response->normalized()) continue;
    double norm = 0;
    for (const float v : *values) norm += static_cast<double>(v) * v;
    norm = std::sqrt(norm);
    // torch.nn.functional.normalize's eps: an all-zero cut stays zero instead of NaN.
    const double scale = 1.0 / std::max(norm, 1e-12);
    for (float& v : *values) v = static_cast<float>(v * scale);
  }
  return absl::OkStatus();
}

absl::Status JoinSparseRows(v1::ForwardResponse* response, std::vector<v1::ForwardRow>* rows) {
  if (response->rows_size() == 0) return absl::OkStatus();  // a rank of another stage
  if (rows->empty()) {
    rows->assign(std::make_move_iterator(response->mutable_rows()->begin()),
                 std::make_move_iterator(response->mutable_rows()->end()));
    return absl::OkStatus();
  }
  if (static_cast<size_t>(response->rows_size()) != rows->size()) {
    return absl::InternalError(
        absl::StrCat("a rank returned sparse rows for ", response->rows_size(), " rows, another for ", rows->size()));
  }
  for (size_t r = 0; r < rows->size(); ++r) {
    v1::ForwardRow& into = (*rows)[r];
    const v1::ForwardRow& from = response->rows(static_cast<int>(r));
    if (into.sparse_indices_size() > 0 && from.sparse_indices_size() > 0 &&
        from.sparse_indices(0) <= into.sparse_indices(into.sparse_indices_size() - 1)) {
      return absl::InternalError(absl::StrCat("the ranks' vocabulary slices overlap in row ", r, " (id ",
                                              from.sparse_indices(0), " after ",
                                              into.sparse_indices(into.sparse_indices_size() - 1), ")"));
    }
    into.mutable_sparse_indices()->Add(from.sparse_indices().begin(), from.sparse_indices().end());
    into.mutable_sparse_values()->Add(from.sparse_values().begin(), from.sparse_values().end());
  }
  return absl::OkStatus();
}

absl::Status SetSparseEmbeddings(int64_t expected_rows, std::vector<v1::ForwardRow>* rows,
                                 v1::EmbedResponse* response) {
  RETURN_IF_ERROR(CheckRows(*rows, expected_rows, "sparse embeddings"));
  for (v1::ForwardRow& row : *rows) {
    v1::Embedding* e = response->add_embeddings();
    e->mutable_indices()->Swap(row.mutable_sparse_indices());
    e->mutable_values()->Swap(row.mutable_sparse_values());
  }
  return absl::OkStatus();
}

}  // namespace bertshard::server
