// File: planner/module_policy.cc
// -----------------------------------------------------------------------------
// BuildModulePolicy (module_policy.h): the policy dict built entry by entry as BertPolicy
// builds it, through PolicyBuilder (Python dict semantics) and the Struct kwargs setters.
//
// Thread safety: thread-safe (no shared state).
#include "planner/module_policy.h"

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "google/protobuf/struct.pb.h"
#include "planner/model_config.h"

namespace bertshard::planner {
namespace {

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

}  // namespace

void BuildModulePolicy(const ResolvedRequest& r, bool bias_gelu_fused, v1::ShardPlan* plan) {
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

}  // namespace bertshard::planner
