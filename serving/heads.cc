#include "serving/heads.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <optional>
#include <unordered_set>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/checkpoint_dir.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"

namespace bertshard::serving {
namespace {

using nlohmann::json;

// Bounds far above any real model; they only keep rows * seq * classes from overflowing.
constexpr int64_t kMaxDim = int64_t{1} << 24;

// Stable softmax of `n` logits into `out`, in double: exp(x - max) / sum.
void Softmax(const float* logits, int64_t n, std::vector<double>* out) {
  out->resize(n);
  double max = -std::numeric_limits<double>::infinity();
  for (int64_t i = 0; i < n; ++i) max = std::max(max, static_cast<double>(logits[i]));
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += (*out)[i] = std::exp(logits[i] - max);
  for (double& p : *out) p /= sum;
}

void SoftmaxInPlace(std::vector<double>* values) {
  double max = -std::numeric_limits<double>::infinity();
  for (double v : *values) max = std::max(max, v);
  double sum = 0;
  for (double& v : *values) sum += v = std::exp(v - max);
  for (double& v : *values) v /= sum;
}

// The shape checks every head decoder starts with: rows and seq in range, each id array rows x seq.
absl::Status CheckTokenRowShapes(const TokenRows& tokens) {
  if (tokens.rows < 0 || tokens.seq < 1 || tokens.seq > kMaxDim || tokens.rows > kMaxDim) {
    return absl::InvalidArgumentError(
        absl::StrCat("token rows need rows >= 0 and seq >= 1; got ", tokens.rows, " and ", tokens.seq));
  }
  const int64_t n = tokens.rows * tokens.seq;
  const auto check_size = [&](absl::Span<const int64_t> values, const char* what, bool optional) -> absl::Status {
    if (optional && values.empty()) return absl::OkStatus();
    if (static_cast<int64_t>(values.size()) != n) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, " hold ", values.size(), " values; [", tokens.rows, ", ", tokens.seq, "] needs ", n));
    }
    return absl::OkStatus();
  };
  RETURN_IF_ERROR(check_size(tokens.input_ids, "input ids", /*optional=*/false));
  RETURN_IF_ERROR(check_size(tokens.attention_mask, "attention mask", /*optional=*/true));
  RETURN_IF_ERROR(check_size(tokens.token_type_ids, "token type ids", /*optional=*/true));
  for (int64_t i = 0; i < static_cast<int64_t>(tokens.attention_mask.size()); ++i) {
    if (tokens.attention_mask[i] != 0 && tokens.attention_mask[i] != 1) {
      return absl::InvalidArgumentError(absl::StrCat("attention mask value ", tokens.attention_mask[i], " at row ",
                                                     i / tokens.seq, ", position ", i % tokens.seq, " is not 0 or 1"));
    }
  }
  return absl::OkStatus();
}

bool Attended(const TokenRows& tokens, int64_t i) {
  return tokens.attention_mask.empty() || tokens.attention_mask[i] == 1;
}

int64_t TokenType(const TokenRows& tokens, int64_t i) {
  return tokens.token_type_ids.empty() ? 0 : tokens.token_type_ids[i];
}

absl::Status CheckLogits(absl::Span<const float> logits, const char* what, int64_t expected, const std::string& shape) {
  if (static_cast<int64_t>(logits.size()) != expected) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " hold ", logits.size(), " values; shape ", shape, " needs ", expected));
  }
  return absl::OkStatus();
}

