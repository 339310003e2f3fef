#include "planner/model_config.h"

#include <cmath>
#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/file.h"
#include "common/proto_json.h"
#include "common/status_macros.h"
#include "google/protobuf/struct.pb.h"

namespace bertshard::planner {
namespace {

struct VariantName {
  v1::ModelVariant variant;
  absl::string_view hf_class;
};

constexpr VariantName kVariants[] = {
    {v1::BERT_MODEL, "BertModel"},
    {v1::BERT_FOR_PRE_TRAINING, "BertForPreTraining"},
    {v1::BERT_LM_HEAD_MODEL, "BertLMHeadModel"},
    {v1::BERT_FOR_MASKED_LM, "BertForMaskedLM"},
    {v1::BERT_FOR_NEXT_SENTENCE_PREDICTION, "BertForNextSentencePrediction"},
    {v1::BERT_FOR_SEQUENCE_CLASSIFICATION, "BertForSequenceClassification"},
    {v1::BERT_FOR_TOKEN_CLASSIFICATION, "BertForTokenClassification"},
    {v1::BERT_FOR_MULTIPLE_CHOICE, "BertForMultipleChoice"},
    {v1::BERT_FOR_QUESTION_ANSWERING, "BertForQuestionAnswering"},
};

using google::protobuf::Value;

absl::StatusOr<int64_t> IntegerField(const Value& v, absl::string_view name) {
  if (v.kind_case() != Value::kNumberValue || std::floor(v.number_value()) != v.number_value() ||
      std::fabs(v.number_value()) > 9.0e15) {
    return absl::InvalidArgumentError(absl::StrCat("config.json field ", name, " must be an integer"));
  }
  return static_cast<int64_t>(v.number_value());
}

absl::StatusOr<bool> BoolField(const Value& v, absl::string_view name) {
  if (v.kind_case() != Value::kBoolValue) {
    return absl::InvalidArgumentError(absl::StrCat("config.json field ", name, " must be true or false"));
  }
  return v.bool_value();
}

}  // namespace

bool IsLmVariant(v1::ModelVariant v) {
  return v == v1::BERT_FOR_PRE_TRAINING || v == v1::BERT_LM_HEAD_MODEL || v == v1::BERT_FOR_MASKED_LM;
}

bool HasPooler(v1::ModelVariant v) {
  return v == v1::BERT_MODEL || v == v1::BERT_FOR_PRE_TRAINING || v == v1::BERT_FOR_NEXT_SENTENCE_PREDICTION ||
         v == v1::BERT_FOR_SEQUENCE_CLASSIFICATION || v == v1::BERT_FOR_MULTIPLE_CHOICE;
}

absl::string_view HfClassName(v1::ModelVariant variant) {
  for (const auto& v : kVariants) {
    if (v.variant == variant) return v.hf_class;
  }
  return "";
}

std::string ValidVariantNames() {
  std::vector<std::string> names;
  for (const auto& v : kVariants) names.emplace_back(v.hf_class);
  return absl::StrJoin(names, ", ");
}

absl::StatusOr<v1::ModelVariant> ParseVariant(absl::string_view name) {
  for (const auto& v : kVariants) {
    if (name == v.hf_class || name == v1::ModelVariant_Name(v.variant)) return v.variant;
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown model variant '", name,
                                                 "'; valid variants: ", ValidVariantNames(),
                                                 " (or their enum names, e.g. BERT_FOR_MASKED_LM)"));
}

absl::StatusOr<v1::Dtype> ParseDtype(absl::string_view name) {
  const std::string lower = absl::AsciiStrToLower(name);
  if (lower == "fp32" || lower == "float32") return v1::FP32;
  if (lower == "bf16" || lower == "bfloat16") return v1::BF16;
  if (lower == "fp16" || lower == "float16" || lower == "half") return v1::FP16;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown dtype '", name, "'; valid: fp32, bf16, fp16 (or float32, bfloat16, float16)"));
}

