#include "planner/planner.h"

#include <cmath>
#include <numeric>
#include <string>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "google/protobuf/struct.pb.h"
#include "planner/model_config.h"
#include "planner/stage_layout.h"

namespace bertshard::planner {
namespace {

constexpr char kRingWarning[] =
    "For Bert, sequence parallelism is currently not support mode ring, will set to be "
    "split_gather";

// The activations the executor implements (HF ACT2FN names).
constexpr absl::string_view kSupportedActivations[] = {"gelu", "gelu_new", "gelu_pytorch_tanh", "relu"};

// Modules the variant adds after the BERT trunk, as get_held_layers names them.
std::vector<std::string> HeadModules(v1::ModelVariant v) {
  switch (v) {
    case v1::BERT_FOR_PRE_TRAINING:
    case v1::BERT_LM_HEAD_MODEL:
    case v1::BERT_FOR_MASKED_LM:
    case v1::BERT_FOR_NEXT_SENTENCE_PREDICTION:
      return {"cls"};
    case v1::BERT_FOR_SEQUENCE_CLASSIFICATION:
    case v1::BERT_FOR_TOKEN_CLASSIFICATION:
    case v1::BERT_FOR_MULTIPLE_CHOICE:
      return {"dropout", "classifier"};
    case v1::BERT_FOR_QUESTION_ANSWERING:
      return {"qa_outputs"};
    default:
      return {};
  }
}

absl::string_view PipelineForwardName(v1::ModelVariant v) {
  switch (v) {
    case v1::BERT_MODEL:
      return "bert_model_forward";
    case v1::BERT_FOR_PRE_TRAINING:
      return "bert_for_pretraining_forward";
    case v1::BERT_LM_HEAD_MODEL:
      return "bert_lm_head_model_forward";
    case v1::BERT_FOR_MASKED_LM:
      return "bert_for_masked_lm_forward";
    case v1::BERT_FOR_NEXT_SENTENCE_PREDICTION:
      return "bert_for_next_sentence_prediction_forward";
    case v1::BERT_FOR_SEQUENCE_CLASSIFICATION:
      return "bert_for_sequence_classification_forward";
    case v1::BERT_FOR_TOKEN_CLASSIFICATION:
      return "bert_for_token_classification_forward";
    case v1::BERT_FOR_MULTIPLE_CHOICE:
      return "bert_for_multiple_choice_forward";
    case v1::BERT_FOR_QUESTION_ANSWERING:
      return "bert_for_question_answering_forward";
    default:
      return "";
  }
}

int64_t RoundUp(int64_t value, int64_t multiple) {
  return value % multiple == 0 ? value : value + multiple - value % multiple;
}

// Everything Plan() needs, validated and normalised.
struct Resolved {
  v1::ModelVariant variant = v1::MODEL_VARIANT_UNSPECIFIED;
  v1::BertConfig config;  // every field set
  int64_t vocab = 0, hidden = 0, layers = 0, heads = 0, intermediate = 0;
  bool tie_weight = false;

  int64_t tp = 1;
  bool tp_on = false;

  bool pipeline = false;  // a stage manager exists
  int64_t stages = 1;
  int64_t chunks = 1;
  v1::PipelineStyle style = v1::PIPELINE_STYLE_UNSPECIFIED;
  bool interleave = false;
  bool zbv = false;
  std::vector<int64_t> layers_per_slot;

