// File: serving/heads.h
// -----------------------------------------------------------------------------
// Readable answers from the raw outputs of BERT's heads (row-major float logits with HF names, as
// the ranks return them) and the tokens that produced them, following the transformers 4.40
// pipelines: fill-mask top-k for the masked LM, sorted label scores for sequence classification,
// next sentence prediction and multiple choice, one label per real token for token
// classification, and the best answer span for question answering. Plain C++ on float buffers:
// the coordinator that uses it links no LibTorch. Scores are computed in double.
//
// Example:
//   TokenRows tokens;
//   tokens.rows = 1; tokens.seq = 8; tokens.input_ids = ids; tokens.attention_mask = mask;
//   ASSIGN_OR_RETURN(auto fills, MaskedLmTopK(logits, vocab_size, tokens, mask_id, FillMaskOptions(),
//                                             [&](int64_t id) { return vocab[id]; }));
//   ASSIGN_OR_RETURN(Labels labels, ReadLabels(checkpoint_dir));
//   ASSIGN_OR_RETURN(auto scores, Classify(logits, rows, labels.names.size(), labels.names,
//                                          DefaultScoreFunction(labels)));
//
// Thread safety: thread-safe (no state; `id_to_token` is called from the calling thread only).
#ifndef BERTSHARD_SERVING_HEADS_H_
#define BERTSHARD_SERVING_HEADS_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/checkpoint_dir.h"
#include "common/token_view.h"

