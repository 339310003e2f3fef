#include "planner/token_check.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace bertshard::planner {

absl::Status CheckInputsAgainstPlan(const TokenView& t, const v1::ShardPlan& plan) {
  const v1::BertConfig& c = plan.config();
  // rows x seq from a request can be anything: multiplied only when it cannot overflow (found by
  // fuzz/infer_request_fuzzer: 18 x 1224979098644774911 was undefined behaviour here).
  int64_t n = 0;
  if (t.rows < 1 || t.seq < 1 || __builtin_mul_overflow(t.rows, t.seq, &n) ||
      t.input_ids.size() != static_cast<size_t>(n) || t.attention_mask.size() != static_cast<size_t>(n) ||
      t.token_type_ids.size() != static_cast<size_t>(n)) {
    return absl::InvalidArgumentError(
        "inputs need rows x seq values in each of input_ids, attention_mask and token_type_ids");
  }
  const bool multiple_choice = plan.variant() == v1::BERT_FOR_MULTIPLE_CHOICE;
  if (multiple_choice ? (t.choices < 1 || t.rows % t.choices != 0) : t.choices != 1) {
    return absl::InvalidArgumentError(
        multiple_choice ? "BertForMultipleChoice takes [batch, choices, seq]: rows must be whole choice groups"
                        : "inputs are [batch, seq]; choices are only for BertForMultipleChoice");
  }
  if (t.seq > c.max_position_embeddings()) {
    return absl::InvalidArgumentError(
        absl::StrCat("sequence length ", t.seq, " exceeds max_position_embeddings ", c.max_position_embeddings()));
  }
  for (int64_t id : t.input_ids) {
    if (id < 0 || id >= c.vocab_size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("input_ids holds ", id, "; ids must be in [0, vocab_size ", c.vocab_size(), ")"));
    }
  }
  for (int64_t type : t.token_type_ids) {
    if (type < 0 || type >= c.type_vocab_size()) {
      return absl::InvalidArgumentError(absl::StrCat("token_type_ids holds ", type,
                                                     "; it must be in [0, type_vocab_size ", c.type_vocab_size(), ")"));
    }
  }
  for (int64_t m : t.attention_mask) {
    if (m != 0 && m != 1) {
      return absl::InvalidArgumentError(absl::StrCat("attention_mask holds ", m, "; it must be 0 or 1"));
    }
  }
  const int tp = std::max(1, plan.shard_config().tensor_parallel_size());
  if (plan.shard_config().sp_mode() == v1::SPLIT_GATHER && t.seq % tp != 0) {
    return absl::InvalidArgumentError(absl::StrCat("split_gather sequence parallelism needs the sequence length (",
                                                   t.seq, ") to be a multiple of tp_size ", tp));
  }
  return absl::OkStatus();
}

}  // namespace bertshard::planner