  v1::SequenceParallelMode sp = v1::SP_NONE;  // effective: SP_NONE or SPLIT_GATHER
  bool fused_norm = false, jit = false, all_opt = false, fp8 = false;
  int64_t vocab_multiple = 64;  // make_vocab_size_divisible_by
  v1::Dtype dtype = v1::FP32;
  std::vector<std::string> warnings;
};

std::string Join(const std::vector<int64_t>& values) { return absl::StrJoin(values, ", "); }

absl::Status Invalid(absl::string_view message) { return absl::InvalidArgumentError(message); }

absl::Status CheckPositive(absl::string_view name, int64_t value, int64_t max) {
  if (value <= 0) {
    return Invalid(absl::StrCat("config.", name, " is ", value, "; it must be a positive integer"));
  }
  if (value > max) {
    return Invalid(absl::StrCat("config.", name, " is ", value, "; at most ", max, " is supported"));
  }
  return absl::OkStatus();
}

absl::Status ValidateConfig(const v1::ModelVariant variant, const v1::BertConfig& c) {
  RETURN_IF_ERROR(CheckPositive("vocab_size", c.vocab_size(), kMaxTensorElements));
  RETURN_IF_ERROR(CheckPositive("hidden_size", c.hidden_size(), kMaxTensorElements));
  RETURN_IF_ERROR(CheckPositive("num_hidden_layers", c.num_hidden_layers(), kMaxLayers));
  RETURN_IF_ERROR(CheckPositive("num_attention_heads", c.num_attention_heads(), kMaxTensorElements));
  RETURN_IF_ERROR(CheckPositive("intermediate_size", c.intermediate_size(), kMaxTensorElements));
  RETURN_IF_ERROR(CheckPositive("max_position_embeddings", c.max_position_embeddings(), kMaxTensorElements));
  RETURN_IF_ERROR(CheckPositive("type_vocab_size", c.type_vocab_size(), kMaxTensorElements));
  RETURN_IF_ERROR(CheckPositive("num_labels", c.num_labels(), kMaxTensorElements));
  if (c.hidden_size() % c.num_attention_heads() != 0) {
    return Invalid(absl::StrCat("config.hidden_size ", c.hidden_size(), " is not a multiple of num_attention_heads ",
                                c.num_attention_heads(), " (HF BERT needs whole attention heads)"));
  }
  if (!(c.layer_norm_eps() > 0) || !std::isfinite(c.layer_norm_eps())) {
    return Invalid(absl::StrCat("config.layer_norm_eps is ", c.layer_norm_eps(),
                                "; it must be a positive finite number (HF default 1e-12)"));
  }
  bool act_ok = false;
  for (absl::string_view a : kSupportedActivations) act_ok |= (c.hidden_act() == a);
  if (!act_ok) {
    return Invalid(absl::StrCat("config.hidden_act '", c.hidden_act(),
                                "' is not supported; valid: ", absl::StrJoin(kSupportedActivations, ", ")));
  }
  if (c.pad_token_id() < 0 || c.pad_token_id() >= c.vocab_size()) {
    return Invalid(
        absl::StrCat("config.pad_token_id ", c.pad_token_id(), " is outside the vocabulary [0, ", c.vocab_size(), ")"));
  }
  if (c.add_cross_attention() && !c.is_decoder()) {
    return Invalid(
        "config.add_cross_attention needs config.is_decoder = true (HF builds cross-attention "
        "only into decoders)");
  }
  // Every tensor, padded, must stay below 2^31 elements.
  const int64_t h = c.hidden_size();
  auto too_big = [h](int64_t rows) { return rows > kMaxTensorElements / h; };
  if (too_big(c.vocab_size()) || too_big(c.intermediate_size()) || too_big(h) || too_big(c.max_position_embeddings()) ||
      too_big(c.type_vocab_size()) || too_big(c.num_labels())) {
    return Invalid(absl::StrCat("config sizes give a tensor of more than 2^31 elements (hidden_size ", h,
                                "); this is not a BERT bertshard can plan"));
  }
  if (variant == v1::BERT_FOR_QUESTION_ANSWERING && c.num_labels() != 2) {
    // HF splits qa_outputs into exactly start and end logits.
    return Invalid(
        absl::StrCat("BertForQuestionAnswering needs config.num_labels 2 (start and end "
                     "logits), got ",
                     c.num_labels()));
  }
  return absl::OkStatus();
}

absl::StatusOr<Resolved> Resolve(const v1::PlanRequest& request) {
  Resolved r;
  // --- model ---
  if (request.variant() == v1::MODEL_VARIANT_UNSPECIFIED) {
    return Invalid(
        absl::StrCat("variant is required (or a checkpoint whose config.json names "
                     "architectures[0]); valid variants: ",
                     ValidVariantNames()));
  }
  if (!v1::ModelVariant_IsValid(request.variant())) {
    return Invalid(
        absl::StrCat("unknown variant value ", request.variant(), "; valid variants: ", ValidVariantNames()));
  }
  r.variant = request.variant();
  r.config = WithHfDefaults(request.config());
  RETURN_IF_ERROR(ValidateConfig(r.variant, r.config));
  r.vocab = r.config.vocab_size();
  r.hidden = r.config.hidden_size();
  r.layers = r.config.num_hidden_layers();
  r.heads = r.config.num_attention_heads();
  r.intermediate = r.config.intermediate_size();
  // HF ties the decoder to the word embeddings (the seed checks object identity) only in the
  // three variants that have output embeddings.
  r.tie_weight = IsLmVariant(r.variant) && r.config.tie_word_embeddings();

  // --- dtype ---
  if (!v1::Dtype_IsValid(request.dtype())) {
    return Invalid(absl::StrCat("unknown dtype value ", request.dtype(), "; valid: fp32, bf16, fp16"));
  }
  r.dtype = request.dtype() == v1::DTYPE_UNSPECIFIED ? v1::FP32 : request.dtype();

  // --- parallel sizes ---
  const v1::ParallelConfig& p = request.parallel();
  if (p.tp_size() < 0 || p.tp_size() > kMaxParallelSize) {
    return Invalid(
        absl::StrCat("parallel.tp_size is ", p.tp_size(), "; it must be in 0..", kMaxParallelSize,
                     " (0 or 1: tensor parallelism off); valid for this model: ", Join(ValidTpSizes(r.config))));
  }
  if (p.pp_size() < 0 || p.pp_size() > kMaxParallelSize) {
    return Invalid(absl::StrCat("parallel.pp_size is ", p.pp_size(), "; it must be in 0..", kMaxParallelSize,
                                " (0 or 1: no pipeline)"));
  }
  if (p.num_model_chunks() < 0 || p.num_model_chunks() > kMaxParallelSize) {
    return Invalid(absl::StrCat("parallel.num_model_chunks is ", p.num_model_chunks(), "; it must be in 0..",
                                kMaxParallelSize, " (0: 1 for ONE_F_ONE_B, 2 for INTERLEAVED and ZBV)"));
  }
  if (p.make_vocab_size_divisible_by() < 0 || p.make_vocab_size_divisible_by() > 65536) {
    return Invalid(absl::StrCat("parallel.make_vocab_size_divisible_by is ", p.make_vocab_size_divisible_by(),
                                "; it must be in 0..65536 (0 means 64)"));
  }
  if (!v1::PipelineStyle_IsValid(p.pp_style())) {
    return Invalid(
        absl::StrCat("unknown parallel.pp_style value ", p.pp_style(), "; valid: ONE_F_ONE_B, INTERLEAVED, ZBV"));
  }
  if (!v1::SequenceParallelMode_IsValid(p.sp_mode())) {
    return Invalid(
        absl::StrCat("unknown parallel.sp_mode value ", p.sp_mode(), "; valid: SP_NONE, SPLIT_GATHER, RING"));
  }
  r.tp = std::max<int64_t>(p.tp_size(), 1);
  r.tp_on = r.tp > 1;  // as HybridParallelPlugin: tp_size 1 means TP off
  const int64_t pp = std::max<int64_t>(p.pp_size(), 1);
  r.style = p.pp_style();
  if (r.style == v1::PIPELINE_STYLE_UNSPECIFIED && pp > 1) r.style = v1::ONE_F_ONE_B;
  // A stage manager exists for a real pipeline, and also for a one-stage interleaved or V layout
  // (ColossalAI's stage manager supports S = 1 with several chunks).
  r.pipeline = pp > 1 || r.style == v1::INTERLEAVED || r.style == v1::ZBV;
  r.stages = pp;
  r.interleave = r.style == v1::INTERLEAVED || r.style == v1::ZBV;
  r.zbv = r.style == v1::ZBV;
  r.chunks = p.num_model_chunks() > 0 ? p.num_model_chunks() : (r.interleave ? 2 : 1);
  if (!r.pipeline && r.chunks != 1) {
    return Invalid(absl::StrCat("parallel.num_model_chunks ", r.chunks,
                                " needs a pipeline: set pp_size > 1 and pp_style INTERLEAVED "
                                "(or ZBV with 2 chunks)"));
  }
  if (r.style == v1::ONE_F_ONE_B && r.chunks != 1) {
    return Invalid(absl::StrCat("pp_style ONE_F_ONE_B needs num_model_chunks 1, got ", r.chunks,
                                "; use pp_style INTERLEAVED for ", r.chunks, " chunks"));
  }
  if (r.style == v1::INTERLEAVED && r.chunks < 2) {
    return Invalid(absl::StrCat("pp_style INTERLEAVED needs num_model_chunks > 1, got ", r.chunks,
                                "; use ONE_F_ONE_B for one chunk per stage"));
  }
  if (r.style == v1::ZBV && r.chunks != 2) {
    return Invalid(absl::StrCat("pp_style ZBV needs num_model_chunks == 2 (the V has two legs), got ", r.chunks));
  }
  if (r.tp * r.stages > kMaxParallelSize) {
    return Invalid(
        absl::StrCat("tp_size x pp_size is ", r.tp * r.stages, "; at most ", kMaxParallelSize, " ranks are supported"));
  }
  const int64_t slots = r.stages * r.chunks;
  if (slots > kMaxParallelSize) {
    return Invalid(absl::StrCat("pp_size x num_model_chunks is ", slots, "; at most ", kMaxParallelSize,
                                " pipeline slots are supported"));
  }
  if (p.num_layers_per_stage_size() > 0) {
    if (p.num_layers_per_stage_size() != slots) {
      return Invalid(absl::StrCat("parallel.num_layers_per_stage has ", p.num_layers_per_stage_size(),
                                  " entries; it needs one per pipeline slot (pp_size x "
                                  "num_model_chunks = ",
                                  slots, ")"));
    }
    int64_t sum = 0;
    for (int64_t n : p.num_layers_per_stage()) {
      if (n < 0 || n > kMaxLayers) {
        return Invalid(
            absl::StrCat("parallel.num_layers_per_stage has ", n, "; each count must be in 0..num_hidden_layers"));
      }
      sum += n;
    }
    if (sum != r.layers) {
      return Invalid(
          absl::StrCat("parallel.num_layers_per_stage sums to ", sum, "; it must sum to num_hidden_layers ", r.layers));
    }
    r.layers_per_slot.assign(p.num_layers_per_stage().begin(), p.num_layers_per_stage().end());
  } else {
    r.layers_per_slot = DistributeLayers(r.layers, r.stages, r.chunks);
  }
  r.vocab_multiple = p.make_vocab_size_divisible_by() > 0 ? p.make_vocab_size_divisible_by() : 64;
  // The padded vocabulary (a multiple of make_vocab_size_divisible_by x tp) must fit too.
  if (RoundUp(r.vocab, r.vocab_multiple * r.tp) > kMaxTensorElements / r.hidden) {
    return Invalid(absl::StrCat("the word embedding padded to a multiple of make_vocab_size_divisible_by ",
                                r.vocab_multiple, " x tp_size ", r.tp,
                                " has more than 2^31 elements; use a smaller multiple"));
  }
  r.fp8 = p.fp8_communication();
  // Contract difference 8: all optimisations means fused norm and the JIT paths, no apex needed.
  r.all_opt = p.enable_all_optimization();
  r.fused_norm = p.enable_fused_normalization() || r.all_opt;
  r.jit = p.enable_jit_fused() || r.all_opt;

  // --- sequence parallelism (ShardConfig.__post_init__, then the policy) ---
  const v1::SequenceParallelMode sp = p.sp_mode();
  if ((sp == v1::SPLIT_GATHER || sp == v1::RING) && !r.tp_on) {
    return Invalid(absl::StrCat("sequence parallelism mode ", sp == v1::RING ? "ring" : "split_gather",
                                " can only be used when enable_tensor_parallelism is True; set "
                                "tp_size > 1 (valid: ",
                                Join(ValidTpSizes(r.config)), ") or sp_mode SP_NONE"));
  }
  if (sp == v1::ALL_TO_ALL) {
    return Invalid(
        "all_to_all sequence parallelism is not supported for Bert; valid sp_mode: SP_NONE, "
        "SPLIT_GATHER, RING");
  }
  if (sp == v1::RING_ATTN) {
    // Contract difference 3: the seed silently runs plain TP.
    return Invalid(
        "ring_attn sequence parallelism is not supported for Bert (ColossalAI would silently run "
        "plain tensor parallelism); valid sp_mode: SP_NONE, SPLIT_GATHER, RING");
  }
  if (sp == v1::RING) r.warnings.push_back(kRingWarning);
  r.sp = sp == v1::SP_NONE ? v1::SP_NONE : v1::SPLIT_GATHER;

  // --- tensor parallel divisibility (contract difference 7: refused at plan time) ---
  if (r.tp_on) {
    if (r.heads % r.tp != 0) {
      return Invalid(absl::StrCat("tp_size ", r.tp, " does not divide num_attention_heads ", r.heads,
                                  "; valid tp_size values: ", Join(ValidTpSizes(r.config))));
    }
    if (r.hidden % r.tp != 0) {
      return Invalid(absl::StrCat("tp_size ", r.tp, " does not divide hidden_size ", r.hidden,
                                  "; valid tp_size values: ", Join(ValidTpSizes(r.config))));
    }
    if (r.intermediate % r.tp != 0) {
      return Invalid(absl::StrCat("tp_size ", r.tp, " does not divide intermediate_size ", r.intermediate,
                                  "; valid tp_size values: ", Join(ValidTpSizes(r.config))));
    }
    if (r.config.add_cross_attention()) {
      // Contract difference 4: the seed rewrites head counts but leaves the linears whole.
      return Invalid(
          "add_cross_attention with tensor parallelism is not supported (the cross-attention "
          "linears would not be sharded); use tp_size 1 or a model without cross-attention");
    }
  }
  return r;
}

// ---------------------------------------------------------------------------------------------
// module_policy(): the seed's dict, in key-creation order.

class PolicyBuilder {
 public:
  explicit PolicyBuilder(google::protobuf::RepeatedPtrField<v1::ModulePolicyEntry>* entries) : entries_(entries) {}

