// Compares the planner's stage layouts and per-rank tensor slices with vectors recorded from
// ColossalAI's own code (tests/testdata/golden, provenance in its README): the layer grid of its
// stage manager, explicit layer arguments, custom layer counts, and every tensor's slice on every
// stage and TP rank of the sharder, after applying exactly the deliberate differences listed in
// docs/plan-contract.md (each is named where it is applied) and nothing else.
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "planner/model_config.h"
#include "planner/planner.h"
#include "planner/stage_layout.h"
#include "tests/golden_vectors.h"

namespace bertshard {
namespace {

using nlohmann::json;
using testing::IsHeadTensor;
using testing::LoadGolden;
using testing::SetModelConfig;
using testing::SetPipeline;
using testing::SpMode;
using testing::Style;

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
