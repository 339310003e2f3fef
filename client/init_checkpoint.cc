#include "client/init_checkpoint.h"

#include <filesystem>
#include <fstream>
#include <random>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "checkpoint/safetensors.h"
#include "client/plan_command.h"
#include "common/proto_json.h"
#include "common/status_macros.h"
#include "planner/model_config.h"
#include "planner/planner.h"

namespace bertshard::client {

absl::Status InitCheckpoint(v1::ModelVariant variant, const v1::BertConfig& config, uint64_t seed,
                            const std::string& directory) {
  // The unsharded plan lists every HF parameter of the variant with its shape.
  v1::PlanRequest request;
  request.set_variant(variant);
  *request.mutable_config() = config;
  ASSIGN_OR_RETURN(v1::ShardPlan plan, planner::Plan(request));
  const v1::BertConfig& c = plan.config();
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  std::vector<checkpoint::TensorData> tensors;
  for (const v1::TensorShard& t : plan.ranks(0).tensors()) {
    checkpoint::TensorData data;
    data.name = t.name();
    data.shape.assign(t.global_shape().begin(), t.global_shape().end());
    int64_t numel = 1;
    for (int64_t d : data.shape) numel *= d;
    const bool is_norm = absl::StrContains(t.name(), "LayerNorm");
    const bool is_bias = absl::EndsWith(t.name(), ".bias");
    data.values.assign(static_cast<size_t>(numel), is_norm && !is_bias ? 1.0f : 0.0f);
    if (!is_norm && !is_bias) {
      for (float& x : data.values) x = normal(rng);
    }
    if (absl::StrContains(t.name(), "word_embeddings")) {
      const int64_t row = c.pad_token_id();
      std::fill(data.values.begin() + row * c.hidden_size(), data.values.begin() + (row + 1) * c.hidden_size(), 0.0f);
    }
    tensors.push_back(std::move(data));
  }
  std::error_code error;
  std::filesystem::create_directories(directory, error);
  if (error) return absl::InternalError(absl::StrCat("cannot create ", directory, ": ", error.message()));
  RETURN_IF_ERROR(checkpoint::WriteSafetensors(directory + "/model.safetensors", tensors, {{"format", "pt"}}));
  // config.json in HF's field names; architectures[0] names the class.
  std::string json = common::ProtoToJson(c);
  json.insert(json.find('{') + 1, absl::StrCat("\n  \"architectures\": [\"", planner::HfClassName(variant),
                                               "\"],\n  \"model_type\": \"bert\",\n  \"initializer_range\": 0.02,"));
  std::ofstream out(directory + "/config.json");
  out << json << "\n";
  if (!out) return absl::InternalError(absl::StrCat("cannot write ", directory, "/config.json"));
  return absl::OkStatus();
}

const std::vector<Flag>& InitCheckpointFlags() {
  static const auto* flags = new std::vector<Flag>(JoinFlags({
      SelectFlags(PlanRequestFlags(), {"variant", "config"}),
      {{"seed", "N", "the random initialisation's seed (default 0)"},
       {"out", "DIR", "the model directory to write (created if missing)"},
       {"vocab", "FILE", "a WordPiece vocab.txt to ship with the model (text inference); it sets\nvocab_size"}},
  }));
  return *flags;
}

int RunInitCheckpointCommand(const CommandLine& cl, std::FILE* out, std::FILE* err) {
  auto fail = [err](const absl::Status& s) { return ReportError(err, s); };
  if (!cl.values.count("variant") || !cl.values.count("out")) {
    return fail(absl::InvalidArgumentError("init-checkpoint needs --variant and --out"));
  }
  uint64_t seed = 0;
  if (cl.values.count("seed") && !absl::SimpleAtoi(cl.values.at("seed"), &seed)) {
    return fail(absl::InvalidArgumentError("--seed needs a non-negative integer"));
  }
  v1::PlanRequest request;
  if (absl::Status s = ApplyPlanFlags(cl, &request); !s.ok()) return fail(s);
  // --vocab: a WordPiece vocab.txt to ship with the model (text inference); it sets vocab_size.
  std::vector<std::string> vocab;
  if (auto it = cl.values.find("vocab"); it != cl.values.end()) {
    std::ifstream in(it->second);
    if (!in) return fail(absl::InvalidArgumentError(absl::StrCat("cannot read vocabulary ", it->second)));
    for (std::string line; std::getline(in, line);) vocab.push_back(line);
    if (vocab.empty()) return fail(absl::InvalidArgumentError("the vocabulary is empty"));
    const int64_t size = static_cast<int64_t>(vocab.size());
    if (request.config().has_vocab_size() && request.config().vocab_size() != size) {
      return fail(absl::InvalidArgumentError(absl::StrCat("config vocab_size ", request.config().vocab_size(),
                                                          " disagrees with the ", size, "-token vocabulary")));
    }
    request.mutable_config()->set_vocab_size(size);
  }
  if (absl::Status s = InitCheckpoint(request.variant(), request.config(), seed, cl.values.at("out")); !s.ok()) {
    return fail(s);
  }
  if (!vocab.empty()) {
    std::ofstream v(cl.values.at("out") + "/vocab.txt");
    for (const std::string& token : vocab) v << token << "\n";
    std::ofstream(cl.values.at("out") + "/tokenizer_config.json") << "{\"do_lower_case\": true}\n";
  }
  std::fprintf(out, "wrote %s/config.json and %s/model.safetensors\n", cl.values.at("out").c_str(),
               cl.values.at("out").c_str());
  return kExitOk;
}

}  // namespace bertshard::client