  // The entry of `target_class`, created at the end if new (Python dict order).
  v1::ModulePolicyEntry* Entry(absl::string_view target_class) {
    for (auto& e : *entries_) {
      if (e.target_class() == target_class) return &e;
    }
    v1::ModulePolicyEntry* e = entries_->Add();
    e->set_target_class(std::string(target_class));
    return e;
  }

  // policy[cls] = ModulePolicyDescription(...): replaces an existing entry in place.
  v1::ModulePolicyEntry* Replace(absl::string_view target_class) {
    v1::ModulePolicyEntry* e = Entry(target_class);
    e->Clear();
    e->set_target_class(std::string(target_class));
    return e;
  }

  static google::protobuf::Struct* AddSub(v1::ModulePolicyEntry* e, absl::string_view suffix, absl::string_view layer,
                                          bool has_kwargs) {
    v1::SubmoduleReplacement* s = e->add_submodule_replacements();
    s->set_suffix(std::string(suffix));
    s->set_layer(std::string(layer));
    return has_kwargs ? s->mutable_kwargs() : nullptr;
  }

  // append_or_create_method_replacement: dict.update semantics.
  static void SetMethod(v1::ModulePolicyEntry* e, absl::string_view method, absl::string_view impl) {
    for (auto& m : *e->mutable_method_replacements()) {
      if (m.method() == method) {
        m.set_impl(std::string(impl));
        return;
      }
    }
    v1::MethodReplacement* m = e->add_method_replacements();
    m->set_method(std::string(method));
    m->set_impl(std::string(impl));
  }

