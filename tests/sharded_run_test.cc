// `shardctl run --local` end to end: sharded runs against the independent reference outputs
// (tests/testdata/model, gen_reference.py), one launch per variant, chosen so that together they
// cover every path: TP 1/2/4, PP 2 (1F1B), interleaved (PP 2 x 2 chunks), ZBV, split_gather (also
// with pipelines, and RING run as split_gather), tied and untied LM heads, a vocabulary that
// needs padding (99 rows: 128 at TP 2, 256 at TP 4, where ranks hold only padding), padded
// attention masks, micro-batches, and F16/BF16 checkpoints; and once the oneDNN GEMM path (the
// others run --gemm auto, whichever it picks) with TP, split_gather and a decoder tied across
// stages. Also: bad input is refused before any rank starts, and a failing rank stops the others.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "checkpoint/safetensors.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/test_process.h"

namespace bertshard {
namespace {

using testing::ReadAll;
using testing::TempDir;
using Result = testing::Captured;

Result Shardctl(std::vector<std::string> args) {
  args.insert(args.begin(), "client/shardctl");
  return testing::Run(args);
}

std::map<std::string, std::pair<std::vector<int64_t>, std::vector<float>>> ReadTensors(const std::string& path) {
  std::map<std::string, std::pair<std::vector<int64_t>, std::vector<float>>> out;
  auto file = checkpoint::SafetensorsFile::Open(path);
  EXPECT_TRUE(file.ok()) << file.status();
  if (!file.ok()) return out;
  for (const auto& [name, info] : (*file)->tensors()) {
    std::vector<float> values(static_cast<size_t>(info.numel()));
    EXPECT_TRUE((*file)->ReadSlice(info, {}, values.data()).ok());
    out[name] = {info.shape, values};
  }
  return out;
}

// What one rank holds and reads, per the checkpoint's own header rather than the plan's byte counts.
struct Held {
  int64_t param_bytes = 0;    // every element of its slices, in the run's dtype
  int64_t padding_bytes = 0;  // the slices' rows past the file tensor's end (zeros), in the run's dtype
  int64_t read_bytes = 0;     // the rest, in the file's dtype: what it must read
};

// Each tensor the plan gives a rank is [start, end) of split_dim of the file's tensor (the whole
// tensor for split_dim -1); its size comes from the file's shape and dtype. The file's tensor is
// the plan's name, an alias (tied weights) or the name without or with "bert." (as the loader's).
Held HeldFromCheckpoint(const checkpoint::SafetensorsFile& file, const nlohmann::json& rank, int64_t run_element) {
  Held held;
  for (const auto& t : rank["tensors"]) {
    const std::string name = t["name"].get<std::string>();
    SCOPED_TRACE(name);
    std::vector<std::string> candidates = {name};
    for (const auto& a : t["aliases"]) candidates.push_back(a.get<std::string>());
    candidates.push_back(absl::StartsWith(name, "bert.") ? name.substr(5) : "bert." + name);
    const checkpoint::TensorInfo* info = nullptr;
    for (const auto& c : candidates) {
      if (info == nullptr) info = file.Find(c);
    }
    if (info == nullptr) {
      ADD_FAILURE() << "no checkpoint tensor for " << name;
      continue;
    }
    const int split = t["split_dim"].get<int>();
    int64_t elements = 1, real = 1;
    for (size_t d = 0; d < info->shape.size(); ++d) {
      if (static_cast<int>(d) != split) {
        elements *= info->shape[d];
        real *= info->shape[d];
        continue;
      }
      const int64_t start = t["start"].get<int64_t>(), end = t["end"].get<int64_t>();
      elements *= end - start;
      real *= std::max<int64_t>(0, std::min(end, info->shape[d]) - start);
    }
    held.param_bytes += elements * run_element;
    held.padding_bytes += (elements - real) * run_element;
    held.read_bytes += real * checkpoint::DTypeSize(info->dtype);
  }
  return held;
}

struct Launch {
  const char* model;
  std::vector<std::string> flags;
  const char* name = nullptr;  // the test's name, when not the model's
};

bool IsBf16(const Launch& launch) {
  const auto flag = std::find(launch.flags.begin(), launch.flags.end(), "--dtype");
  return flag != launch.flags.end() && *(flag + 1) == "bf16";
}

const char* Name(const Launch& launch) { return launch.name != nullptr ? launch.name : launch.model; }

// What oneDNN's bf16 linear needs of the CPU (model/gemm.h, GemmPathAvailable).
bool CpuHasAvx512ForBf16() {
#if defined(__x86_64__)
  return __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
#else
  return false;
#endif
}

class ShardedRun : public ::testing::TestWithParam<Launch> {};

TEST_P(ShardedRun, EqualsUnshardedReference) {
  const Launch& launch = GetParam();
  const std::string dir = std::string("tests/testdata/model/") + launch.model;
  const std::string output = TempDir() + "/" + Name(launch) + ".safetensors";
  const std::string report = TempDir() + "/" + Name(launch) + ".report.json";
  std::vector<std::string> args = {"run",       "--local", "--checkpoint", dir,    "--input",   dir + "/input.json",
                                   "--output",  output,    "--report",     report, "--threads", "1",
                                   "--timeout", "120"};
  args.insert(args.end(), launch.flags.begin(), launch.flags.end());
  Result r = Shardctl(args);
  if (r.exit_code != 0 && absl::StrContains(r.err, "needs a LibTorch built with MKL-DNN")) {
    GTEST_SKIP() << "this LibTorch has no MKL-DNN";
  }
  if (IsBf16(launch) && std::find(launch.flags.begin(), launch.flags.end(), "onednn") != launch.flags.end() &&
      !CpuHasAvx512ForBf16()) {
    // oneDNN's bf16 linear cannot run here (an AVX2 CPU): the run must say so before it loads.
    EXPECT_NE(r.exit_code, 0) << r.err;
    EXPECT_TRUE(absl::StrContains(r.err, "--gemm=onednn with bf16 needs a CPU with AVX-512 BW, VL and DQ")) << r.err;
    GTEST_SKIP() << "this CPU lacks AVX-512 BW/VL/DQ: only the refusal of --gemm onednn with bf16 was checked";
  }
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto got = ReadTensors(output);
  const auto want = ReadTensors(dir + "/expected.safetensors");
  ASSERT_EQ(got.size(), want.size());
  for (const auto& [name, expected] : want) {
    SCOPED_TRACE(name);
    ASSERT_TRUE(got.count(name));
    ASSERT_EQ(got.at(name).first, expected.first);
    float max_diff = 0, max_want = 0;
    for (size_t i = 0; i < expected.second.size(); ++i) {
      max_diff = std::max(max_diff, std::fabs(got.at(name).second[i] - expected.second[i]));
      max_want = std::max(max_want, std::fabs(expected.second[i]));
    }
    if (IsBf16(launch)) {
      // As model/bert_shard_test.cc's Bf16Compute: relative to the largest output, 0.05 (its
      // worst unsharded case is 0.035); and not equal to fp32, or the dtype was ignored.
      EXPECT_LE(max_diff / std::max(1.0f, max_want), 0.05f);
      EXPECT_GT(max_diff, 1e-5f);
    } else {
      EXPECT_LE(max_diff, 1e-5f);
    }
  }
  // A rank holds exactly its share and reads only that: its parameter, padding and checkpoint bytes
  // against the file's shapes and dtypes (F16/BF16 checkpoints store 2 bytes an element) sliced as
  // the plan says, not against the plan's own byte counts, which the rank only sums.
  const auto reports = nlohmann::json::parse(ReadAll(report));
  const int64_t run_element = IsBf16(launch) ? 2 : 4;
  auto checkpoint_file = checkpoint::SafetensorsFile::Open(dir + "/model.safetensors");
  ASSERT_TRUE(checkpoint_file.ok()) << checkpoint_file.status();
  Result plan_json = Shardctl([&] {
    std::vector<std::string> plan_args = {"plan", "--checkpoint", dir, "--output", "json"};
    for (size_t i = 0; i < launch.flags.size(); i += 2) {
      if (launch.flags[i] != "--micro-batches" && launch.flags[i] != "--gemm") {
        plan_args.push_back(launch.flags[i]);
        plan_args.push_back(launch.flags[i + 1]);
      }
    }
    return plan_args;
  }());
  ASSERT_EQ(plan_json.exit_code, 0) << plan_json.err;
  const auto plan = nlohmann::json::parse(plan_json.out);
  ASSERT_EQ(reports.size(), plan["ranks"].size());
  for (const auto& rank : reports) {
    SCOPED_TRACE(rank.dump());
    const Held held = HeldFromCheckpoint(**checkpoint_file, plan["ranks"][rank["rank"].get<size_t>()], run_element);
    EXPECT_GT(held.read_bytes, 0);
    EXPECT_EQ(rank["param_bytes"].get<int64_t>(), held.param_bytes);
    EXPECT_EQ(rank["padding_bytes"].get<int64_t>(), held.padding_bytes);
    EXPECT_EQ(rank["checkpoint_bytes_read"].get<int64_t>(), held.read_bytes);
    EXPECT_EQ(rank["dtype"], IsBf16(launch) ? "bf16" : "fp32");
    // The path each rank took; under auto, with the figures it chose on.
    const auto gemm_flag = std::find(launch.flags.begin(), launch.flags.end(), "--gemm");
    if (gemm_flag != launch.flags.end()) {
      EXPECT_EQ(rank["gemm"], *(gemm_flag + 1));
      EXPECT_FALSE(rank.contains("gemm_gflops"));
    } else {
      ASSERT_TRUE(rank.contains("gemm_gflops"));
      EXPECT_GT(rank["gemm_gflops"]["blas"].get<double>(), 0);
      EXPECT_TRUE(rank["gemm"] == "blas" || rank["gemm"] == "onednn");
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Matrix, ShardedRun,
    ::testing::Values(
        Launch{"bert_model", {"--tp", "4"}},
        Launch{"pretraining_tied", {"--tp", "2", "--pp", "2", "--micro-batches", "2"}},
        Launch{"lm_head_decoder", {"--pp", "2", "--pp-style", "interleaved", "--chunks", "2"}},
        // V: stage 1 runs two slots in a row, for each micro-batch in turn (slot-major).
        Launch{"masked_lm_untied", {"--tp", "2", "--pp", "2", "--pp-style", "zbv", "--micro-batches", "2"}},
        Launch{"next_sentence", {"--tp", "2", "--sp-mode", "split_gather"}},
        Launch{"sequence_classification_f16",
               {"--tp", "2", "--pp", "2", "--sp-mode", "split_gather", "--micro-batches", "2"}},
        Launch{"token_classification_bf16", {"--tp", "4", "--sp-mode", "split_gather"}},
        Launch{"multiple_choice", {"--tp", "2", "--pp", "2", "--pp-style", "interleaved", "--micro-batches", "2"}},
        Launch{"question_answering", {"--tp", "2", "--pp", "2", "--pp-style", "zbv", "--sp-mode", "ring"}},
        // The decoder is on stage 1, the word embeddings it is tied to on stage 0.
        Launch{"pretraining_tied",
               {"--tp", "2", "--pp", "2", "--sp-mode", "split_gather", "--micro-batches", "2", "--gemm", "onednn"},
               "pretraining_tied_onednn"},
        // bf16: every collective (vocab-parallel all-reduce, split_gather all-gather and
        // reduce-scatter, LM-head gather) and the pipeline sends carry bf16 over Gloo; and a causal
        // decoder's mask in bf16 through an interleaved pipeline on the oneDNN path.
        Launch{"pretraining_tied",
               {"--tp", "2", "--pp", "2", "--sp-mode", "split_gather", "--micro-batches", "2", "--dtype", "bf16"},
               "pretraining_tied_bf16"},
        Launch{"lm_head_decoder",
               {"--pp", "2", "--pp-style", "interleaved", "--chunks", "2", "--dtype", "bf16", "--gemm", "onednn"},
               "lm_head_decoder_bf16_onednn"}),
    [](const ::testing::TestParamInfo<Launch>& info) { return std::string(Name(info.param)); });

TEST(ShardedRunErrors, BadInputIsRefusedBeforeAnyRankStarts) {
  const std::string dir = "tests/testdata/model/masked_lm_untied";
  struct Case {
    const char* json;
    const char* message;
  };
  const std::vector<Case> cases = {
      {R"({"input_ids": [[1, 2, 99]]})", "ids must be in [0, vocab_size 99)"},
      {R"({"input_ids": [[1, 2.5]]})", "must hold integers"},
      {R"({"input_ids": [[1, 2], [3]]})", "ragged"},
      {R"({"input_ids": [1, 2]})", "nested array"},
      {R"({"input_ids": [[1, 2]], "attention_mask": [[1, 2]]})", "must be 0 or 1"},
      {R"({"input_ids": [[1, 2]], "token_type_ids": [[0, 2]]})", "type_vocab_size 2"},
      {R"({"input_ids": [[1, 2]], "attention_mask": [[1]]})", "shape of input_ids"},
      {R"({"input_ids": [[1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1]]})", "exceeds max_position_embeddings 16"},
      {R"({"input_ids": [[1]], "labels": [1]})", "unknown input field 'labels'"},
      {R"(not json)", "not a JSON object"},
  };
  for (const Case& c : cases) {
    const std::string input = TempDir() + "/bad_input.json";
    std::ofstream(input) << c.json;
    Result r = Shardctl({"run", "--local", "--checkpoint", dir, "--input", input, "--output",
                         TempDir() + "/never.safetensors", "--tp", "2", "--rank-binary", "/nonexistent"});
    EXPECT_EQ(r.exit_code, 2) << c.json;
    EXPECT_TRUE(absl::StrContains(r.err, c.message)) << r.err;
  }
  const std::string input = TempDir() + "/odd.json";
  std::ofstream(input) << R"({"input_ids": [[1, 2, 3]]})";
  Result sp = Shardctl({"run", "--local", "--checkpoint", dir, "--input", input, "--output", TempDir() + "/x", "--tp",
                        "2", "--sp-mode", "split_gather"});
  EXPECT_EQ(sp.exit_code, 2);
  EXPECT_TRUE(absl::StrContains(sp.err, "multiple of tp_size 2")) << sp.err;
  Result mb = Shardctl(
      {"run", "--local", "--checkpoint", dir, "--input", input, "--output", TempDir() + "/x", "--micro-batches", "2"});
  EXPECT_EQ(mb.exit_code, 2);
  EXPECT_TRUE(absl::StrContains(mb.err, "exceeds the batch size 1")) << mb.err;
}

TEST(ShardedRunErrors, AFailingRankStopsTheOthers) {
  // The checkpoint has no pre-training heads: stage 1 fails to load, stage 0 would wait for it in
  // the rendezvous; the launcher must stop it and report the missing tensor, not hang.
  const std::string dir = "tests/testdata/model/bert_model";
  Result r = Shardctl({"run", "--local", "--checkpoint", dir, "--variant", "BertForPreTraining", "--pp", "2", "--input",
                       dir + "/input.json", "--output", TempDir() + "/fail.safetensors", "--timeout", "60"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_TRUE(absl::StrContains(r.err, "rank 1 failed")) << r.err;
  EXPECT_TRUE(absl::StrContains(r.err, "has no tensor bert.pooler.dense.weight") ||
              absl::StrContains(r.err, "has no tensor cls."))
      << r.err;
}

// The NCCL backend is right on both kinds of machine. Where it can run (a --config=cuda build,
// a CUDA LibTorch, a GPU) it must equal the reference; tools/gpu_check.sh sets
// BERTSHARD_EXPECT_GPU=1 so that there a failure to run is a failure. Elsewhere it must fail
// saying which of the three is missing.
TEST(ShardedRunErrors, NcclBackendRunsOnAGpuAndFailsClearlyElsewhere) {
  const std::string dir = "tests/testdata/model/bert_model";
  const std::string output = TempDir() + "/nccl.safetensors";
  Result r = Shardctl({"run", "--local", "--checkpoint", dir, "--input", dir + "/input.json", "--output", output,
                       "--backend", "nccl", "--timeout", "60"});
  const char* expect_gpu = std::getenv("BERTSHARD_EXPECT_GPU");
  if (expect_gpu != nullptr && std::string(expect_gpu) == "1") {
    EXPECT_EQ(r.exit_code, 0) << r.err;
  }
  if (r.exit_code == 0) {
    const auto got = ReadTensors(output);
    const auto want = ReadTensors(dir + "/expected.safetensors");
    ASSERT_EQ(got.size(), want.size());
    for (const auto& [name, expected] : want) {
      ASSERT_TRUE(got.count(name)) << name;
      ASSERT_EQ(got.at(name).first, expected.first) << name;
      float max_diff = 0;
      for (size_t i = 0; i < expected.second.size(); ++i) {
        max_diff = std::max(max_diff, std::fabs(got.at(name).second[i] - expected.second[i]));
      }
      EXPECT_LE(max_diff, 1e-4f) << name;  // fp32 on a GPU: its kernels sum in another order
    }
  } else {
    EXPECT_EQ(r.exit_code, 1);
    EXPECT_TRUE(absl::StrContains(r.err, "built without NCCL: bazel build --config=cuda") ||
                absl::StrContains(r.err, "needs a CUDA-enabled LibTorch") ||
                absl::StrContains(r.err, "no usable CUDA device"))
        << r.err;
  }
  Result bad = Shardctl({"run", "--local", "--checkpoint", dir, "--input", dir + "/input.json", "--output",
                         TempDir() + "/x.safetensors", "--backend", "mpi"});
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_TRUE(absl::StrContains(bad.err, "--backend 'mpi' is not one of gloo, nccl")) << bad.err;
}

TEST(ShardedRunErrors, BadGemmValueIsRefused) {
  const std::string dir = "tests/testdata/model/bert_model";
  Result r = Shardctl({"run", "--local", "--checkpoint", dir, "--input", dir + "/input.json", "--output",
                       TempDir() + "/gemm.safetensors", "--gemm", "mkl", "--rank-binary", "/nonexistent"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_TRUE(absl::StrContains(r.err, "--gemm 'mkl' is not one of auto, blas, onednn")) << r.err;
  // The rank binary itself, as a launcher other than shardctl would start it.
  Result rank = testing::Run({"worker/shard-rank", "--gemm=mkl"});
  EXPECT_EQ(rank.exit_code, 2);
  EXPECT_TRUE(absl::StrContains(rank.err, "is not one of auto, blas, onednn")) << rank.err;
}

TEST(InitCheckpoint, WritesAModelTheRunnerLoads) {
  const std::string dir = TempDir() + "/random_ckpt";
  Result init = Shardctl({"init-checkpoint", "--variant", "BertForMaskedLM", "--config",
                          R"({"vocab_size": 120, "hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 2,
                              "intermediate_size": 64, "max_position_embeddings": 16})",
                          "--seed", "7", "--out", dir});
  ASSERT_EQ(init.exit_code, 0) << init.err;
  const auto tensors = ReadTensors(dir + "/model.safetensors");
  EXPECT_FALSE(tensors.count("cls.predictions.decoder.weight"));  // tied: stored once
  EXPECT_EQ(tensors.at("bert.embeddings.word_embeddings.weight").first, (std::vector<int64_t>{120, 32}));
  const std::string input = TempDir() + "/random_input.json";
  std::ofstream(input)
      << R"({"input_ids": [[101, 7, 8, 119], [5, 6, 0, 0]], "attention_mask": [[1, 1, 1, 1], [1, 1, 0, 0]]})";
  Result one =
      Shardctl({"run", "--local", "--checkpoint", dir, "--input", input, "--output", TempDir() + "/r1.safetensors"});
  ASSERT_EQ(one.exit_code, 0) << one.err;
  Result two = Shardctl({"run", "--local", "--checkpoint", dir, "--input", input, "--output",
                         TempDir() + "/r2.safetensors", "--tp", "2", "--sp-mode", "split_gather"});
  ASSERT_EQ(two.exit_code, 0) << two.err;
  const auto a = ReadTensors(TempDir() + "/r1.safetensors").at("logits");
  const auto b = ReadTensors(TempDir() + "/r2.safetensors").at("logits");
  ASSERT_EQ(a.first, (std::vector<int64_t>{2, 4, 120}));
  float max_diff = 0;
  for (size_t i = 0; i < a.second.size(); ++i) max_diff = std::max(max_diff, std::fabs(a.second[i] - b.second[i]));
  EXPECT_LE(max_diff, 1e-5f);
  Result bad =
      Shardctl({"init-checkpoint", "--variant", "BertModel", "--config", R"({"hidden_size": 30})", "--out", dir});
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_TRUE(absl::StrContains(bad.err, "hidden_size 30 is not a multiple of num_attention_heads 12")) << bad.err;
}

}  // namespace
}  // namespace bertshard
