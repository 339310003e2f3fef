#include "worker/forward_outputs.h"

#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "serving/heads.h"
#include "serving/pooling.h"

namespace bertshard::worker {
namespace {

absl::StatusOr<const v1::NamedTensor*> Output(const v1::ForwardResponse& response, const std::string& name, int dims) {
  for (const v1::NamedTensor& t : response.outputs()) {
    if (t.name() != name) continue;
    if (t.shape_size() != dims) {
      return absl::InternalError(absl::StrCat(name, " has ", t.shape_size(), " dimensions, expected ", dims));
    }
    return &t;
  }
  return absl::InternalError(absl::StrCat("the model returned no ", name));
}

absl::Span<const float> Values(const v1::NamedTensor& t) {
  return {t.values().data(), static_cast<size_t>(t.values_size())};
}

absl::Span<const int64_t> Span(const google::protobuf::RepeatedField<int64_t>& values) {
  return {values.data(), static_cast<size_t>(values.size())};
}

}  // namespace

absl::Status CheckForwardWant(const v1::ForwardWant& want) {
  if (want.has_sparse() && (want.all_outputs() || want.outputs_size() > 0 || want.has_embeddings() ||
                            want.has_masked_lm() || want.has_answer_spans())) {
    return absl::InvalidArgumentError("a sparse want is asked alone: its forward returns no other output");
  }
  if (want.has_embeddings()) RETURN_IF_ERROR(serving::ParsePooling(want.embeddings().pooling()).status());
  if (want.has_masked_lm()) {
    const v1::MaskedLmWant& m = want.masked_lm();
    if (m.output().empty()) return absl::InvalidArgumentError("a masked LM want needs the logits' output name");
    if (m.top_k() < 1) return absl::InvalidArgumentError(absl::StrCat("masked LM top_k must be >= 1, got ", m.top_k()));
    if (m.vocab_limit() < 0) {
      return absl::InvalidArgumentError(absl::StrCat("masked LM vocab_limit must be >= 0, got ", m.vocab_limit()));
    }
  }
  return absl::OkStatus();
}

absl::Status AddSparseRows(absl::Span<const float> weights, int64_t rows, int64_t width, int64_t first_id,
                           v1::ForwardResponse* response) {
  if (rows < 0 || width < 0 || static_cast<int64_t>(weights.size()) != rows * width) {
    return absl::InternalError(
        absl::StrCat("sparse_embedding holds ", weights.size(), " values, not ", rows, " rows x ", width));
  }
  for (int64_t r = 0; r < rows; ++r) {
    v1::ForwardRow* row = response->add_rows();
    const float* w = weights.data() + r * width;
    for (int64_t i = 0; i < width; ++i) {
      if (w[i] == 0.0f) continue;
      row->add_sparse_indices(static_cast<int32_t>(first_id + i));
      row->add_sparse_values(w[i]);
    }
  }
  return absl::OkStatus();
}

absl::Status ApplyForwardWant(const v1::TokenInputs& inputs, const v1::ForwardWant& want,
                              v1::ForwardResponse* response) {
  RETURN_IF_ERROR(CheckForwardWant(want));
  const serving::TokenRows rows{inputs.rows(),
                                inputs.seq(),
                                std::max<int64_t>(1, inputs.choices()),
                                Span(inputs.input_ids()),
                                Span(inputs.attention_mask()),
                                Span(inputs.token_type_ids())};
  const bool per_row = want.has_embeddings() || want.has_masked_lm() || want.has_answer_spans();
  if (per_row) {
    for (int64_t r = 0; r < inputs.rows(); ++r) response->add_rows();
  }
  if (want.has_embeddings()) {
    ASSIGN_OR_RETURN(const serving::Pooling pooling, serving::ParsePooling(want.embeddings().pooling()));
    ASSIGN_OR_RETURN(const v1::NamedTensor* hidden, Output(*response, "last_hidden_state", 3));
    ASSIGN_OR_RETURN(auto vectors, serving::Pool(Values(*hidden), hidden->shape(0), hidden->shape(1), hidden->shape(2),
                                                 rows.attention_mask, pooling, want.embeddings().normalize()));
    if (static_cast<int64_t>(vectors.size()) != inputs.rows()) {
      return absl::InternalError(absl::StrCat("last_hidden_state has ", vectors.size(), " rows for ", inputs.rows()));
    }
    for (size_t r = 0; r < vectors.size(); ++r) {
      response->mutable_rows(static_cast<int>(r))->mutable_embedding()->Add(vectors[r].begin(), vectors[r].end());
    }
  }
  if (want.has_masked_lm()) {
    const v1::MaskedLmWant& m = want.masked_lm();
    ASSIGN_OR_RETURN(const v1::NamedTensor* logits, Output(*response, m.output(), 3));
    serving::FillMaskOptions options;
    options.top_k = m.top_k();
    options.vocab_limit = m.vocab_limit();
    ASSIGN_OR_RETURN(auto fills,
                     serving::MaskedLmTopK(Values(*logits), logits->shape(2), rows, m.mask_token_id(), options));
    for (size_t r = 0; r < fills.size(); ++r) {
      for (const serving::MaskFill& fill : fills[r]) {
        v1::MaskTop* top = response->mutable_rows(static_cast<int>(r))->add_masks();
        top->set_position(fill.position);
        for (const serving::TokenScore& t : fill.top) {
          top->add_ids(t.id);
          top->add_scores(t.score);
        }
      }
    }
  }
  if (want.has_answer_spans()) {
    ASSIGN_OR_RETURN(const v1::NamedTensor* start, Output(*response, "start_logits", 2));
    ASSIGN_OR_RETURN(const v1::NamedTensor* end, Output(*response, "end_logits", 2));
    serving::QaOptions options;
    options.cls_token_id = want.answer_spans().cls_token_id();
    options.special_ids.assign(want.answer_spans().special_ids().begin(), want.answer_spans().special_ids().end());
    ASSIGN_OR_RETURN(auto spans, serving::QuestionAnswerSpans(Values(*start), Values(*end), rows, options));
    for (size_t r = 0; r < spans.size(); ++r) {
      v1::SpanResult* span = response->mutable_rows(static_cast<int>(r))->mutable_span();
      span->set_start(spans[r].start);
      span->set_end(spans[r].end);
      span->set_score(spans[r].score);
    }
  }
  if (!want.all_outputs()) {
    const std::set<std::string> wanted(want.outputs().begin(), want.outputs().end());
    auto* outputs = response->mutable_outputs();
    for (int i = outputs->size() - 1; i >= 0; --i) {
      if (wanted.count(outputs->Get(i).name()) == 0) outputs->DeleteSubrange(i, 1);
    }
  }
  return absl::OkStatus();
}

}  // namespace bertshard::worker
