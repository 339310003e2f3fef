// File: planner/plan_request_resolution.cc
// -----------------------------------------------------------------------------
// ResolveRequest: a PlanRequest validated and normalised (see plan_request_resolution.h), with
// the config checks of ValidateConfig.
//
// Thread safety: thread-safe (no shared state).
#include "planner/plan_request_resolution.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "planner/model_config.h"
#include "planner/planner.h"
#include "planner/stage_layout.h"

namespace bertshard::planner {
namespace {

constexpr char kRingWarning[] =
    "For Bert, sequence parallelism is currently not support mode ring, will set to be "
    "split_gather";

// The activations the executor implements (HF ACT2FN names).
constexpr absl::string_view kSupportedActivations[] = {"gelu", "gelu_new", "gelu_pytorch_tanh", "relu"};

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

}  // namespace

int64_t RoundUp(int64_t value, int64_t multiple) {
  return value % multiple == 0 ? value : value + multiple - value % multiple;
}

absl::StatusOr<ResolvedRequest> ResolveRequest(const v1::PlanRequest& request) {
  ResolvedRequest r;
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

}  // namespace bertshard::planner