absl::Status CheckClasses(int64_t classes, const std::vector<std::string>& label_names) {
  if (classes < 1 || classes > kMaxDim) {
    return absl::InvalidArgumentError(absl::StrCat("classification needs at least one class; got ", classes));
  }
  if (static_cast<int64_t>(label_names.size()) != classes) {
    return absl::InvalidArgumentError(
        absl::StrCat("the logits have ", classes, " classes but ", label_names.size(), " label names were given"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<Labels> ReadLabels(const std::string& checkpoint_dir) {
  ASSIGN_OR_RETURN(std::shared_ptr<const common::CheckpointDir> dir,
                   common::CheckpointDir::Open(common::ModelRoot(), checkpoint_dir));
  return ReadLabels(*dir);
}

absl::StatusOr<Labels> ReadLabels(const common::CheckpointDir& dir) {
  const std::string path = dir.path() + "/config.json";
  absl::StatusOr<std::string> text = dir.ReadSmallFile("config.json", dir.limits().max_json_bytes);
  if (!text.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("cannot read model config ", path, ": ", text.status().message()));
  }
  const json config = json::parse(*text, nullptr, /*allow_exceptions=*/false);
  if (config.is_discarded() || !config.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(path, " is not a JSON object"));
  }
  Labels labels;
  std::map<int64_t, std::string> id2label;
  const bool has_id2label = config.contains("id2label") && !config["id2label"].is_null();
  if (has_id2label) {
    const json& j = config["id2label"];
    if (!j.is_object()) return absl::InvalidArgumentError(absl::StrCat(path, ": id2label is not a JSON object"));
    for (const auto& [key, value] : j.items()) {
      int64_t id = 0;
      if (!absl::SimpleAtoi(key, &id)) {
        return absl::InvalidArgumentError(absl::StrCat(path, ": id2label key \"", key, "\" is not an integer"));
      }
      if (!value.is_string()) {
        return absl::InvalidArgumentError(absl::StrCat(path, ": id2label[", key, "] is not a string"));
      }
      if (!id2label.emplace(id, value.get<std::string>()).second) {
        return absl::InvalidArgumentError(absl::StrCat(path, ": id2label names id ", id, " twice"));
      }
    }
  }
  // PretrainedConfig: num_labels is len(id2label); only without id2label does the num_labels key
  // (default 2) count.
  int64_t num_labels = 2;
  if (has_id2label) {
    num_labels = static_cast<int64_t>(id2label.size());
  } else if (config.contains("num_labels")) {
    const json& n = config["num_labels"];
    if (!n.is_number_integer() || n.get<int64_t>() < 0 || n.get<int64_t>() > kMaxDim) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": num_labels must be a non-negative integer"));
    }
    num_labels = n.get<int64_t>();
  }
  for (const auto& [id, name] : id2label) {
    if (id < 0 || id >= num_labels) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ": id2label has ", num_labels, " labels, so its keys must be 0..", num_labels - 1, "; it has ", id));
    }
  }
  for (int64_t i = 0; i < num_labels; ++i) {
    const auto it = id2label.find(i);
    labels.names.push_back(it != id2label.end() ? it->second : absl::StrCat("LABEL_", i));
  }
  if (config.contains("problem_type") && config["problem_type"].is_string()) {
    labels.multi_label = config["problem_type"].get<std::string>() == "multi_label_classification";
  }
  return labels;
}

std::vector<std::string> NextSentenceLabels() { return {"IsNext", "NotNext"}; }

std::vector<std::string> IndexLabels(int64_t n) {
  std::vector<std::string> names;
  for (int64_t i = 0; i < n; ++i) names.push_back(absl::StrCat(i));
  return names;
}

ScoreFunction DefaultScoreFunction(const Labels& labels) {
  return labels.multi_label || labels.names.size() == 1 ? ScoreFunction::kSigmoid : ScoreFunction::kSoftmax;
}

