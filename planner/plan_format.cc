#include "planner/plan_format.h"

#include <algorithm>
#include <set>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/proto_json.h"
#include "planner/model_config.h"
#include "planner/stage_layout.h"

namespace bertshard::planner {
namespace {

constexpr char kLayerPrefix[] = "encoder.layer.";
constexpr size_t kLayerPrefixSize = sizeof(kLayerPrefix) - 1;

// "bert.encoder.layer.3", "bert.encoder.layer.4" -> "bert.encoder.layer.3-4": the module list of a
// stage of a 24-layer model stays one line.
std::vector<std::string> CompressModules(const v1::Stage& stage) {
  std::vector<std::string> out;
  std::string run_prefix;
  int64_t run_start = -1, run_end = -1;
  auto flush = [&]() {
    if (run_start < 0) return;
    out.push_back(run_start == run_end ? absl::StrCat(run_prefix, run_start)
                                       : absl::StrCat(run_prefix, run_start, "-", run_end));
    run_start = run_end = -1;
  };
  for (const std::string& m : stage.held_modules()) {
    const size_t at = m.find(kLayerPrefix);
    int64_t index = 0;
    if (at != std::string::npos && absl::SimpleAtoi(absl::string_view(m).substr(at + kLayerPrefixSize), &index)) {
      const std::string prefix = m.substr(0, at + kLayerPrefixSize);
      if (run_start >= 0 && prefix == run_prefix && index == run_end + 1) {
        run_end = index;
        continue;
      }
      flush();
      run_prefix = prefix;
      run_start = run_end = index;
      continue;
    }
    flush();
    out.push_back(m);
  }
  flush();
  return out;
}

std::string Ranges(const v1::Stage& stage) {
  std::vector<std::string> parts;
  for (const auto& r : stage.layer_ranges()) parts.push_back(absl::StrCat("[", r.start(), ",", r.end(), ")"));
  return absl::StrJoin(parts, " ");
}

std::string VariantLabel(const v1::ShardPlan& plan) {
  absl::string_view hf = HfClassName(plan.variant());
  return hf.empty() ? v1::ModelVariant_Name(plan.variant()) : std::string(hf);
}

std::string DotEscape(absl::string_view text) {
  std::string out;
  for (char c : text) {
    if (c == '"' || c == '\\') out.push_back('\\');
    out.push_back(c);
  }
  return out;
}

// The pipeline route: the stage that runs each slot, in execution order.
std::vector<int> RouteStages(const v1::ShardPlan& plan) {
  std::vector<int> route;
  const int64_t stages = std::max(plan.stages_size(), 1);
  for (int k = 0; k < plan.layers_per_stage_size(); ++k) {
    route.push_back(static_cast<int>(SlotStage(k, stages, plan.shard_config().pp_style() == v1::ZBV)));
  }
  return route;
}

}  // namespace

std::string HumanBytes(int64_t bytes) {
  if (bytes < 1024) return absl::StrCat(bytes, " B");
  const char* units[] = {"KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes) / 1024;
  int unit = 0;
  while (value >= 1024 && unit < 3) {
    value /= 1024;
    ++unit;
  }
  return absl::StrFormat("%.1f %s", value, units[unit]);
}

std::string FormatPlanTable(const v1::ShardPlan& plan) {
  const v1::ShardConfig& sc = plan.shard_config();
  const v1::BertConfig& c = plan.config();
  std::string out;
  absl::StrAppend(&out, VariantLabel(plan), ": ", c.num_hidden_layers(), " layers, hidden ", c.hidden_size(), ", ",
                  c.num_attention_heads(), " heads, intermediate ", c.intermediate_size(), ", vocab ", c.vocab_size(),
                  ", ", c.hidden_act(), "; ", DtypeName(plan.dtype()), "\n");
  absl::StrAppend(&out, "parallel: tp ", sc.tensor_parallel_size(), " x pp ", sc.pp_size());
  if (sc.pp_style() != v1::PIPELINE_STYLE_UNSPECIFIED) {
    absl::StrAppend(&out, " (", v1::PipelineStyle_Name(sc.pp_style()), ", ", sc.num_model_chunks(),
                    sc.num_model_chunks() == 1 ? " chunk" : " chunks", ")");
  }
  absl::StrAppend(&out, " = ", plan.world_size(), " ranks; sequence parallel ",
                  v1::SequenceParallelMode_Name(sc.sp_mode()), "; tied embeddings ", plan.tie_weight() ? "yes" : "no",
                  "; vocab padded to a multiple of ", sc.make_vocab_size_divisible_by(),
                  sc.enable_tensor_parallelism() ? " x tp" : "", "\n");
  std::vector<std::string> opts;
  if (sc.enable_fused_normalization()) opts.push_back("fused layernorm");
  if (sc.enable_jit_fused()) opts.push_back("jit fused");
  if (plan.enable_bias_gelu_fused()) opts.push_back("bias+gelu fused");
  if (sc.fp8_communication()) opts.push_back("fp8 communication");
  if (!opts.empty()) absl::StrAppend(&out, "optimisations: ", absl::StrJoin(opts, ", "), "\n");
  for (const auto& w : plan.warnings()) absl::StrAppend(&out, "warning: ", w, "\n");
  absl::StrAppend(&out, "layers per slot: ", absl::StrJoin(plan.layers_per_stage(), " "), "\n\n");

  absl::StrAppend(&out, absl::StrFormat("%-6s %-6s %-5s %-18s %s\n", "STAGE", "FIRST", "LAST", "LAYERS", "MODULES"));
  for (const v1::Stage& s : plan.stages()) {
    absl::StrAppend(&out,
                    absl::StrFormat("%-6d %-6s %-5s %-18s %s\n", s.stage(), s.is_first() ? "yes" : "-",
                                    s.is_last() ? "yes" : "-", Ranges(s), absl::StrJoin(CompressModules(s), ", ")));
  }
  absl::StrAppend(&out, "\n",
                  absl::StrFormat("%-6s %-6s %-4s %-8s %s\n", "RANK", "STAGE", "TP", "TENSORS",
                                  absl::StrCat("PARAM BYTES (", DtypeName(plan.dtype()), ")")));
  int64_t total = 0;
  for (const v1::RankShard& r : plan.ranks()) {
    total += r.param_bytes();
    absl::StrAppend(&out, absl::StrFormat("%-6d %-6d %-4d %-8d %s (%d)\n", r.rank(), r.stage(), r.tp_rank(),
                                          r.tensors_size(), HumanBytes(r.param_bytes()), r.param_bytes()));
  }
  absl::StrAppend(&out, "total parameter bytes over all ranks: ", HumanBytes(total), " (", total, ")\n");
  for (const auto& shared : plan.shared_params()) {
    std::vector<std::string> members;
    for (const auto& m : shared.members()) members.push_back(absl::StrCat("stage ", m.stage(), " ", m.param()));
    absl::StrAppend(&out, "tied across stages: ", absl::StrJoin(members, " <-> "), "\n");
  }
  absl::StrAppend(&out, "\nmodule policy:\n");
  for (const auto& e : plan.module_policy()) {
    absl::StrAppend(&out, "  ", e.target_class(), "\n");
    for (const auto& a : e.attribute_replacements()) {
      absl::StrAppend(&out, "    set ", a.attribute(), " = ", common::ProtoToJson(a.value(), {.indent = 0}), "\n");
    }
    for (const auto& s : e.submodule_replacements()) {
      absl::StrAppend(&out, "    ", s.suffix(), " -> ", s.layer());
      if (s.has_kwargs()) absl::StrAppend(&out, " ", common::ProtoToJson(s.kwargs(), {.indent = 0}));
      absl::StrAppend(&out, "\n");
    }
    for (const auto& m : e.method_replacements()) {
      absl::StrAppend(&out, "    ", m.method(), "() := ", m.impl(), "\n");
    }
  }
  return out;
}

std::string FormatPlanDot(const v1::ShardPlan& plan) {
  const int tp = std::max(1, plan.shard_config().tensor_parallel_size());
  std::string out =
      "digraph bertshard_plan {\n  rankdir=LR;\n  compound=true;\n"
      "  node [shape=box, fontname=\"Helvetica\", fontsize=10];\n";
  absl::StrAppend(&out, "  label=\"", DotEscape(VariantLabel(plan)), ": tp ", tp, " x pp ",
                  plan.shard_config().pp_size(), "\";\n");
  for (const v1::Stage& s : plan.stages()) {
    absl::StrAppend(&out, "  subgraph cluster_stage", s.stage(), " {\n    label=\"stage ", s.stage(), " layers ",
                    Ranges(s), s.is_first() ? " (first)" : "", s.is_last() ? " (last)" : "", "\";\n");
    std::vector<std::string> lines = CompressModules(s);
    for (std::string& line : lines) line = DotEscape(line);
    const std::string modules = absl::StrJoin(lines, "\\n");
    for (const v1::RankShard& r : plan.ranks()) {
      if (r.stage() != s.stage()) continue;
      absl::StrAppend(&out, "    rank", r.rank(), " [label=\"rank ", r.rank(), " (tp ", r.tp_rank(), ")\\n", modules,
                      "\\n", HumanBytes(r.param_bytes()), "\"];\n");
    }
    absl::StrAppend(&out, "  }\n");
  }
  // Activations follow the route over the slots; each TP rank sends to its peer.
  std::set<std::pair<int, int>> hops;
  const std::vector<int> route = RouteStages(plan);
  for (size_t k = 1; k < route.size(); ++k) {
    if (route[k] != route[k - 1]) hops.insert({route[k - 1], route[k]});
  }
  for (const auto& [from, to] : hops) {
    for (int t = 0; t < tp; ++t) {
      absl::StrAppend(&out, "  rank", from * tp + t, " -> rank", to * tp + t, ";\n");
    }
  }
  for (const auto& shared : plan.shared_params()) {
    for (int i = 1; i < shared.members_size(); ++i) {
      const auto& a = shared.members(0);
      const auto& b = shared.members(i);
      for (int t = 0; t < tp; ++t) {
        absl::StrAppend(&out, "  rank", a.stage() * tp + t, " -> rank", b.stage() * tp + t,
                        " [style=dashed, dir=both, color=blue, label=\"tied: ", DotEscape(a.param()), " = ",
                        DotEscape(b.param()), "\"];\n");
      }
    }
  }
  absl::StrAppend(&out, "}\n");
  return out;
}

namespace {

void AppendKey(absl::string_view key, bool* first, std::string* out) {
  if (!*first) out->push_back(',');
  *first = false;
  out->push_back('"');
  out->append(key.data(), key.size());
  out->append("\":");
}

void AppendIntArray(absl::string_view key, const google::protobuf::RepeatedField<int64_t>& values, bool* first,
                    std::string* out) {
  AppendKey(key, first, out);
  out->push_back('[');
  for (int i = 0; i < values.size(); ++i) {
    if (i > 0) out->push_back(',');
    absl::StrAppend(out, values[i]);
  }
  out->push_back(']');
}

// Compact JSON of one TensorShard, field by field as the generic writer orders them (with
// emit_defaults: every field written).
void AppendTensorJson(const v1::TensorShard& t, std::string* out) {
  out->push_back('{');
  bool first = true;
  AppendKey("name", &first, out);
  common::AppendJsonString(t.name(), out);
  AppendIntArray("global_shape", t.global_shape(), &first, out);
  AppendIntArray("local_shape", t.local_shape(), &first, out);
  AppendKey("split_dim", &first, out);
  absl::StrAppend(out, t.split_dim());
  AppendKey("start", &first, out);
  absl::StrAppend(out, t.start());
  AppendKey("end", &first, out);
  absl::StrAppend(out, t.end());
  AppendKey("padding", &first, out);
  absl::StrAppend(out, t.padding());
  AppendKey("bytes", &first, out);
  absl::StrAppend(out, t.bytes());
  AppendKey("aliases", &first, out);
  out->push_back('[');
  for (int i = 0; i < t.aliases_size(); ++i) {
    if (i > 0) out->push_back(',');
    common::AppendJsonString(t.aliases(i), out);
  }
  out->append("]}");
}

}  // namespace

void AppendPlanJson(const v1::ShardPlan& plan, int indent, std::string* out) {
  // Growing a string of a few hundred KiB step by step costs more than writing it.
  size_t tensors = 0;
  for (const auto& rank : plan.ranks()) tensors += static_cast<size_t>(rank.tensors_size());
  out->reserve(out->size() + 4096 + tensors * (indent == 0 ? 200 : 450));
  common::JsonWriteOptions options;
  options.indent = indent;
  if (indent == 0) {
    options.message_writer = [](const google::protobuf::Message& m, std::string* o) {
      if (m.GetDescriptor() != v1::TensorShard::descriptor()) return false;
      AppendTensorJson(static_cast<const v1::TensorShard&>(m), o);
      return true;
    };
  }
  common::AppendProtoJson(plan, options, out);
}

std::string FormatErrorJson(const absl::Status& status) {
  std::string out = "{\"error\":{\"code\":";
  common::AppendJsonString(absl::StatusCodeToString(status.code()), &out);
  out.append(",\"message\":");
  common::AppendJsonString(status.message(), &out);
  out.append("}}");
  return out;
}

}  // namespace bertshard::planner