 private:
  google::protobuf::RepeatedPtrField<v1::ModulePolicyEntry>* entries_;
};

void SetNull(google::protobuf::Struct* s, const char* key) {
  (*s->mutable_fields())[key].set_null_value(google::protobuf::NULL_VALUE);
}
void SetBool(google::protobuf::Struct* s, const char* key, bool v) { (*s->mutable_fields())[key].set_bool_value(v); }
void SetString(google::protobuf::Struct* s, const char* key, const char* v) {
  (*s->mutable_fields())[key].set_string_value(v);
}
void SetNumber(google::protobuf::Struct* s, const char* key, double v) {
  (*s->mutable_fields())[key].set_number_value(v);
}

void BuildModulePolicy(const Resolved& r, bool bias_gelu_fused, v1::ShardPlan* plan) {
  PolicyBuilder policy(plan->mutable_module_policy());
  const bool split_gather = r.sp == v1::SPLIT_GATHER;
  const bool use_zbv = r.pipeline && r.zbv;
  const char* norm_cls = r.fused_norm ? "FusedLayerNorm" : "LayerNorm";
  const char* embedding_cls = r.tp_on ? "VocabParallelEmbedding1D" : (r.tie_weight ? "PaddingEmbedding" : nullptr);

  auto linear = [&](v1::ModulePolicyEntry* e, const char* suffix, const char* layer, bool with_skip_bias) {
    google::protobuf::Struct* kw = PolicyBuilder::AddSub(e, suffix, layer, true);
    if (split_gather) {
      SetString(kw, "seq_parallel_mode", "split_gather");
    } else {
      SetNull(kw, "seq_parallel_mode");
    }
    if (with_skip_bias) SetBool(kw, "skip_bias_add", bias_gelu_fused);
    SetBool(kw, "fp8_communication", r.fp8);
    SetBool(kw, "use_zbv", use_zbv);
  };

  if (r.tp_on || use_zbv) {
    v1::ModulePolicyEntry* layer = policy.Replace("BertLayer");
    const char* col = r.tp_on ? "Linear1D_Col" : "LinearWithGradAccum";
    const char* row = r.tp_on ? "Linear1D_Row" : "LinearWithGradAccum";
    if (r.tp_on) {
      const int64_t head_size = r.hidden / r.tp;
      const int64_t local_heads = r.heads / r.tp;
      const std::pair<const char*, int64_t> attrs[] = {
          {"attention.self.all_head_size", head_size},
          {"crossattention.self.all_head_size", head_size},
          {"attention.self.num_attention_heads", local_heads},
          {"crossattention.self.num_attention_heads", local_heads},
      };
      for (const auto& [attribute, value] : attrs) {
        v1::AttributeReplacement* a = layer->add_attribute_replacements();
        a->set_attribute(attribute);
        a->mutable_value()->set_number_value(static_cast<double>(value));
      }
    }
    linear(layer, "attention.self.query", col, false);
    linear(layer, "attention.self.key", col, false);
    linear(layer, "attention.self.value", col, false);
    PolicyBuilder::AddSub(layer, "attention.self.dropout", "DropoutForParallelInput", false);
    linear(layer, "attention.output.dense", row, false);
    PolicyBuilder::AddSub(layer, "attention.output.dropout", "DropoutForParallelInput", false);
    linear(layer, "intermediate.dense", col, true);
    linear(layer, "output.dense", row, false);
    PolicyBuilder::AddSub(layer, "output.dropout", "DropoutForParallelInput", false);

    PolicyBuilder::AddSub(policy.Replace("BertEmbeddings"), "dropout", "DropoutForReplicatedInput", false);
    if (bias_gelu_fused) {
      PolicyBuilder::SetMethod(policy.Entry("BertIntermediate"), "forward", "get_jit_fused_bert_intermediate_forward");
    }
  }
  if (split_gather) {
    PolicyBuilder::SetMethod(policy.Entry("BertModel"), "forward", "bert_sequence_parallel_forward_fn");
  }
  if (embedding_cls != nullptr) {
    google::protobuf::Struct* kw =
        PolicyBuilder::AddSub(policy.Entry("BertEmbeddings"), "word_embeddings", embedding_cls, true);
    if (r.tp_on) SetBool(kw, "fp8_communication", r.fp8);
  }
  {
    v1::ModulePolicyEntry* layer = policy.Entry("BertLayer");
    SetBool(PolicyBuilder::AddSub(layer, "attention.output.LayerNorm", norm_cls, true), "sp_partial_derived",
            split_gather);
    SetBool(PolicyBuilder::AddSub(layer, "output.LayerNorm", norm_cls, true), "sp_partial_derived", split_gather);
    PolicyBuilder::AddSub(policy.Entry("BertEmbeddings"), "LayerNorm", norm_cls, false);
  }
  if (r.jit) {
    for (const char* cls : {"BertSelfOutput", "BertOutput"}) {
      v1::ModulePolicyEntry* e = policy.Entry(cls);
      PolicyBuilder::SetMethod(e, "forward",
                               absl::string_view(cls) == "BertSelfOutput" ? "get_jit_fused_bert_self_output_forward"
                                                                          : "get_jit_fused_bert_output_forward");
      PolicyBuilder::SetMethod(e, "dropout_add", "get_jit_fused_dropout_add_func");
    }
  }
  // Variant additions.
  if (IsLmVariant(r.variant)) {
    v1::ModulePolicyEntry* head = policy.Entry("BertLMPredictionHead");
    if (r.tp_on) {
      google::protobuf::Struct* kw = PolicyBuilder::AddSub(head, "decoder", "VocabParallelLMHead1D", true);
      SetBool(kw, "gather_output", true);
      SetNumber(kw, "make_vocab_size_divisible_by", static_cast<double>(r.vocab_multiple));
      SetBool(kw, "fp8_communication", r.fp8);
    } else {
      SetNumber(PolicyBuilder::AddSub(head, "decoder", "PaddingLMHead", true), "make_vocab_size_divisible_by",
                static_cast<double>(r.vocab_multiple));
    }
    if (r.fused_norm) PolicyBuilder::AddSub(head, "transform.LayerNorm", "FusedLayerNorm", false);
    PolicyBuilder::SetMethod(head, "_save_to_state_dict", "ParallelModule._save_to_state_dict");
    PolicyBuilder::SetMethod(head, "_load_from_state_dict", "ParallelModule._load_from_state_dict");
  }
  const std::string variant_class(HfClassName(r.variant));
  if (r.tp_on && (r.variant == v1::BERT_FOR_SEQUENCE_CLASSIFICATION || r.variant == v1::BERT_FOR_TOKEN_CLASSIFICATION ||
                  r.variant == v1::BERT_FOR_MULTIPLE_CHOICE)) {
    PolicyBuilder::AddSub(policy.Replace(variant_class), "dropout", "DropoutForParallelInput", false);
  }
  if (r.pipeline) {
    PolicyBuilder::SetMethod(policy.Entry(variant_class), "forward",
                             absl::StrCat("BertPipelineForwards.", PipelineForwardName(r.variant)));
  }
}

// ---------------------------------------------------------------------------------------------
// The tensor table.

enum class Split {
  kReplicated,
  kOutputs,     // Linear1D_Col: weight and bias split on dim 0
  kInputs,      // Linear1D_Row: weight split on dim 1 (its bias is replicated)
  kVocabEmbed,  // word embeddings: vocab-parallel (TP) or padded (TP off, tied)
  kVocabHead,   // LM decoder weight and bias: vocab-parallel (TP) or padded (TP off)
};

struct ParamSpec {
  std::string name;
  int64_t rows = 0;
  int64_t cols = 0;  // 0 for a vector
  Split split = Split::kReplicated;
  std::vector<std::string> aliases;
};

class TensorTable {
 public:
  explicit TensorTable(const Resolved& r) : r_(r), prefix_(r.variant == v1::BERT_MODEL ? "" : "bert.") {}