std::string DtypeName(v1::Dtype dtype) {
  switch (dtype) {
    case v1::BF16:
      return "bf16";
    case v1::FP16:
      return "fp16";
    default:
      return "fp32";
  }
}

int64_t DtypeBytes(v1::Dtype dtype) { return dtype == v1::BF16 || dtype == v1::FP16 ? 2 : 4; }

v1::BertConfig WithHfDefaults(const v1::BertConfig& config) {
  v1::BertConfig c = config;
  if (!c.has_vocab_size()) c.set_vocab_size(30522);
  if (!c.has_hidden_size()) c.set_hidden_size(768);
  if (!c.has_num_hidden_layers()) c.set_num_hidden_layers(12);
  if (!c.has_num_attention_heads()) c.set_num_attention_heads(12);
  if (!c.has_intermediate_size()) c.set_intermediate_size(3072);
  if (!c.has_hidden_act()) c.set_hidden_act("gelu");
  if (!c.has_max_position_embeddings()) c.set_max_position_embeddings(512);
  if (!c.has_type_vocab_size()) c.set_type_vocab_size(2);
  if (!c.has_layer_norm_eps()) c.set_layer_norm_eps(1e-12);
  if (!c.has_tie_word_embeddings()) c.set_tie_word_embeddings(true);
  if (!c.has_num_labels()) c.set_num_labels(2);
  if (!c.has_is_decoder()) c.set_is_decoder(false);
  if (!c.has_add_cross_attention()) c.set_add_cross_attention(false);
  if (!c.has_pad_token_id()) c.set_pad_token_id(0);
  return c;
}

absl::StatusOr<HfConfig> ParseHfConfigJson(absl::string_view json) {
  google::protobuf::Struct root;
  if (absl::Status s = common::JsonToProto(json, &root); !s.ok()) {
    // Not the parser's message: it quotes the text around the error, and a config.json that is
    // really some other file (a link to /etc/passwd) would hand its first bytes to the caller.
    return absl::InvalidArgumentError("config.json is not a valid JSON object");
  }
  HfConfig out;
  v1::BertConfig& c = out.config;
  // HF writes null for unset optional fields: treat null as absent.
  google::protobuf::Map<std::string, Value> f;
  for (const auto& [key, value] : root.fields()) {
    if (value.kind_case() != Value::kNullValue) f[key] = value;
  }
  struct IntSetter {
    const char* name;
    void (v1::BertConfig::*set)(int64_t);
  };
  static constexpr IntSetter kInts[] = {
      {"vocab_size", &v1::BertConfig::set_vocab_size},
      {"hidden_size", &v1::BertConfig::set_hidden_size},
      {"num_hidden_layers", &v1::BertConfig::set_num_hidden_layers},
      {"num_attention_heads", &v1::BertConfig::set_num_attention_heads},
      {"intermediate_size", &v1::BertConfig::set_intermediate_size},
      {"max_position_embeddings", &v1::BertConfig::set_max_position_embeddings},
      {"type_vocab_size", &v1::BertConfig::set_type_vocab_size},
      {"num_labels", &v1::BertConfig::set_num_labels},
      {"pad_token_id", &v1::BertConfig::set_pad_token_id},
  };
  for (const auto& field : kInts) {
    auto it = f.find(field.name);
    if (it == f.end()) continue;
    ASSIGN_OR_RETURN(int64_t value, IntegerField(it->second, field.name));
    (c.*field.set)(value);
  }
  if (!c.has_num_labels()) {
    auto it = f.find("id2label");
    if (it != f.end() && it->second.kind_case() == Value::kStructValue) {
      c.set_num_labels(static_cast<int64_t>(it->second.struct_value().fields().size()));
    }
  }
  if (auto it = f.find("hidden_act"); it != f.end()) {
    if (it->second.kind_case() != Value::kStringValue) {
      return absl::InvalidArgumentError("config.json field hidden_act must be a string");
    }
    c.set_hidden_act(it->second.string_value());
  }
  if (auto it = f.find("position_embedding_type"); it != f.end()) {
    if (it->second.kind_case() != Value::kStringValue || it->second.string_value() != "absolute") {
      return absl::InvalidArgumentError(absl::StrCat("config.json position_embedding_type ",
                                                     common::ProtoToJson(it->second, {.indent = 0}),
                                                     " is not supported; bertshard runs absolute position embeddings"));
    }
  }
  if (auto it = f.find("layer_norm_eps"); it != f.end()) {
    if (it->second.kind_case() != Value::kNumberValue) {
      return absl::InvalidArgumentError("config.json field layer_norm_eps must be a number");
    }
    c.set_layer_norm_eps(it->second.number_value());
  }
  struct BoolSetter {
    const char* name;
    void (v1::BertConfig::*set)(bool);
  };
  static constexpr BoolSetter kBools[] = {
      {"tie_word_embeddings", &v1::BertConfig::set_tie_word_embeddings},
      {"is_decoder", &v1::BertConfig::set_is_decoder},
      {"add_cross_attention", &v1::BertConfig::set_add_cross_attention},
  };
  for (const auto& field : kBools) {
    auto it = f.find(field.name);
    if (it == f.end()) continue;
    ASSIGN_OR_RETURN(bool value, BoolField(it->second, field.name));
    (c.*field.set)(value);
  }
  if (auto it = f.find("architectures");
      it != f.end() && it->second.kind_case() == Value::kListValue && it->second.list_value().values_size() > 0) {
    const Value& first = it->second.list_value().values(0);
    if (first.kind_case() != Value::kStringValue) {
      return absl::InvalidArgumentError("config.json field architectures must list class names");
    }
    auto variant = ParseVariant(first.string_value());
    if (!variant.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("config.json architectures[0] is '", first.string_value(),
                       "', not a BERT class bertshard can shard; valid: ", ValidVariantNames()));
    }
    out.variant = *variant;
  }
  return out;
}