absl::StatusOr<std::vector<std::vector<LabelScore>>> Classify(absl::Span<const float> logits, int64_t rows,
                                                              int64_t classes,
                                                              const std::vector<std::string>& label_names,
                                                              ScoreFunction function) {
  RETURN_IF_ERROR(CheckClasses(classes, label_names));
  if (rows < 0 || rows > kMaxDim) return absl::InvalidArgumentError(absl::StrCat("rows must be >= 0; got ", rows));
  RETURN_IF_ERROR(
      CheckLogits(logits, "classification logits", rows * classes, absl::StrCat("[", rows, ", ", classes, "]")));
  std::vector<std::vector<LabelScore>> out(rows);
  std::vector<double> probs;
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = logits.data() + r * classes;
    if (function == ScoreFunction::kSoftmax) {
      Softmax(row, classes, &probs);
    } else {
      probs.resize(classes);
      for (int64_t c = 0; c < classes; ++c) probs[c] = 1.0 / (1.0 + std::exp(-static_cast<double>(row[c])));
    }
    for (int64_t c = 0; c < classes; ++c) out[r].push_back({c, label_names[c], probs[c]});
    std::stable_sort(out[r].begin(), out[r].end(),
                     [](const LabelScore& a, const LabelScore& b) { return a.score > b.score; });
  }
  return out;
}

absl::StatusOr<std::vector<std::vector<TokenLabel>>> ClassifyTokens(absl::Span<const float> logits,
                                                                    const TokenRows& tokens, int64_t classes,
                                                                    const std::vector<std::string>& label_names,
                                                                    const std::vector<int64_t>& special_ids) {
  RETURN_IF_ERROR(CheckTokenRowShapes(tokens));
  RETURN_IF_ERROR(CheckClasses(classes, label_names));
  RETURN_IF_ERROR(CheckLogits(logits, "token classification logits", tokens.rows * tokens.seq * classes,
                              absl::StrCat("[", tokens.rows, ", ", tokens.seq, ", ", classes, "]")));
  const std::unordered_set<int64_t> special(special_ids.begin(), special_ids.end());
  std::vector<std::vector<TokenLabel>> out(tokens.rows);
  std::vector<double> probs;
  for (int64_t r = 0; r < tokens.rows; ++r) {
    for (int64_t t = 0; t < tokens.seq; ++t) {
      const int64_t i = r * tokens.seq + t;
      if (!Attended(tokens, i) || special.count(tokens.input_ids[i])) continue;
      Softmax(logits.data() + i * classes, classes, &probs);
      const int64_t best = std::max_element(probs.begin(), probs.end()) - probs.begin();
      out[r].push_back({t, tokens.input_ids[i], best, label_names[best], probs[best]});
    }
  }
  return out;
}

absl::StatusOr<std::vector<std::vector<MaskFill>>> MaskedLmTopK(
    absl::Span<const float> logits, int64_t vocab, const TokenRows& tokens, int64_t mask_token_id,
    const FillMaskOptions& options, const std::function<std::string(int64_t)>& id_to_token) {
  RETURN_IF_ERROR(CheckTokenRowShapes(tokens));
  if (options.top_k < 1) return absl::InvalidArgumentError(absl::StrCat("top_k must be >= 1; got ", options.top_k));
  if (options.vocab_limit < 0) {
    return absl::InvalidArgumentError(absl::StrCat("vocab_limit must be >= 0; got ", options.vocab_limit));
  }
  if (vocab < 1 || vocab > kMaxDim) return absl::InvalidArgumentError(absl::StrCat("vocab must be >= 1; got ", vocab));
  RETURN_IF_ERROR(CheckLogits(logits, "masked LM logits", tokens.rows * tokens.seq * vocab,
                              absl::StrCat("[", tokens.rows, ", ", tokens.seq, ", ", vocab, "]")));
  const int64_t candidates = options.vocab_limit > 0 ? std::min(options.vocab_limit, vocab) : vocab;
  const int64_t k = std::min(options.top_k, candidates);
  std::vector<std::vector<MaskFill>> out(tokens.rows);
  std::vector<double> probs;
  std::vector<int64_t> ids(candidates);
  for (int64_t r = 0; r < tokens.rows; ++r) {
    for (int64_t t = 0; t < tokens.seq; ++t) {
      const int64_t i = r * tokens.seq + t;
      if (tokens.input_ids[i] != mask_token_id || !Attended(tokens, i)) continue;
      Softmax(logits.data() + i * vocab, vocab, &probs);
      for (int64_t v = 0; v < candidates; ++v) ids[v] = v;
      // Higher probability first, then the lower id: a total order, so ties are deterministic.
      std::partial_sort(ids.begin(), ids.begin() + k, ids.end(),
                        [&](int64_t a, int64_t b) { return probs[a] != probs[b] ? probs[a] > probs[b] : a < b; });
      MaskFill fill;
      fill.position = t;
      for (int64_t j = 0; j < k; ++j) {
        fill.top.push_back({ids[j], id_to_token ? id_to_token(ids[j]) : std::string(), probs[ids[j]]});
      }
      out[r].push_back(std::move(fill));
    }
  }
  return out;
}

