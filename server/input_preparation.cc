#include "server/input_preparation.h"

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "planner/token_check.h"

namespace bertshard::server {

absl::Status CheckTextBounds(int64_t texts, int64_t bytes, const InputBounds& bounds) {
  // Every text takes [CLS], a token and [SEP] at least (empty texts are refused).
  if (bounds.max_tokens > 0 && texts > bounds.max_tokens / 3) {
    return absl::InvalidArgumentError(absl::StrCat("the request has ", texts, " texts, which take at least ", texts * 3,
                                                   " tokens; one batch holds ", bounds.max_tokens,
                                                   " (--max_batch_tokens); send fewer texts"));
  }
  if (bounds.max_text_bytes > 0 && bytes > bounds.max_text_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("the request's texts are ", bytes, " bytes together, more than ",
                                                   bounds.max_text_bytes,
                                                   " (--max_request_text_bytes); send less text"));
  }
  return absl::OkStatus();
}

absl::Status CheckInputBounds(const v1::TokenInputs* tokens, const v1::TextInput* text, const InputBounds& bounds) {
  if (text != nullptr) {
    int64_t bytes = 0;
    for (const std::string& t : text->texts()) bytes += static_cast<int64_t>(t.size());
    for (const std::string& t : text->text_pairs()) bytes += static_cast<int64_t>(t.size());
    return CheckTextBounds(text->texts_size(), bytes, bounds);
  }
  if (tokens == nullptr) return absl::OkStatus();
  const int64_t rows = tokens->rows();
  const int64_t seq = tokens->seq();
  // The shape first, with the plan check's words (planner/token_check.h, which runs later on what
  // is left), so a caller gets the same message either way; then the size.
  int64_t n = 0;
  auto size_ok = [&n](int size, bool may_be_empty) { return size == n || (may_be_empty && size == 0); };
  if (rows < 1 || seq < 1 || __builtin_mul_overflow(rows, seq, &n) || !size_ok(tokens->input_ids_size(), false) ||
      !size_ok(tokens->attention_mask_size(), true) || !size_ok(tokens->token_type_ids_size(), true)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "inputs need rows x seq values in each of input_ids, attention_mask and token_type_ids (the last two may be "
        "empty): got rows ",
        rows, ", seq ", seq, ", ", tokens->input_ids_size(), " input_ids, ", tokens->attention_mask_size(),
        " attention_mask, ", tokens->token_type_ids_size(), " token_type_ids"));
  }
  if (bounds.max_tokens > 0 && n > bounds.max_tokens) {
    return absl::InvalidArgumentError(absl::StrCat("the request has rows x seq = ", rows, " x ", seq, " = ", n,
                                                   " tokens, more than one batch may hold (", bounds.max_tokens,
                                                   ", --max_batch_tokens); send fewer or shorter rows"));
  }
  return absl::OkStatus();
}

absl::StatusOr<PreparedInput> PrepareInput(const v1::TokenInputs* tokens, const v1::TextInput* text,
                                           const v1::ShardPlan& plan, const JobAssets& assets, int64_t max_length,
                                           bool truncate, const InputBounds& bounds, bool truncate_from_start) {
  RETURN_IF_ERROR(CheckInputBounds(tokens, text, bounds));
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
      options.from_left = truncate_from_start;
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
  RETURN_IF_ERROR(planner::CheckInputsAgainstPlan({out.rows(), out.seq(), std::max<int64_t>(1, out.choices()),
                                                   out.input_ids(), out.attention_mask(), out.token_type_ids()},
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

}  // namespace bertshard::server
