// File: planner/model_config.h
// -----------------------------------------------------------------------------
// The model side of a plan request: variant names (enum and HuggingFace class names), HF
// BertConfig defaults, and reading a HuggingFace checkpoint directory's config.json.
//
// Example:
//   auto v = ParseVariant("BertForMaskedLM");        // v1::BERT_FOR_MASKED_LM
//   auto c = ParseHfConfigJson(R"({"hidden_size": 128, "architectures": ["BertModel"]})");
//   // c->config.hidden_size() == 128, c->variant == v1::BERT_MODEL
//
// Thread safety: thread-safe (no shared state).
#ifndef BERTSHARD_PLANNER_MODEL_CONFIG_H_
#define BERTSHARD_PLANNER_MODEL_CONFIG_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "bertshard/v1/plan.pb.h"
#include "common/checkpoint_dir.h"

namespace bertshard::planner {

// The HuggingFace class name of a variant ("BertForMaskedLM"); "" for UNSPECIFIED/unknown.
absl::string_view HfClassName(v1::ModelVariant variant);

// BertForPreTraining, BertLMHeadModel and BertForMaskedLM: the variants with an LM head (whose
// decoder HF ties to the word embeddings).
bool IsLmVariant(v1::ModelVariant variant);

// Whether HF builds the variant with a pooler (not the LM-head-only, token-classification and QA
// models, which use add_pooling_layer=False).
bool HasPooler(v1::ModelVariant variant);

// Accepts the enum name ("BERT_FOR_MASKED_LM") or the HF class name ("BertForMaskedLM").
// INVALID_ARGUMENT lists the valid names.
absl::StatusOr<v1::ModelVariant> ParseVariant(absl::string_view name);

// Accepts fp32/float32, bf16/bfloat16, fp16/float16/half and the enum names (FP32, BF16, FP16).
// INVALID_ARGUMENT lists the valid names.
absl::StatusOr<v1::Dtype> ParseDtype(absl::string_view name);
// "fp32", "bf16", "fp16"; DTYPE_UNSPECIFIED reads as fp32.
std::string DtypeName(v1::Dtype dtype);
// Bytes per element: 4 for fp32 (and unspecified), 2 for bf16 and fp16.
int64_t DtypeBytes(v1::Dtype dtype);

// Comma-separated HF class names of all nine variants, for error messages.
std::string ValidVariantNames();

// HF's defaults for every field `config` leaves unset; set fields are kept as they are.
v1::BertConfig WithHfDefaults(const v1::BertConfig& config);

struct HfConfig {
  v1::BertConfig config;
  // From architectures[0]; UNSPECIFIED when absent.
  v1::ModelVariant variant = v1::MODEL_VARIANT_UNSPECIFIED;
};

// Parses the text of a HuggingFace config.json. Fields bertshard does not use are ignored, null
// means absent, and num_labels also comes from the size of id2label. INVALID_ARGUMENT names a field of the wrong
// type, a non-integer size, or an architecture that is not one of the nine BERT classes.
absl::StatusOr<HfConfig> ParseHfConfigJson(absl::string_view json);

// Reads `<directory>/config.json` (a regular file of at most the directory's max_json_bytes, read
// through its descriptor: common/checkpoint_dir.h). NOT_FOUND when it does not exist;
// INVALID_ARGUMENT when it is not a valid config, or the directory refuses it.
absl::StatusOr<HfConfig> ReadCheckpointConfig(const common::CheckpointDir& dir);
// As above, `directory` opened unconfined.
absl::StatusOr<HfConfig> ReadCheckpointConfig(const std::string& directory);

// Fills the request's unset config fields and unset variant from its checkpoint's config.json
// (explicit request fields win). No-op without a checkpoint. The checkpoint is opened unconfined:
// a server opens it under its model root and calls the overload below.
absl::Status ResolveCheckpoint(v1::PlanRequest* request);
// As above, from `dir` (whatever the request's checkpoint field says). INVALID_ARGUMENT when the
// config cannot be read or is not valid.
absl::Status ResolveCheckpoint(const common::CheckpointDir& dir, v1::PlanRequest* request);

}  // namespace bertshard::planner

#endif  // BERTSHARD_PLANNER_MODEL_CONFIG_H_
