// Compares the planner with vectors recorded from ColossalAI's own code (tests/testdata/golden,
// provenance in its README), field by field, after applying exactly the deliberate differences
// listed in docs/plan-contract.md (each is named where it is applied) and nothing else.
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "planner/model_config.h"
#include "planner/planner.h"
#include "planner/stage_layout.h"

namespace bertshard {
namespace {

using nlohmann::json;

json LoadGolden(const std::string& name) {
  std::ifstream in("tests/testdata/golden/" + name);
  EXPECT_TRUE(in.good()) << "missing golden file " << name;
  std::stringstream text;
  text << in.rdbuf();
  return json::parse(text.str());
}

v1::SequenceParallelMode SpMode(const json& mode) {
  if (mode.is_null()) return v1::SP_NONE;
  const std::string m = mode.get<std::string>();
  if (m == "split_gather") return v1::SPLIT_GATHER;
  if (m == "ring") return v1::RING;
  if (m == "all_to_all") return v1::ALL_TO_ALL;
  if (m == "ring_attn") return v1::RING_ATTN;
  ADD_FAILURE() << "unknown sp mode " << m;
  return v1::SP_NONE;
}

v1::PipelineStyle Style(const json& style) {
  if (style.is_null()) return v1::PIPELINE_STYLE_UNSPECIFIED;
  const std::string s = style.get<std::string>();
  if (s == "1f1b") return v1::ONE_F_ONE_B;
  if (s == "interleaved") return v1::INTERLEAVED;
  if (s == "zbv") return v1::ZBV;
  ADD_FAILURE() << "unknown style " << s;
  return v1::PIPELINE_STYLE_UNSPECIFIED;
}

void SetPipeline(const json& pp, v1::ParallelConfig* p) {
  if (pp["pp_style"].is_null()) return;
  p->set_pp_size(pp["num_stages"].get<int64_t>());
  p->set_pp_style(Style(pp["pp_style"]));
  p->set_num_model_chunks(pp["num_model_chunks"].get<int64_t>());
}

void SetModelConfig(const json& mc, v1::BertConfig* c) {
  c->set_vocab_size(mc["vocab_size"].get<int64_t>());
  c->set_hidden_size(mc["hidden_size"].get<int64_t>());
  c->set_num_attention_heads(mc["num_attention_heads"].get<int64_t>());
  c->set_intermediate_size(mc["intermediate_size"].get<int64_t>());
  c->set_num_hidden_layers(mc["num_hidden_layers"].get<int64_t>());
  if (mc.contains("hidden_act")) c->set_hidden_act(mc["hidden_act"].get<std::string>());
  if (mc.contains("tie_word_embeddings")) c->set_tie_word_embeddings(mc["tie_word_embeddings"].get<bool>());
  if (mc.contains("max_position_embeddings"))
    c->set_max_position_embeddings(mc["max_position_embeddings"].get<int64_t>());
  if (mc.contains("type_vocab_size")) c->set_type_vocab_size(mc["type_vocab_size"].get<int64_t>());
  if (mc.contains("add_cross_attention")) c->set_add_cross_attention(mc["add_cross_attention"].get<bool>());
  if (mc.contains("is_decoder")) c->set_is_decoder(mc["is_decoder"].get<bool>());
}

// "colossalai.shardformer.modeling.bert:BertPipelineForwards.bert_model_forward" ->
// "BertPipelineForwards.bert_model_forward"; "...:get_jit_fused_x.<locals>.forward" -> "get_jit_fused_x".
std::string ImplName(const std::string& target) {
  std::string name = target.substr(target.find(':') + 1);
  const size_t locals = name.find(".<locals>");
  return locals == std::string::npos ? name : name.substr(0, locals);
}

json KwargsToJson(const google::protobuf::Struct& s) {
  json out = json::object();
  for (const auto& [key, value] : s.fields()) {
    switch (value.kind_case()) {
      case google::protobuf::Value::kNullValue:
        out[key] = nullptr;
        break;
      case google::protobuf::Value::kBoolValue:
        out[key] = value.bool_value();
        break;
      case google::protobuf::Value::kNumberValue:
        out[key] = static_cast<int64_t>(value.number_value());
        break;
      case google::protobuf::Value::kStringValue:
        out[key] = value.string_value();
        break;
      default:
        ADD_FAILURE() << "unexpected kwarg kind for " << key;
    }
  }
  return out;
}

// Our module_policy in the golden PolicyEntry shape (minus stage-bound partial arguments).
json PolicyToJson(const v1::ShardPlan& plan) {
  json entries = json::array();
  for (const auto& e : plan.module_policy()) {
    json entry = {{"target_class", e.target_class()}};
    json attrs = nullptr, subs = nullptr, methods = nullptr;
    for (const auto& a : e.attribute_replacements()) {
      if (attrs.is_null()) attrs = json::array();
      attrs.push_back({a.attribute(), static_cast<int64_t>(a.value().number_value())});
    }
    for (const auto& s : e.submodule_replacements()) {
      if (subs.is_null()) subs = json::array();
      subs.push_back({{"suffix", s.suffix()},
                      {"target_module", s.layer()},
                      {"kwargs", s.has_kwargs() ? KwargsToJson(s.kwargs()) : json(nullptr)}});
    }
    for (const auto& m : e.method_replacements()) {
      if (methods.is_null()) methods = json::array();
      methods.push_back({{"name", m.method()}, {"impl", m.impl()}});
    }
    entry["attribute_replacement"] = attrs;
    entry["sub_module_replacement"] = subs;
    entry["method_replacement"] = methods;
    entries.push_back(entry);
  }
  return entries;
}

json GoldenPolicyToJson(const json& ids, const json& table) {
  json entries = json::array();
  for (const auto& id : ids) {
    const json& e = table.at(id.get<std::string>());
    // A ColossalAI version newer than the seed adds this entry; the seed is the reference.
    if (e["target_class"] == "BertSdpaSelfAttention") continue;
    json entry = {{"target_class", e["target_class"]}, {"attribute_replacement", e["attribute_replacement"]}};
    json subs = nullptr, methods = nullptr;
    if (!e["sub_module_replacement"].is_null()) {
      subs = json::array();
      for (const auto& s : e["sub_module_replacement"]) {
        EXPECT_FALSE(s["ignore_if_not_exist"].get<bool>());
        subs.push_back({{"suffix", s["suffix"]}, {"target_module", s["target_module"]}, {"kwargs", s["kwargs"]}});
      }
    }
    if (!e["method_replacement"].is_null()) {
      methods = json::array();
      for (const auto& m : e["method_replacement"]) {
        methods.push_back({{"name", m["name"]}, {"impl", ImplName(m["target"].get<std::string>())}});
      }
    }
    entry["sub_module_replacement"] = subs;
    entry["method_replacement"] = methods;
    entries.push_back(entry);
  }
  return entries;
}

bool IsHead(const std::string& module) {
  return module == "cls" || module == "dropout" || module == "classifier" || module == "qa_outputs" ||
         absl::EndsWith(module, "pooler");
}

// Whether a parameter belongs to the pooler or a head ("bert.pooler.dense.weight", "cls.predictions.bias").
bool IsHeadTensor(const std::string& name) {
  const std::string trunk = absl::StartsWith(name, "bert.") ? name.substr(5) : name;
  return IsHead(trunk.substr(0, trunk.find('.')));
}

TEST(GoldenBertPolicy, EveryCaseMatchesSeedWithContractDifferences) {
  const json golden = LoadGolden("bert_policy.json");
  const json& entries = golden["policy_entries"];
  int compared = 0, refused = 0;
  for (const json& c : golden["cases"]) {
    const std::string label = c.dump().substr(0, 400);
    SCOPED_TRACE(label);
    v1::PlanRequest request;
    ASSERT_TRUE(planner::ParseVariant(c["variant"].get<std::string>()).ok());
    request.set_variant(*planner::ParseVariant(c["variant"].get<std::string>()));
    SetModelConfig(c["model_config"], request.mutable_config());
    v1::ParallelConfig* p = request.mutable_parallel();
    p->set_tp_size(c["tp"].get<int64_t>());
    p->set_sp_mode(SpMode(c["sp_mode"]));
    p->set_enable_fused_normalization(c["enable_fused_normalization"].get<bool>());
    p->set_enable_jit_fused(c["enable_jit_fused"].get<bool>());
    SetPipeline(c["pp"], p);
    const json& extra = c["extra_shard_config"];
    if (extra.contains("fp8_communication")) p->set_fp8_communication(extra["fp8_communication"].get<bool>());
    if (extra.contains("make_vocab_size_divisible_by")) {
      p->set_make_vocab_size_divisible_by(extra["make_vocab_size_divisible_by"].get<int64_t>());
    }
    const bool all_opt = extra.value("enable_all_optimization", false);
    p->set_enable_all_optimization(all_opt);

    absl::StatusOr<v1::ShardPlan> plan = planner::Plan(request);
    bool seed_error = !c["error"].is_null();
    for (const auto& s : c["stages"]) seed_error |= !s["error"].is_null();
    // Contract differences 3 and 4: refused where the seed would run a broken model.
    const bool refused_by_contract = c["sp_mode"] == "ring_attn" ||
                                     (c["tp"].get<int>() > 1 && c["model_config"].value("add_cross_attention", false));
    if (seed_error || refused_by_contract) {
      ASSERT_FALSE(plan.ok());
      EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
      if (seed_error && !refused_by_contract) {
        // The seed's own words stay in our message.
        std::string seed_message = c["error"].is_null() ? c["stages"][0]["error"]["message"].get<std::string>()
                                                        : c["error"]["message"].get<std::string>();
        if (absl::StrContains(seed_message, "attention heads must be divisible")) {
          EXPECT_TRUE(absl::StrContains(plan.status().message(), "does not divide num_attention_heads"))
              << plan.status();
        } else {
          EXPECT_TRUE(absl::StrContains(plan.status().message(), seed_message)) << plan.status();
        }
      }
      ++refused;
      continue;
    }
    ASSERT_TRUE(plan.ok()) << plan.status();
    ++compared;

    // ShardConfig: ring becomes split_gather (difference 3); all-optimisation turns fused
    // normalisation on without apex (difference 8).
    const json& sc = c["shard_config"];
    EXPECT_EQ(plan->shard_config().tensor_parallel_size(), sc["tensor_parallel_size"].get<int>());
    EXPECT_EQ(plan->shard_config().enable_tensor_parallelism(), sc["enable_tensor_parallelism"].get<bool>());
    EXPECT_EQ(plan->shard_config().enable_sequence_parallelism(), sc["enable_sequence_parallelism"].get<bool>());
    EXPECT_EQ(plan->shard_config().sp_mode(),
              sc["sequence_parallelism_mode"].is_null() ? v1::SP_NONE : v1::SPLIT_GATHER);
    EXPECT_EQ(plan->shard_config().enable_fused_normalization(),
              sc["enable_fused_normalization"].get<bool>() || all_opt);
    EXPECT_EQ(plan->shard_config().enable_jit_fused(), sc["enable_jit_fused"].get<bool>());
    EXPECT_EQ(plan->shard_config().enable_flash_attention(), sc["enable_flash_attention"].get<bool>());
    EXPECT_EQ(plan->shard_config().fp8_communication(), sc["fp8_communication"].get<bool>());
    EXPECT_EQ(plan->shard_config().make_vocab_size_divisible_by(), sc["make_vocab_size_divisible_by"].get<int>());
    EXPECT_EQ(plan->shard_config().sequence_parallel_size(), sc["sequence_parallel_size"].get<int>());

    const json& stage0 = c["stages"][0];
    std::vector<std::string> warnings;
    for (const auto& w : stage0["warnings"]) {
      std::string text = w.get<std::string>();
      if (absl::StrContains(text, "apex is not installed")) continue;  // difference 8
      ASSERT_TRUE(absl::StartsWith(text, "UserWarning: ")) << text;
      warnings.push_back(text.substr(13));
    }
    EXPECT_EQ(std::vector<std::string>(plan->warnings().begin(), plan->warnings().end()), warnings);
    EXPECT_EQ(plan->tie_weight(), stage0["tie_weight"].get<bool>());
    EXPECT_EQ(plan->enable_bias_gelu_fused(), stage0["enable_bias_gelu_fused"].get<bool>());
    if (!all_opt) {
      // The policy differs per stage only in the bound stage_index, which the contract drops.
      EXPECT_EQ(PolicyToJson(*plan).dump(), GoldenPolicyToJson(stage0["module_policy"], entries).dump());
    }

    // Held layers: no None entries (difference 5); under ZBV the pooler and heads move from the
    // last stage to stage 0 (difference 1).
    const bool zbv = c["pp"]["pp_style"] == "zbv";
    std::vector<std::vector<std::string>> expected(c["stages"].size());
    std::vector<std::string> moved;
    for (size_t s = 0; s < c["stages"].size(); ++s) {
      const json& st = c["stages"][s];
      if (c["pp"]["pp_style"].is_null()) break;
      ASSERT_FALSE(st.contains("held_layers_error"));
      for (const auto& m : st["held_layers"]) {
        if (m.is_null()) continue;
        const std::string name = m.get<std::string>();
        if (zbv && IsHead(name)) {
          moved.push_back(name);
        } else {
          expected[s].push_back(name);
        }
      }
    }
    if (zbv) expected[0].insert(expected[0].end(), moved.begin(), moved.end());
    if (!c["pp"]["pp_style"].is_null()) {
      ASSERT_EQ(plan->stages_size(), static_cast<int>(expected.size()));
      for (int s = 0; s < plan->stages_size(); ++s) {
        EXPECT_EQ(
            std::vector<std::string>(plan->stages(s).held_modules().begin(), plan->stages(s).held_modules().end()),
            expected[static_cast<size_t>(s)])
            << "stage " << s;
      }
    }

    // Shared params: the tied pair {0: word embeddings, S-1: decoder}; none under ZBV (difference 1).
    const json& shared = stage0["shared_params"];
    if (zbv || shared.empty()) {
      EXPECT_EQ(plan->shared_params_size(), 0);
    } else {
      ASSERT_EQ(shared.size(), 1u);
      ASSERT_EQ(plan->shared_params_size(), 1);
      const auto& members = plan->shared_params(0).members();
      ASSERT_EQ(members.size(), 2);
      const std::string prefix = c["variant"] == "BertModel" ? "" : "bert.";
      EXPECT_EQ(members[0].stage(), shared[0][0]["stage"].get<int>());
      EXPECT_EQ(members[0].param(), prefix + "embeddings.word_embeddings.weight");
      EXPECT_EQ(members[1].stage(), shared[0][1]["stage"].get<int>());
      EXPECT_EQ(members[1].param(), "cls.predictions.decoder.weight");
      for (const auto& m : shared[0]) {
        bool named = false;
        for (const auto& alias : m["aliases"]) named |= alias == members[0].param() || alias == members[1].param();
        EXPECT_TRUE(named);
      }
    }
  }
  EXPECT_GT(compared, 700);
  EXPECT_GT(refused, 300);
}

TEST(GoldenShardConfig, EveryValidCombinationNormalisesLikeColossalAI) {
  const json golden = LoadGolden("bert_policy.json");
  int checked = 0;
  for (const json& c : golden["shard_config_cases"]) {
    const json& in = c["input"];
    const bool tp_on = in["enable_tensor_parallelism"].get<bool>();
    const bool sp_on = in["enable_sequence_parallelism"].get<bool>();
    const json& mode = in["sequence_parallelism_mode"];
    // Our request has no separate SP switch: sp_mode SP_NONE is "off". Modes that ShardConfig
    // drops when SP is off, and unknown strings, have no request form.
    if (!sp_on && !mode.is_null()) continue;
    if (sp_on && !mode.is_null() && mode == "bogus") continue;
    SCOPED_TRACE(c.dump());
    v1::PlanRequest request;
    request.set_variant(v1::BERT_MODEL);
    request.mutable_parallel()->set_tp_size(tp_on ? in["tp_group_size"].get<int64_t>() : 1);
    // ShardConfig turns "SP on, no mode" into split_gather.
    request.mutable_parallel()->set_sp_mode(sp_on ? (mode.is_null() ? v1::SPLIT_GATHER : SpMode(mode)) : v1::SP_NONE);
    request.mutable_parallel()->set_enable_all_optimization(in["enable_all_optimization"].get<bool>());
    auto plan = planner::Plan(request);
    const bool refused_by_contract = sp_on && mode == "ring_attn";
    if (!c["error"].is_null() || refused_by_contract) {
      EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
      if (!c["error"].is_null()) {
        EXPECT_TRUE(absl::StrContains(plan.status().message(), c["error"]["message"].get<std::string>()))
            << plan.status();
      }
      ++checked;
      continue;
    }
    if (sp_on && mode == "all_to_all") {  // valid ShardConfig, refused by the BERT policy
      EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
      ++checked;
      continue;
    }
    ASSERT_TRUE(plan.ok()) << plan.status();
    const json& r = c["result"];
    EXPECT_EQ(plan->shard_config().tensor_parallel_size(), r["tensor_parallel_size"].get<int>());
    EXPECT_EQ(plan->shard_config().enable_tensor_parallelism(), r["enable_tensor_parallelism"].get<bool>());
    EXPECT_EQ(plan->shard_config().enable_sequence_parallelism(), r["enable_sequence_parallelism"].get<bool>());
    EXPECT_EQ(plan->shard_config().enable_jit_fused(), r["enable_jit_fused"].get<bool>());
    EXPECT_EQ(plan->shard_config().enable_flash_attention(), r["enable_flash_attention"].get<bool>());
    // Difference 8: fused normalisation is on with all optimisations (ColossalAI needs apex).
    EXPECT_EQ(plan->shard_config().enable_fused_normalization(),
              r["enable_fused_normalization"].get<bool>() || r["enable_all_optimization"].get<bool>());
    ++checked;
  }
  EXPECT_GE(checked, 8);
}

std::vector<planner::LayerSpan> GoldenStageIndex(const json& index) {
  std::vector<planner::LayerSpan> spans;
  if (index[0].is_number()) return {{index[0].get<int64_t>(), index[1].get<int64_t>()}};
  for (const auto& pair : index) spans.push_back({pair[0].get<int64_t>(), pair[1].get<int64_t>()});
  return spans;
}

TEST(GoldenStageLayouts, GridMatchesStageManager) {
  const json golden = LoadGolden("stage_layouts.json");
  int planned = 0, refused = 0;
  for (const json& c : golden["cases"]) {
    SCOPED_TRACE(c.dump().substr(0, 300));
    v1::PlanRequest request;
    request.set_variant(v1::BERT_MODEL);
    request.mutable_config()->set_num_hidden_layers(c["num_layers"].get<int64_t>());
    request.mutable_config()->set_hidden_size(64);
    request.mutable_config()->set_num_attention_heads(4);
    request.mutable_config()->set_intermediate_size(128);
    request.mutable_config()->set_vocab_size(100);
    request.mutable_parallel()->set_pp_size(c["num_stages"].get<int64_t>());
    request.mutable_parallel()->set_pp_style(Style(c["pp_style"]));
    request.mutable_parallel()->set_num_model_chunks(c["num_model_chunks"].get<int64_t>());
    auto plan = planner::Plan(request);
    // What HybridParallelPlugin refuses (1f1b with chunks, interleaved with one chunk, zbv with
    // other than two: difference 6), we refuse.
    const bool accepted = c["plugin_accepts"]["ok"].get<bool>() && c["constructor_error"].is_null();
    if (!accepted) {
      EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
      ++refused;
      continue;
    }
    ASSERT_TRUE(plan.ok()) << plan.status();
    ++planned;
    const auto& lps = c["layers_per_stage"];
    EXPECT_EQ(std::vector<int64_t>(plan->layers_per_stage().begin(), plan->layers_per_stage().end()),
              lps.get<std::vector<int64_t>>());
    ASSERT_EQ(plan->stages_size(), c["num_stages"].get<int>());
    for (const json& st : c["stages"]) {
      const int s = st["stage"].get<int>();
      const v1::Stage& ours = plan->stages(s);
      std::vector<planner::LayerSpan> spans;
      for (const auto& r : ours.layer_ranges()) spans.push_back({r.start(), r.end()});
      EXPECT_EQ(spans, GoldenStageIndex(st["stage_index"])) << "stage " << s;
      EXPECT_EQ(ours.is_first(), st["is_first_stage_ignore_chunk"].get<bool>());
      bool last = st.contains("per_chunk") ? false : st["is_last_stage"].get<bool>();
      if (st.contains("per_chunk")) {
        for (const auto& pc : st["per_chunk"]) last |= pc["is_last_stage"].get<bool>();
      }
      EXPECT_EQ(ours.is_last(), last) << "stage " << s;
    }
  }
  EXPECT_GT(planned, 50);
  EXPECT_GT(refused, 50);
}

TEST(GoldenStageLayouts, ExplicitArgumentsMatchDistributeAndStageIndex) {
  const json golden = LoadGolden("stage_layouts.json");
  for (const json& c : golden["explicit_args"]) {
    SCOPED_TRACE(c.dump());
    const int64_t stages = c["num_stages"].get<int64_t>(), chunks = c["num_model_chunks"].get<int64_t>();
    const auto lps = planner::DistributeLayers(c["num_layers"].get<int64_t>(), stages, chunks);
    EXPECT_EQ(lps, c["layers_per_stage"].get<std::vector<int64_t>>());
    for (int64_t s = 0; s < stages; ++s) {
      EXPECT_EQ(planner::StageLayerRanges(lps, s, stages, chunks, false),
                GoldenStageIndex(c["stage_index"][static_cast<size_t>(s)]));
    }
  }
}

TEST(GoldenStageLayouts, CustomLayerCountsWorkOrAreRefusedPerSlot) {
  const json golden = LoadGolden("stage_layouts.json");
  for (const json& c : golden["custom_layers_per_stage"]) {
    SCOPED_TRACE(c.dump().substr(0, 300));
    v1::PlanRequest request;
    request.set_variant(v1::BERT_MODEL);
    request.mutable_config()->set_num_hidden_layers(c["num_layers"].get<int64_t>());
    request.mutable_parallel()->set_pp_size(c["num_stages"].get<int64_t>());
    request.mutable_parallel()->set_num_model_chunks(c["num_model_chunks"].get<int64_t>());
    request.mutable_parallel()->set_pp_style(c["use_zbv"].get<bool>()             ? v1::ZBV
                                             : c["enable_interleave"].get<bool>() ? v1::INTERLEAVED
                                                                                  : v1::ONE_F_ONE_B);
    for (const auto& n : c["num_layers_per_stage"])
      request.mutable_parallel()->add_num_layers_per_stage(n.get<int64_t>());
    auto plan = planner::Plan(request);
    if (c["stages"][0]["stage_index_error"].is_null()) {
      ASSERT_TRUE(plan.ok()) << plan.status();
      for (const json& st : c["stages"]) {
        std::vector<planner::LayerSpan> spans;
        for (const auto& r : plan->stages(st["stage"].get<int>()).layer_ranges()) spans.push_back({r.start(), r.end()});
        EXPECT_EQ(spans, GoldenStageIndex(st["stage_index"]));
      }
    } else {
      // The seed's IndexError: S counts for S x C slots. Difference 6: one count per slot, else a
      // clear refusal naming the slot count.
      EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
      EXPECT_TRUE(absl::StrContains(plan.status().message(), "one per pipeline slot")) << plan.status();
    }
  }
}

// One golden tensor: its shape on the rank and, per dim, the runs of global indices / padding.
struct GoldenTensor {
  std::vector<int64_t> local_shape, global_shape;
  json dims;
};

TEST(GoldenLayerShards, WholeModelSlicesMatchSharder) {
  const json golden = LoadGolden("layer_shards.json");
  const json& mc = golden["model_config"];
  // Group the per-stage records of one configuration.
  std::map<std::string, std::vector<const json*>> configs;
  for (const json& m : golden["models"]) {
    json key = m;
    key.erase("ranks");
    key.erase("stage");
    configs[key.dump()].push_back(&m);
  }
  int tensors_checked = 0;
  for (const auto& [key, records] : configs) {
    SCOPED_TRACE(key);
    const json& first = *records[0];
    bool errored = false;
    for (const json* r : records) {
      for (const auto& rank : (*r)["ranks"]) errored |= !rank["error"].is_null();
    }
    v1::PlanRequest request;
    request.set_variant(*planner::ParseVariant(first["variant"].get<std::string>()));
    SetModelConfig(mc, request.mutable_config());
    request.mutable_config()->set_tie_word_embeddings(first["tie_word_embeddings"].get<bool>());
    v1::ParallelConfig* p = request.mutable_parallel();
    p->set_tp_size(first["tp"].get<int64_t>());
    p->set_sp_mode(SpMode(first["sp_mode"]));
    p->set_enable_jit_fused(first["enable_jit_fused"].get<bool>());
    p->set_make_vocab_size_divisible_by(first["make_vocab_size_divisible_by"].get<int64_t>());
    SetPipeline(first["pp"], p);
    auto plan = planner::Plan(request);
    if (errored) {
      EXPECT_FALSE(plan.ok());
      continue;
    }
    ASSERT_TRUE(plan.ok()) << plan.status();
    const int tp = first["tp"].get<int>();
    const int64_t m = first["make_vocab_size_divisible_by"].get<int64_t>();
    const int64_t vocab = mc["vocab_size"].get<int64_t>();
    // Every name the golden sharder gave a tensor, per (stage, TP rank) of the seed.
    std::map<std::pair<int, size_t>, std::map<std::string, GoldenTensor>> by_slot;
    std::map<std::pair<int, size_t>, std::set<std::string>> golden_names;
    std::set<int> recorded_stages;
    const bool zbv = first["pp"]["pp_style"] == "zbv";
    for (const json* r : records) {
      const int stage = (*r)["stage"].is_null() ? 0 : (*r)["stage"].get<int>();
      recorded_stages.insert(stage);
      for (const auto& rank : (*r)["ranks"]) {
        const size_t t = rank["rank"].get<size_t>();
        for (const auto& param : rank["params"]) {
          GoldenTensor g{param["local_shape"].get<std::vector<int64_t>>(),
                         param["global_shape"].get<std::vector<int64_t>>(), param["dims"]};
          std::vector<std::string> names = {param["name"].get<std::string>()};
          for (const char* k : {"aliases", "original_aliases"}) {
            if (param.contains(k)) {
              for (const auto& a : param[k]) names.push_back(a.get<std::string>());
            }
          }
          golden_names[{stage, t}].insert(param["name"].get<std::string>());
          for (const auto& n : names) by_slot[{stage, t}][n] = g;
        }
      }
    }
    // Where the seed holds what we hold on `stage`, and the other way round: the same stage, except
    // that under ZBV the pooler and heads are on our stage 0 and the seed's last stage (difference 1).
    // That is the only difference allowed; any other tensor on another stage, or extra, fails.
    int last_stage = 0;
    for (const auto& rank : plan->ranks()) last_stage = std::max(last_stage, rank.stage());
    const auto seed_stage = [&](int stage, const std::string& name) {
      return zbv && stage == 0 && IsHeadTensor(name) ? last_stage : stage;
    };
    const auto our_stage = [&](int stage, const std::string& name) {
      return zbv && stage == last_stage && IsHeadTensor(name) ? 0 : stage;
    };
    std::map<std::pair<int, size_t>, std::set<std::string>> our_names;
    for (const auto& rank : plan->ranks()) {
      const size_t t = static_cast<size_t>(rank.tp_rank());
      int64_t held_bytes = 0;
      for (const auto& tensor : rank.tensors()) {
        SCOPED_TRACE(tensor.name());
        our_names[{rank.stage(), t}].insert(tensor.name());
        for (const auto& a : tensor.aliases()) our_names[{rank.stage(), t}].insert(a);
        // The bytes a rank holds, from the slice's shape (compared with the seed's just below where
        // the seed recorded the stage) at fp32's 4 bytes, not from the plan's own `bytes` fields.
        int64_t elements = 1;
        for (const int64_t d : tensor.local_shape()) elements *= d;
        EXPECT_EQ(tensor.bytes(), elements * 4);
        held_bytes += elements * 4;
        const int stage = seed_stage(rank.stage(), tensor.name());
        // The sample records only some stages of some configurations.
        if (!recorded_stages.count(stage)) continue;
        const auto& seed = by_slot[{stage, t}];
        if (!seed.count(tensor.name())) {
          ADD_FAILURE() << "not held by the seed on stage " << stage << " tp rank " << t;
          continue;
        }
        GoldenTensor g = seed.at(tensor.name());
        const bool vocab_tensor = tensor.global_shape(0) == vocab;
        if (vocab_tensor && g.dims[0].size() > 0) {
          // Difference 2: the word embedding pads with make_vocab_size_divisible_by like the
          // head (the seed pads it with 64). Recompute the expected slice with that multiple.
          const bool padded = tp > 1 || absl::StrContains(tensor.name(), "cls.predictions") || plan->tie_weight();
          if (padded && m != 64) {
            const int64_t multiple = tp > 1 ? m * tp : m;
            const int64_t padded_rows = (vocab + multiple - 1) / multiple * multiple;
            const int64_t per_rank = padded_rows / tp;
            const int64_t start = static_cast<int64_t>(t) * per_rank;
            json runs = json::array();
            if (start < vocab) runs.push_back({start, std::min(vocab, start + per_rank)});
            const int64_t pad = start + per_rank - std::max(start, std::min(vocab, start + per_rank));
            if (pad > 0) runs.push_back({"pad", pad});
            g.dims[0] = runs;
            g.local_shape[0] = per_rank;
          }
        }
        EXPECT_EQ(std::vector<int64_t>(tensor.local_shape().begin(), tensor.local_shape().end()), g.local_shape);
        EXPECT_EQ(std::vector<int64_t>(tensor.global_shape().begin(), tensor.global_shape().end()), g.global_shape);
        // Decode the runs of each dim into our (split_dim, start, end, padding). A slice that is
        // all padding decodes as padding in every dim (its values are all zero), so only dim 0
        // says anything about it.
        bool all_padding = true;
        for (const auto& run : g.dims[0]) all_padding &= run[0].is_string();
        for (size_t d = 0; d < (all_padding ? 1 : g.dims.size()); ++d) {
          const json& runs = g.dims[d];
          int64_t real_start = -1, real_count = 0, pad = 0;
          for (const auto& run : runs) {
            if (run[0].is_string()) {
              pad += run[1].get<int64_t>();
            } else {
              if (real_start < 0) real_start = run[0].get<int64_t>();
              real_count += run[1].get<int64_t>() - run[0].get<int64_t>();
            }
          }
          const bool whole = pad == 0 && real_start == 0 && real_count == tensor.global_shape(static_cast<int>(d));
          if (tensor.split_dim() == static_cast<int>(d)) {
            EXPECT_EQ(tensor.padding(), pad) << "dim " << d;
            EXPECT_EQ(tensor.end() - tensor.start(), real_count + pad) << "dim " << d;
            if (real_start >= 0) {
              EXPECT_EQ(tensor.start(), real_start) << "dim " << d;
            } else {
              EXPECT_GE(tensor.start(), vocab) << "dim " << d;
            }
          } else {
            EXPECT_TRUE(whole) << "dim " << d << " is sliced by the seed but not by us: " << runs.dump()
                               << " split_dim " << tensor.split_dim() << " rank " << rank.rank();
          }
        }
        ++tensors_checked;
      }
      EXPECT_EQ(plan->dtype(), v1::FP32);
      EXPECT_EQ(rank.param_bytes(), held_bytes);
    }
    // Nothing the seed holds on a recorded stage is missing from the plan's same stage (tied
    // tensors may appear as an alias).
    for (const auto& [slot, names] : golden_names) {
      for (const auto& name : names) {
        const int stage = our_stage(slot.first, name);
        EXPECT_TRUE(our_names[std::make_pair(stage, slot.second)].count(name))
            << name << " missing on stage " << stage << " tp rank " << slot.second;
      }
    }
  }
  EXPECT_GT(tensors_checked, 5000);
}

}  // namespace
}  // namespace bertshard