  // Parameters of the held modules of one stage, in HF named_parameters order (tied tensors once).
  std::vector<ParamSpec> StageParams(const std::vector<std::string>& modules) const {
    std::vector<ParamSpec> params;
    bool holds_embeddings = false;
    for (const std::string& m : modules) holds_embeddings |= (m == "embeddings");
    for (const std::string& m : modules) {
      if (m == "embeddings") {
        ParamSpec word{prefix_ + "embeddings.word_embeddings.weight", r_.vocab, r_.hidden, Split::kVocabEmbed};
        if (r_.tie_weight) word.aliases.push_back("cls.predictions.decoder.weight");
        params.push_back(std::move(word));
        Add(&params, prefix_ + "embeddings.position_embeddings.weight", r_.config.max_position_embeddings(), r_.hidden);
        Add(&params, prefix_ + "embeddings.token_type_embeddings.weight", r_.config.type_vocab_size(), r_.hidden);
        AddNorm(&params, prefix_ + "embeddings.LayerNorm");
      } else if (absl::StartsWith(m, "encoder.layer.")) {
        const std::string p = prefix_ + m + ".";
        for (const char* proj : {"query", "key", "value"}) {
          AddLinear(&params, absl::StrCat(p, "attention.self.", proj), r_.hidden, r_.hidden, Split::kOutputs);
        }
        AddLinear(&params, p + "attention.output.dense", r_.hidden, r_.hidden, Split::kInputs);
        AddNorm(&params, p + "attention.output.LayerNorm");
        if (r_.config.add_cross_attention()) {
          for (const char* proj : {"query", "key", "value"}) {
            AddLinear(&params, absl::StrCat(p, "crossattention.self.", proj), r_.hidden, r_.hidden, Split::kReplicated);
          }
          AddLinear(&params, p + "crossattention.output.dense", r_.hidden, r_.hidden, Split::kReplicated);
          AddNorm(&params, p + "crossattention.output.LayerNorm");
        }
        AddLinear(&params, p + "intermediate.dense", r_.intermediate, r_.hidden, Split::kOutputs);
        AddLinear(&params, p + "output.dense", r_.hidden, r_.intermediate, Split::kInputs);
        AddNorm(&params, p + "output.LayerNorm");
      } else if (m == "pooler") {
        AddLinear(&params, prefix_ + "pooler.dense", r_.hidden, r_.hidden, Split::kReplicated);
      } else if (m == "cls") {
        if (IsLmVariant(r_.variant)) {
          // BertLMPredictionHead registers its own `bias` (shared with decoder.bias) first.
          params.push_back({"cls.predictions.bias", r_.vocab, 0, Split::kVocabHead, {"cls.predictions.decoder.bias"}});
          AddLinear(&params, "cls.predictions.transform.dense", r_.hidden, r_.hidden, Split::kReplicated);
          AddNorm(&params, "cls.predictions.transform.LayerNorm");
          if (!(r_.tie_weight && holds_embeddings)) {
            ParamSpec decoder{"cls.predictions.decoder.weight", r_.vocab, r_.hidden, Split::kVocabHead};
            if (r_.tie_weight) decoder.aliases.push_back(prefix_ + "embeddings.word_embeddings.weight");
            params.push_back(std::move(decoder));
          }
        }
        if (r_.variant == v1::BERT_FOR_PRE_TRAINING || r_.variant == v1::BERT_FOR_NEXT_SENTENCE_PREDICTION) {
          AddLinear(&params, "cls.seq_relationship", 2, r_.hidden, Split::kReplicated);
        }
      } else if (m == "classifier") {
        const int64_t out = r_.variant == v1::BERT_FOR_MULTIPLE_CHOICE ? 1 : r_.config.num_labels();
        AddLinear(&params, "classifier", out, r_.hidden, Split::kReplicated);
      } else if (m == "qa_outputs") {
        AddLinear(&params, "qa_outputs", r_.config.num_labels(), r_.hidden, Split::kReplicated);
      }
      // "dropout" has no parameters.
    }
    return params;
  }

