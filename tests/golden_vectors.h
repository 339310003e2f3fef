// File: tests/golden_vectors.h
// -----------------------------------------------------------------------------
// Reading the golden vectors recorded from ColossalAI's own code (tests/testdata/golden,
// provenance in its README) into the planner's types: the files, sequence-parallel modes,
// pipeline styles, pipeline and model configs, and which modules and tensors are the pooler or a
// head. Shared by golden_policy_test and golden_layout_test.
//
// Example:
//   const nlohmann::json golden = LoadGolden("bert_policy.json");
//   v1::BertConfig config;
//   SetModelConfig(golden["model_config"], &config);
//
// Failure model: a missing file or an unknown mode or style is a test failure (ADD_FAILURE /
// EXPECT), with a default value returned so that the test goes on to report the rest.
//
// Thread safety: thread-compatible (no state).
#ifndef BERTSHARD_TESTS_GOLDEN_VECTORS_H_
#define BERTSHARD_TESTS_GOLDEN_VECTORS_H_

#include <fstream>
#include <sstream>
#include <string>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "planner/model_config.h"
#include "planner/planner.h"

namespace bertshard::testing {

using nlohmann::json;

inline json LoadGolden(const std::string& name) {
  std::ifstream in("tests/testdata/golden/" + name);
  EXPECT_TRUE(in.good()) << "missing golden file " << name;
  std::stringstream text;
  text << in.rdbuf();
  return json::parse(text.str());
}

inline v1::SequenceParallelMode SpMode(const json& mode) {
  if (mode.is_null()) return v1::SP_NONE;
  const std::string m = mode.get<std::string>();
  if (m == "split_gather") return v1::SPLIT_GATHER;
  if (m == "ring") return v1::RING;
  if (m == "all_to_all") return v1::ALL_TO_ALL;
  if (m == "ring_attn") return v1::RING_ATTN;
  ADD_FAILURE() << "unknown sp mode " << m;
  return v1::SP_NONE;
}

inline v1::PipelineStyle Style(const json& style) {
  if (style.is_null()) return v1::PIPELINE_STYLE_UNSPECIFIED;
  const std::string s = style.get<std::string>();
  if (s == "1f1b") return v1::ONE_F_ONE_B;
  if (s == "interleaved") return v1::INTERLEAVED;
  if (s == "zbv") return v1::ZBV;
  ADD_FAILURE() << "unknown style " << s;
  return v1::PIPELINE_STYLE_UNSPECIFIED;
}

inline void SetPipeline(const json& pp, v1::ParallelConfig* p) {
  if (pp["pp_style"].is_null()) return;
  p->set_pp_size(pp["num_stages"].get<int64_t>());
  p->set_pp_style(Style(pp["pp_style"]));
  p->set_num_model_chunks(pp["num_model_chunks"].get<int64_t>());
}

inline void SetModelConfig(const json& mc, v1::BertConfig* c) {
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

inline bool IsHead(const std::string& module) {
  return module == "cls" || module == "dropout" || module == "classifier" || module == "qa_outputs" ||
         absl::EndsWith(module, "pooler");
}

// Whether a parameter belongs to the pooler or a head ("bert.pooler.dense.weight", "cls.predictions.bias").
inline bool IsHeadTensor(const std::string& name) {
  const std::string trunk = absl::StartsWith(name, "bert.") ? name.substr(5) : name;
  return IsHead(trunk.substr(0, trunk.find('.')));
}

}  // namespace bertshard::testing

#endif  // BERTSHARD_TESTS_GOLDEN_VECTORS_H_