absl::StatusOr<std::vector<AnswerSpan>> QuestionAnswerSpans(absl::Span<const float> start_logits,
                                                            absl::Span<const float> end_logits, const TokenRows& tokens,
                                                            const QaOptions& options) {
  RETURN_IF_ERROR(CheckTokenRowShapes(tokens));
  if (options.max_answer_len < 1) {
    return absl::InvalidArgumentError(absl::StrCat("max_answer_len must be >= 1; got ", options.max_answer_len));
  }
  const std::string shape = absl::StrCat("[", tokens.rows, ", ", tokens.seq, "]");
  RETURN_IF_ERROR(CheckLogits(start_logits, "start logits", tokens.rows * tokens.seq, shape));
  RETURN_IF_ERROR(CheckLogits(end_logits, "end logits", tokens.rows * tokens.seq, shape));
  const std::unordered_set<int64_t> special(options.special_ids.begin(), options.special_ids.end());
  // transformers' select_starts_ends: undesired positions take this logit before the softmax.
  constexpr double kUndesired = -10000.0;
  const int64_t seq = tokens.seq;
  std::vector<AnswerSpan> out(tokens.rows);
  std::vector<bool> candidate(seq);
  std::vector<bool> in_softmax(seq);
  std::vector<double> ps(seq), pe(seq);
  for (int64_t r = 0; r < tokens.rows; ++r) {
    const int64_t base = r * seq;
    bool has_context = false;
    for (int64_t t = 0; t < seq; ++t) {
      has_context |= Attended(tokens, base + t) && TokenType(tokens, base + t) == 1;
    }
    for (int64_t t = 0; t < seq; ++t) {
      const int64_t i = base + t;
      const int64_t id = tokens.input_ids[i];
      candidate[t] = Attended(tokens, i) && !special.count(id) && (!has_context || TokenType(tokens, i) == 1);
      // The pipeline's p_mask leaves [CLS] unmasked: it stays in the softmax.
      in_softmax[t] = candidate[t] || (Attended(tokens, i) && options.cls_token_id >= 0 && id == options.cls_token_id);
      ps[t] = in_softmax[t] ? start_logits[i] : kUndesired;
      pe[t] = in_softmax[t] ? end_logits[i] : kUndesired;
    }
    SoftmaxInPlace(&ps);
    SoftmaxInPlace(&pe);
    // The pipeline then zeroes position 0 ("Mask CLS") whatever token is there.
    ps[0] = pe[0] = 0;
    AnswerSpan best;
    for (int64_t s = 1; s < seq; ++s) {
      if (!candidate[s]) continue;
      const int64_t last = std::min(seq - 1, s + options.max_answer_len - 1);
      for (int64_t e = s; e <= last; ++e) {
        if (!candidate[e]) continue;
        const double score = ps[s] * pe[e];
        // Strictly greater: the first maximum in (start, end) order wins, as np.argmax.
        if (best.start < 0 || score > best.score) best = {s, e, score};
      }
    }
    out[r] = best;
  }
  return out;
}

}  // namespace bertshard::serving