namespace bertshard::serving {

// The token batch the model ran, row-major [rows, seq]; an empty attention_mask means all ones,
// an empty token_type_ids all zeros. `choices` is not read here.
using TokenRows = common::TokenView;

// A classification checkpoint's labels, as transformers' PretrainedConfig reads config.json.
struct Labels {
  // names[i] names label i; there are config.num_labels of them: len(id2label) when config.json
  // has id2label (which then names every id), else its num_labels, else 2, named "LABEL_<i>" as
  // HF names them.
  std::vector<std::string> names;
  bool multi_label = false;  // problem_type is "multi_label_classification"
};

// Reads `checkpoint_dir`/config.json. INVALID_ARGUMENT, naming the file, when it cannot be read,
// is not a JSON object, or has an id2label whose keys are not the integers 0..n-1 (JSON keys are
// strings: "0", "1", ...) or whose values are not strings. Read through `dir`'s descriptor, a
// regular file of at most its max_json_bytes (common/checkpoint_dir.h).
absl::StatusOr<Labels> ReadLabels(const common::CheckpointDir& dir);
// As above, `checkpoint_dir` opened unconfined.
absl::StatusOr<Labels> ReadLabels(const std::string& checkpoint_dir);

// Next sentence prediction's two classes (BertForNextSentencePrediction / the pre-training head's
// seq_relationship_logits): index 0 means sentence B follows sentence A.
std::vector<std::string> NextSentenceLabels();  // {"IsNext", "NotNext"}
// "0", "1", ..., n-1: names for multiple choice, whose classes are the choices.
std::vector<std::string> IndexLabels(int64_t n);

enum class ScoreFunction { kSoftmax, kSigmoid };
// What transformers' TextClassificationPipeline applies by default: sigmoid for multi-label
// problems or a single output (regression-style heads), softmax otherwise.
ScoreFunction DefaultScoreFunction(const Labels& labels);

struct LabelScore {
  int64_t id = 0;
  std::string label;
  double score = 0;
};

// For each of `rows` rows of `logits` ([rows, classes]: sequence classification, next sentence
// prediction with classes 2, multiple choice as [batch, choices]): every class with its score,
// sorted by score descending (ties keep id order, as HF's stable sort). INVALID_ARGUMENT when
// rows < 0, classes < 1, `label_names` does not hold `classes` names or `logits` does not hold
// rows * classes values.
absl::StatusOr<std::vector<std::vector<LabelScore>>> Classify(absl::Span<const float> logits, int64_t rows,
                                                              int64_t classes,
                                                              const std::vector<std::string>& label_names,
                                                              ScoreFunction function = ScoreFunction::kSoftmax);

struct TokenLabel {
  int64_t position = 0;  // in the row
  int64_t token_id = 0;
  int64_t label_id = 0;
  std::string label;
  double score = 0;  // softmax probability of the label
};

// Token classification (`logits` [rows, seq, classes]): for each row, the best label (first on
// ties, as argmax) and its softmax probability at every position with attention 1 whose token is
// not in `special_ids` (the ids the tokenizer adds: [CLS], [SEP], [PAD]), as transformers'
// TokenClassificationPipeline without aggregation. INVALID_ARGUMENT for inconsistent shapes (as
// Classify, and `tokens` as QuestionAnswerSpans).
absl::StatusOr<std::vector<std::vector<TokenLabel>>> ClassifyTokens(absl::Span<const float> logits,
                                                                    const TokenRows& tokens, int64_t classes,
                                                                    const std::vector<std::string>& label_names,
                                                                    const std::vector<int64_t>& special_ids);

struct TokenScore {
  int64_t id = 0;
  std::string token;  // id_to_token(id), or empty without id_to_token
  double score = 0;   // softmax probability over the whole vocabulary
};

struct MaskFill {
  int64_t position = 0;         // of the mask token in its row
  std::vector<TokenScore> top;  // best first; ties in id order
};

struct FillMaskOptions {
  int64_t top_k = 5;  // transformers' FillMaskPipeline default
  // When > 0, only ids below it are candidates (a checkpoint whose vocab_size exceeds its
  // tokenizer's vocabulary); probabilities are still over the whole vocabulary, as the model's.
  int64_t vocab_limit = 0;
};

// Masked LM (`logits` [rows, seq, vocab]: BertForMaskedLM's logits or the pre-training head's
// prediction_logits): for each row, each position whose input id is `mask_token_id` and whose
// attention is 1, the top_k ids by softmax probability (fewer when fewer are candidates), as
// transformers' FillMaskPipeline. INVALID_ARGUMENT for top_k < 1, vocab_limit < 0, vocab < 1 or
// inconsistent shapes.
absl::StatusOr<std::vector<std::vector<MaskFill>>> MaskedLmTopK(
    absl::Span<const float> logits, int64_t vocab, const TokenRows& tokens, int64_t mask_token_id,
    const FillMaskOptions& options = {}, const std::function<std::string(int64_t)>& id_to_token = nullptr);

struct QaOptions {
  int64_t max_answer_len = 15;  // tokens, inclusive of both ends; transformers' default
  // [CLS]'s id: transformers keeps [CLS] in the softmax (some models point there for "no
  // answer"), though position 0 can never be part of the answer. -1: no such token.
  int64_t cls_token_id = -1;
  std::vector<int64_t> special_ids;  // ids that are never part of an answer: [CLS], [SEP], [PAD]
};

struct AnswerSpan {
  int64_t start = -1;  // token positions in the row, inclusive; -1 when the row has no candidate
  int64_t end = -1;
  double score = 0;  // softmax(start)[start] * softmax(end)[end]
};

// Question answering (`start_logits`, `end_logits` [rows, seq]; question in token type 0, context
// in token type 1): the best span of each row as transformers' QuestionAnsweringPipeline (top_k 1,
// no impossible answer) picks it. Candidate positions have attention 1 and a token that is not in
// special_ids, in the context (token type 1; anywhere when the row has no token of type 1 with
// attention 1). Every other position's logits become -10000 before each softmax, except [CLS]
// positions, which stay in it; position 0 then gets probability 0. The best span maximises
// start_prob * end_prob over start <= end < start + max_answer_len, both candidates; ties go to
// the smallest start, then end. INVALID_ARGUMENT for max_answer_len < 1 or inconsistent shapes
// (rows < 0, seq < 1, a buffer that does not hold rows * seq values, attention not 0/1).
absl::StatusOr<std::vector<AnswerSpan>> QuestionAnswerSpans(absl::Span<const float> start_logits,
                                                            absl::Span<const float> end_logits, const TokenRows& tokens,
                                                            const QaOptions& options = {});

}  // namespace bertshard::serving

#endif  // BERTSHARD_SERVING_HEADS_H_