  // Fills `rank` with the slices `tp_rank` holds of `params`.
  void FillRank(const std::vector<ParamSpec>& params, int64_t tp_rank, v1::RankShard* rank) const {
    int64_t total = 0;
    rank->mutable_tensors()->Reserve(static_cast<int>(params.size()));
    for (const ParamSpec& spec : params) {
      v1::TensorShard* t = rank->add_tensors();
      t->set_name(spec.name);
      t->add_global_shape(spec.rows);
      if (spec.cols > 0) t->add_global_shape(spec.cols);
      int64_t local_rows = spec.rows, local_cols = spec.cols;
      t->set_split_dim(-1);
      switch (spec.split) {
        case Split::kReplicated:
          break;
        case Split::kOutputs:
          if (r_.tp_on) {
            local_rows = spec.rows / r_.tp;
            SetSlice(t, 0, tp_rank * local_rows, (tp_rank + 1) * local_rows, spec.rows);
          }
          break;
        case Split::kInputs:
          if (r_.tp_on) {
            local_cols = spec.cols / r_.tp;
            SetSlice(t, 1, tp_rank * local_cols, (tp_rank + 1) * local_cols, spec.cols);
          }
          break;
        case Split::kVocabEmbed:
        case Split::kVocabHead: {
          // Contract difference 2: embedding and LM head pad with the same multiple.
          const bool padded = r_.tp_on || spec.split == Split::kVocabHead || r_.tie_weight;
          if (!padded) break;
          const int64_t multiple = r_.tp_on ? r_.vocab_multiple * r_.tp : r_.vocab_multiple;
          const int64_t padded_rows = RoundUp(spec.rows, multiple);
          if (!r_.tp_on && padded_rows == spec.rows) break;  // nothing to pad or split
          local_rows = padded_rows / r_.tp;
          SetSlice(t, 0, tp_rank * local_rows, (tp_rank + 1) * local_rows, spec.rows);
          break;
        }
      }
      t->add_local_shape(local_rows);
      if (spec.cols > 0) t->add_local_shape(local_cols);
      const int64_t bytes = local_rows * std::max<int64_t>(local_cols, 1) * DtypeBytes(r_.dtype);
      t->set_bytes(bytes);
      total += bytes;
      for (const std::string& a : spec.aliases) t->add_aliases(a);
    }
    rank->set_param_bytes(total);
  }

