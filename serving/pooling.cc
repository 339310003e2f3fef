#include "serving/pooling.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <limits>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/checkpoint_dir.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"

namespace bertshard::serving {
namespace {

using nlohmann::json;

constexpr char kTransformer[] = "sentence_transformers.models.Transformer";
// sentence-transformers before 1.0 saved the transformer module under this name.
constexpr char kLegacyBert[] = "sentence_transformers.models.BERT";
constexpr char kPooling[] = "sentence_transformers.models.Pooling";
constexpr char kNormalize[] = "sentence_transformers.models.Normalize";

// The JSON of `dir`'s file `name`, or nullopt when the file does not exist (every file read here
// is optional at some level; the caller decides). Read through the directory's descriptor, capped
// at its max_json_bytes, regular files only (common/checkpoint_dir.h).
absl::StatusOr<std::optional<json>> ReadJsonFile(const common::CheckpointDir& dir, const std::string& name) {
  absl::StatusOr<std::string> text = dir.ReadSmallFile(name, dir.limits().max_json_bytes);
  if (text.status().code() == absl::StatusCode::kNotFound) return std::optional<json>();
  if (!text.ok()) return text.status();
  json j = json::parse(*text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return absl::InvalidArgumentError(absl::StrCat(dir.path(), "/", name, " is not valid JSON"));
  return std::optional<json>(std::move(j));
}

// The one mode a Pooling module's config.json selects. sentence-transformers concatenates the
// vectors of every mode that is on; one vector of the hidden size is what callers expect, so more
// than one is refused.
absl::StatusOr<Pooling> PoolingFromConfig(const json& config, const std::string& path) {
  if (!config.is_object()) return absl::InvalidArgumentError(absl::StrCat(path, " is not a JSON object"));
  struct Mode {
    const char* key;
    const char* st_name;             // Pooling(pooling_mode=...) name
    std::optional<Pooling> pooling;  // nullopt: not supported
  };
  static const Mode kModes[] = {
      {"pooling_mode_cls_token", "cls", Pooling::kCls},
      {"pooling_mode_mean_tokens", "mean", Pooling::kMean},
      {"pooling_mode_max_tokens", "max", Pooling::kMax},
      {"pooling_mode_mean_sqrt_len_tokens", "mean_sqrt_len_tokens", Pooling::kMeanSqrtLen},
      {"pooling_mode_weightedmean_tokens", "weightedmean", std::nullopt},
      {"pooling_mode_lasttoken", "lasttoken", std::nullopt},
  };
  // sentence-transformers' Pooling(pooling_mode="mean") overrides the flags; a hand-written config
  // may carry it.
  std::optional<std::string> named;
  if (config.contains("pooling_mode") && !config["pooling_mode"].is_null()) {
    if (!config["pooling_mode"].is_string()) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": pooling_mode must be a string"));
    }
    named = config["pooling_mode"].get<std::string>();
    std::transform(named->begin(), named->end(), named->begin(), [](unsigned char c) { return std::tolower(c); });
  }
  std::vector<const Mode*> on;
  for (const Mode& mode : kModes) {
    if (named.has_value()) {
      if (*named == mode.st_name) on.push_back(&mode);
      continue;
    }
    if (!config.contains(mode.key) || config[mode.key].is_null()) continue;
    if (!config[mode.key].is_boolean()) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": ", mode.key, " must be true or false"));
    }
    if (config[mode.key].get<bool>()) on.push_back(&mode);
  }
  if (named.has_value() && on.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": unknown pooling_mode \"", *named,
                     "\" (sentence-transformers knows mean, max, cls, weightedmean, lasttoken, mean_sqrt_len_tokens)"));
  }
  for (const Mode* mode : on) {
    if (!mode->pooling.has_value()) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": ", mode->key, " is not supported (supported: cls, mean, max, mean_sqrt_len)"));
    }
  }
  if (on.size() != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(path,
                     ": exactly one of pooling_mode_cls_token, pooling_mode_mean_tokens, pooling_mode_max_tokens, "
                     "pooling_mode_mean_sqrt_len_tokens must be true (",
                     on.size(), " are)"));
  }
  return *on.front()->pooling;
}

