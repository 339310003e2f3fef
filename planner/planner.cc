// File: planner/planner.cc
// -----------------------------------------------------------------------------
// Plan and PlanInto (planner.h): the request resolved (plan_request_resolution.h), then the
// plan's shard config, module policy (module_policy.h), stages with their held modules, and the
// per-rank tensor table (TensorTable, below), and the tied weights shared across stages.
//
// Thread safety: thread-safe (no shared state).
#include "planner/planner.h"

#include <algorithm>
#include <numeric>
#include <string>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "planner/model_config.h"
#include "planner/module_policy.h"
#include "planner/plan_request_resolution.h"
#include "planner/stage_layout.h"

namespace bertshard::planner {
namespace {

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
  explicit TensorTable(const ResolvedRequest& r) : r_(r), prefix_(r.variant == v1::BERT_MODEL ? "" : "bert.") {}

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

  const ResolvedRequest& r_;
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
  ASSIGN_OR_RETURN(const ResolvedRequest r, ResolveRequest(resolved_request));

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