 private:
  static void SetSlice(v1::TensorShard* t, int dim, int64_t start, int64_t end, int64_t real) {
    t->set_split_dim(dim);
    t->set_start(start);
    t->set_end(end);
    t->set_padding(end - std::max(start, std::min(end, real)));
  }

  static void Add(std::vector<ParamSpec>* params, std::string name, int64_t rows, int64_t cols,
                  Split split = Split::kReplicated) {
    params->push_back({std::move(name), rows, cols, split, {}});
  }
  void AddNorm(std::vector<ParamSpec>* params, const std::string& module) const {
    Add(params, module + ".weight", r_.hidden, 0);
    Add(params, module + ".bias", r_.hidden, 0);
  }
  static void AddLinear(std::vector<ParamSpec>* params, const std::string& module, int64_t out, int64_t in,
                        Split split) {
    Add(params, module + ".weight", out, in, split);
    // Linear1D_Row keeps the whole bias on every rank (added once after the all-reduce).
    Add(params, module + ".bias", out, 0, split == Split::kInputs ? Split::kReplicated : split);
  }

  const Resolved& r_;
  const std::string prefix_;
};

}  // namespace

std::vector<int64_t> ValidTpSizes(const v1::BertConfig& config) {
  const int64_t g = std::gcd(config.num_attention_heads(), config.intermediate_size());
  std::vector<int64_t> sizes;
  for (int64_t d = 1; d <= g && d <= kMaxParallelSize; ++d) {
    if (g % d == 0 && config.hidden_size() % d == 0) sizes.push_back(d);
  }
  return sizes;
}

absl::Status PlanInto(const v1::PlanRequest& request, v1::ShardPlan* plan) {
  v1::PlanRequest resolved_request = request;
  RETURN_IF_ERROR(ResolveCheckpoint(&resolved_request));
  ASSIGN_OR_RETURN(const Resolved r, Resolve(resolved_request));

  plan->Clear();
  plan->set_variant(r.variant);
  *plan->mutable_config() = r.config;
  plan->set_world_size(static_cast<int32_t>(r.tp * r.stages));
  plan->set_dtype(r.dtype);

  v1::ShardConfig* sc = plan->mutable_shard_config();
  sc->set_tensor_parallel_size(static_cast<int32_t>(r.tp));
  sc->set_enable_tensor_parallelism(r.tp_on);
  sc->set_enable_sequence_parallelism(r.sp != v1::SP_NONE);
  sc->set_sp_mode(r.sp);
  // split_gather runs over the TP group (HybridParallelPlugin forces a separate SP axis of 1).
  sc->set_sequence_parallel_size(r.sp != v1::SP_NONE ? static_cast<int32_t>(r.tp) : 1);
  sc->set_enable_fused_normalization(r.fused_norm);
  sc->set_enable_jit_fused(r.jit);
  sc->set_enable_flash_attention(r.all_opt);
  sc->set_enable_all_optimization(r.all_opt);
  sc->set_fp8_communication(r.fp8);
  sc->set_make_vocab_size_divisible_by(static_cast<int32_t>(r.vocab_multiple));
  sc->set_pp_size(static_cast<int32_t>(r.stages));
  sc->set_pp_style(r.pipeline ? r.style : v1::PIPELINE_STYLE_UNSPECIFIED);
  sc->set_num_model_chunks(static_cast<int32_t>(r.chunks));

  for (const std::string& w : r.warnings) plan->add_warnings(w);
  plan->set_tie_weight(r.tie_weight);
  const bool bias_gelu_fused = r.jit && r.config.hidden_act() == "gelu";
  plan->set_enable_bias_gelu_fused(bias_gelu_fused);
  BuildModulePolicy(r, bias_gelu_fused, plan);

  for (int64_t n : r.layers_per_slot) plan->add_layers_per_stage(static_cast<int32_t>(n));

  // Contract difference 1: under ZBV the V ends on stage 0, so the pooler and heads live there.
  const int64_t head_stage = r.zbv ? 0 : r.stages - 1;
  const std::string prefix = r.variant == v1::BERT_MODEL ? "" : "bert.";
  const std::vector<std::string> heads = HeadModules(r.variant);
  const TensorTable table(r);
  for (int64_t s = 0; s < r.stages; ++s) {
    v1::Stage* stage = plan->add_stages();
    stage->set_stage(static_cast<int32_t>(s));
    stage->set_is_first(s == 0);
    stage->set_is_last(s == head_stage);
    std::vector<LayerSpan> ranges = r.pipeline ? StageLayerRanges(r.layers_per_slot, s, r.stages, r.chunks, r.zbv)
                                               : std::vector<LayerSpan>{{0, r.layers}};
    std::vector<std::string> modules;  // relative to the trunk for trunk modules
    if (s == 0) modules.push_back("embeddings");
    for (const LayerSpan& span : ranges) {
      v1::LayerRange* lr = stage->add_layer_ranges();
      lr->set_start(static_cast<int32_t>(span.start));
      lr->set_end(static_cast<int32_t>(span.end));
      for (int64_t l = span.start; l < span.end; ++l) modules.push_back(absl::StrCat("encoder.layer.", l));
    }
    const size_t trunk_count = modules.size() + (s == head_stage && HasPooler(r.variant) ? 1 : 0);
    if (s == head_stage) {
      // Contract difference 5: no entry for a pooler the variant does not have.
      if (HasPooler(r.variant)) modules.push_back("pooler");
      modules.insert(modules.end(), heads.begin(), heads.end());
    }
    for (size_t i = 0; i < modules.size(); ++i) {
      stage->add_held_modules(i < trunk_count ? prefix + modules[i] : modules[i]);
    }
    const std::vector<ParamSpec> params = table.StageParams(modules);
    for (int64_t t = 0; t < r.tp; ++t) {
      v1::RankShard* rank = plan->add_ranks();
      rank->set_rank(static_cast<int32_t>(s * r.tp + t));
      rank->set_stage(static_cast<int32_t>(s));
      rank->set_tp_rank(static_cast<int32_t>(t));
      table.FillRank(params, t, rank);
    }
  }

  // Tied weights shared across stages (none under ZBV: both ends of the V are on stage 0).
  if (r.pipeline && r.stages > 1 && r.tie_weight && !r.zbv) {
    v1::SharedParam* shared = plan->add_shared_params();
    v1::SharedParamMember* first = shared->add_members();
    first->set_stage(0);
    first->set_param(prefix + "embeddings.word_embeddings.weight");
    v1::SharedParamMember* last = shared->add_members();
    last->set_stage(static_cast<int32_t>(r.stages - 1));
    last->set_param("cls.predictions.decoder.weight");
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::ShardPlan> Plan(const v1::PlanRequest& request) {
  v1::ShardPlan plan;
  RETURN_IF_ERROR(PlanInto(request, &plan));
  return plan;
}

}  // namespace bertshard::planner