// config_sentence_transformers.json (optional): `prompts` and `default_prompt_name`, which must be
// one of them (sentence-transformers refuses such a model at load too).
absl::Status ReadPrompts(const common::CheckpointDir& dir, EmbeddingConfig* config) {
  const std::string path = dir.path() + "/config_sentence_transformers.json";
  ASSIGN_OR_RETURN(const std::optional<json> st, ReadJsonFile(dir, "config_sentence_transformers.json"));
  if (!st.has_value()) return absl::OkStatus();
  if (!st->is_object()) return absl::InvalidArgumentError(absl::StrCat(path, " is not a JSON object"));
  if (st->contains("prompts") && !(*st)["prompts"].is_null()) {
    const json& prompts = (*st)["prompts"];
    if (!prompts.is_object()) return absl::InvalidArgumentError(absl::StrCat(path, ": prompts must be an object"));
    for (const auto& [name, text] : prompts.items()) {
      if (!text.is_string()) {
        return absl::InvalidArgumentError(absl::StrCat(path, ": prompt \"", name, "\" must be a string"));
      }
      config->prompts[name] = text.get<std::string>();
    }
  }
  if (st->contains("default_prompt_name") && !(*st)["default_prompt_name"].is_null()) {
    const json& name = (*st)["default_prompt_name"];
    if (!name.is_string()) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": default_prompt_name must be a string or null"));
    }
    config->default_prompt_name = name.get<std::string>();
    if (config->prompts.count(config->default_prompt_name) == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": default_prompt_name \"", config->default_prompt_name, "\" is not one of its prompts"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckDims(int64_t rows, int64_t seq, int64_t dim) {
  if (rows < 0 || seq < 1 || dim < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("pooling needs rows >= 0, seq >= 1 and dim >= 1; got ", rows, ", ", seq, ", ", dim));
  }
  // rows * seq * dim must be addressable; bounds far above any real batch, they only keep the
  // products below from overflowing.
  constexpr int64_t kLimit = int64_t{1} << 20;
  if (rows > std::numeric_limits<int64_t>::max() / kLimit / kLimit || seq > kLimit || dim > kLimit) {
    return absl::InvalidArgumentError(absl::StrCat("pooling shape [", rows, ", ", seq, ", ", dim, "] is too large"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<Pooling> ParsePooling(absl::string_view name) {
  for (Pooling p : {Pooling::kMean, Pooling::kCls, Pooling::kMax, Pooling::kMeanSqrtLen}) {
    if (name == PoolingName(p)) return p;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown pooling \"", name, "\" (valid: mean, cls, max, mean_sqrt_len)"));
}

const char* PoolingName(Pooling pooling) {
  switch (pooling) {
    case Pooling::kMean:
      return "mean";
    case Pooling::kCls:
      return "cls";
    case Pooling::kMax:
      return "max";
    case Pooling::kMeanSqrtLen:
      return "mean_sqrt_len";
  }
  return "unknown";
}

absl::StatusOr<EmbeddingConfig> ReadEmbeddingConfig(const std::string& checkpoint_dir) {
  ASSIGN_OR_RETURN(std::shared_ptr<const common::CheckpointDir> dir,
                   common::CheckpointDir::Open(common::ModelRoot(), checkpoint_dir));
  return ReadEmbeddingConfig(*dir);
}

absl::StatusOr<EmbeddingConfig> ReadEmbeddingConfig(const common::CheckpointDir& dir) {
  EmbeddingConfig config;
  const std::string& checkpoint_dir = dir.path();

  const std::string sbert_path = checkpoint_dir + "/sentence_bert_config.json";
  ASSIGN_OR_RETURN(const std::optional<json> sbert, ReadJsonFile(dir, "sentence_bert_config.json"));
  if (sbert.has_value()) {
    if (!sbert->is_object()) return absl::InvalidArgumentError(absl::StrCat(sbert_path, " is not a JSON object"));
    if (sbert->contains("max_seq_length") && !(*sbert)["max_seq_length"].is_null()) {
      const json& v = (*sbert)["max_seq_length"];
      if (!v.is_number_integer() || v.get<int64_t>() < 1) {
        return absl::InvalidArgumentError(absl::StrCat(sbert_path, ": max_seq_length must be a positive integer"));
      }
      config.max_seq_length = v.get<int64_t>();
    }
  }

  const std::string modules_path = checkpoint_dir + "/modules.json";
  ASSIGN_OR_RETURN(const std::optional<json> modules, ReadJsonFile(dir, "modules.json"));
  if (!modules.has_value()) return config;
  config.from_files = true;
  // sentence-transformers reads its prompts only for a model it loads from its own files.
  RETURN_IF_ERROR(ReadPrompts(dir, &config));
  if (!modules->is_array()) return absl::InvalidArgumentError(absl::StrCat(modules_path, " is not a JSON list"));

  std::optional<std::string> pooling_dir;
  for (const json& module : *modules) {
    if (!module.is_object() || !module.contains("type") || !module["type"].is_string()) {
      return absl::InvalidArgumentError(absl::StrCat(modules_path, ": every module needs a string \"type\""));
    }
    const std::string type = module["type"].get<std::string>();
    if (type == kTransformer || type == kLegacyBert) continue;
    if (type == kNormalize) {
      config.normalize = true;
      continue;
    }
    if (type == kPooling) {
      if (pooling_dir.has_value()) {
        return absl::InvalidArgumentError(absl::StrCat(modules_path, " lists more than one Pooling module"));
      }
      if (!module.contains("path") || !module["path"].is_string()) {
        return absl::InvalidArgumentError(absl::StrCat(modules_path, ": the Pooling module needs a string \"path\""));
      }
      pooling_dir = module["path"].get<std::string>();
      continue;
    }
    // Dense, LayerNorm, WordWeights, ...: each changes the vectors; serving them without it would
    // be silently wrong.
    return absl::InvalidArgumentError(absl::StrCat(modules_path, ": module ", type,
                                                   " is not supported (supported: Transformer, Pooling, Normalize)"));
  }
  if (!pooling_dir.has_value()) {
    return absl::InvalidArgumentError(absl::StrCat(modules_path, " lists no ", kPooling, " module"));
  }
  // The module's path is the file's to say; under a model root the directory keeps it inside.
  const std::string pooling_name = pooling_dir->empty() ? "config.json" : *pooling_dir + "/config.json";
  const std::string pooling_path = checkpoint_dir + "/" + pooling_name;
  ASSIGN_OR_RETURN(const std::optional<json> pooling, ReadJsonFile(dir, pooling_name));
  if (!pooling.has_value()) {
    return absl::InvalidArgumentError(absl::StrCat("the Pooling module's ", pooling_path, " is missing"));
  }
  ASSIGN_OR_RETURN(config.pooling, PoolingFromConfig(*pooling, pooling_path));
  if (pooling->contains("word_embedding_dimension")) {
    const json& d = (*pooling)["word_embedding_dimension"];
    if (!d.is_number_integer() || d.get<int64_t>() < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat(pooling_path, ": word_embedding_dimension must be a positive integer"));
    }
    config.word_embedding_dimension = d.get<int64_t>();
  }
  if (pooling->contains("include_prompt") && !(*pooling)["include_prompt"].is_null()) {
    if (!(*pooling)["include_prompt"].is_boolean()) {
      return absl::InvalidArgumentError(absl::StrCat(pooling_path, ": include_prompt must be true or false"));
    }
    config.include_prompt = (*pooling)["include_prompt"].get<bool>();
  }
  return config;
}

absl::StatusOr<std::string> PromptFor(const EmbeddingConfig& config, const std::string& name) {
  const std::string& chosen = name.empty() ? config.default_prompt_name : name;
  if (chosen.empty()) return std::string();
  auto it = config.prompts.find(chosen);
  if (it == config.prompts.end()) {
    std::vector<std::string> names;
    for (const auto& [known, text] : config.prompts) names.push_back(known);
    return absl::InvalidArgumentError(absl::StrCat(
        "prompt_name `", chosen, "` is not one of the model's prompts (",
        names.empty() ? "it has none"
                      : absl::StrCat("config_sentence_transformers.json has: ", absl::StrJoin(names, ", ")),
        ")"));
  }
  if (!config.include_prompt) {
    return absl::FailedPreconditionError(
        "the model's Pooling config has include_prompt false (pool without the prompt's tokens), which bertshard "
        "does not do yet: embedding with a prompt would differ from sentence-transformers");
  }
  return it->second;
}

absl::StatusOr<std::vector<std::vector<float>>> Pool(const float* hidden, int64_t rows, int64_t seq, int64_t dim,
                                                     const int64_t* attention_mask, Pooling pooling, bool normalize) {
  RETURN_IF_ERROR(CheckDims(rows, seq, dim));
  if (rows > 0 && (hidden == nullptr || attention_mask == nullptr)) {
    return absl::InvalidArgumentError("pooling needs the hidden states and the attention mask");
  }
  for (int64_t i = 0; i < rows * seq; ++i) {
    if (attention_mask[i] != 0 && attention_mask[i] != 1) {
      return absl::InvalidArgumentError(absl::StrCat("attention mask value ", attention_mask[i], " at row ", i / seq,
                                                     ", position ", i % seq, " is not 0 or 1"));
    }
  }
  std::vector<std::vector<float>> out(rows);
  std::vector<double> acc(dim);
  for (int64_t r = 0; r < rows; ++r) {
    const float* h = hidden + r * seq * dim;
    const int64_t* mask = attention_mask + r * seq;
    switch (pooling) {
      case Pooling::kCls:
        acc.assign(h, h + dim);
        break;
      case Pooling::kMax:
        // sentence-transformers sets masked positions to -1e9 and then takes the max over all
        // positions: a masked position still competes, with -1e9.
        acc.assign(dim, -std::numeric_limits<double>::infinity());
        for (int64_t t = 0; t < seq; ++t) {
          for (int64_t d = 0; d < dim; ++d) {
            const double v = mask[t] ? static_cast<double>(h[t * dim + d]) : -1e9;
            acc[d] = std::max(acc[d], v);
          }
        }
        break;
      case Pooling::kMean:
      case Pooling::kMeanSqrtLen: {
        acc.assign(dim, 0.0);
        double count = 0;
        for (int64_t t = 0; t < seq; ++t) {
          if (!mask[t]) continue;
          count += 1;
          for (int64_t d = 0; d < dim; ++d) acc[d] += h[t * dim + d];
        }
        // clamp(min=1e-9): an all-zero mask divides 0 by 1e-9 and gives zeros, not NaN.
        count = std::max(count, 1e-9);
        const double divisor = pooling == Pooling::kMean ? count : std::sqrt(count);
        for (double& v : acc) v /= divisor;
        break;
      }
    }
    if (normalize) {
      double sq = 0;
      for (double v : acc) sq += v * v;
      const double norm = std::max(std::sqrt(sq), 1e-12);
      for (double& v : acc) v /= norm;
    }
    out[r].assign(acc.begin(), acc.end());
  }
  return out;
}

absl::StatusOr<std::vector<std::vector<float>>> Pool(absl::Span<const float> hidden, int64_t rows, int64_t seq,
                                                     int64_t dim, absl::Span<const int64_t> attention_mask,
                                                     Pooling pooling, bool normalize) {
  RETURN_IF_ERROR(CheckDims(rows, seq, dim));
  if (static_cast<int64_t>(hidden.size()) != rows * seq * dim) {
    return absl::InvalidArgumentError(absl::StrCat("hidden states hold ", hidden.size(), " values; shape [", rows, ", ",
                                                   seq, ", ", dim, "] needs ", rows * seq * dim));
  }
  if (static_cast<int64_t>(attention_mask.size()) != rows * seq) {
    return absl::InvalidArgumentError(absl::StrCat("attention mask holds ", attention_mask.size(), " values; [", rows,
                                                   ", ", seq, "] needs ", rows * seq));
  }
  return Pool(hidden.data(), rows, seq, dim, attention_mask.data(), pooling, normalize);
}

double Cosine(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return std::numeric_limits<double>::quiet_NaN();
  double aa = 0, bb = 0, ab = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    aa += static_cast<double>(a[i]) * a[i];
    bb += static_cast<double>(b[i]) * b[i];
    ab += static_cast<double>(a[i]) * b[i];
  }
  return ab / (std::max(std::sqrt(aa), 1e-12) * std::max(std::sqrt(bb), 1e-12));
}

}  // namespace bertshard::serving