absl::StatusOr<HfConfig> ReadCheckpointConfig(const std::string& directory) {
  ASSIGN_OR_RETURN(std::shared_ptr<const common::CheckpointDir> dir,
                   common::CheckpointDir::Open(common::ModelRoot(), directory));
  return ReadCheckpointConfig(*dir);
}

absl::StatusOr<HfConfig> ReadCheckpointConfig(const common::CheckpointDir& dir) {
  const std::string path = dir.path() + "/config.json";
  absl::StatusOr<std::string> text = dir.ReadSmallFile("config.json", dir.limits().max_json_bytes);
  if (text.status().code() == absl::StatusCode::kNotFound) {
    return absl::NotFoundError(absl::StrCat("checkpoint config ", path,
                                            " cannot be read: the checkpoint must be a "
                                            "HuggingFace model directory with a config.json"));
  }
  if (!text.ok()) return text.status();
  auto parsed = ParseHfConfigJson(*text);
  if (!parsed.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", parsed.status().message()));
  }
  return parsed;
}

absl::Status ResolveCheckpoint(v1::PlanRequest* request) {
  if (request->checkpoint().empty()) return absl::OkStatus();
  ASSIGN_OR_RETURN(std::shared_ptr<const common::CheckpointDir> dir,
                   common::CheckpointDir::Open(common::ModelRoot(), request->checkpoint()));
  return ResolveCheckpoint(*dir, request);
}

absl::Status ResolveCheckpoint(const common::CheckpointDir& dir, v1::PlanRequest* request) {
  auto hf = ReadCheckpointConfig(dir);
  if (!hf.ok()) {
    // A missing checkpoint is the caller's argument, not server state.
    return absl::InvalidArgumentError(hf.status().message());
  }
  v1::BertConfig merged = hf->config;
  merged.MergeFrom(request->config());  // explicit request fields win
  *request->mutable_config() = merged;
  if (request->variant() == v1::MODEL_VARIANT_UNSPECIFIED) request->set_variant(hf->variant);
  return absl::OkStatus();
}

}  // namespace bertshard::planner
