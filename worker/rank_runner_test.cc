// RunRank as `shardctl run --local` drives it, for real: rank 0 hosts the rendezvous on a port the
// system picks and writes it to its port file, rank 1 joins on that port (the ranks are threads
// here, processes there), and the head's outputs and both reports are read back.
#include "worker/rank_runner.h"

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>
#include <vector>

#include "checkpoint/safetensors.h"
#include "common/secure_random.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "planner/planner.h"

namespace bertshard::worker {
namespace {

namespace fs = std::filesystem;
constexpr char kModel[] = "tests/testdata/model/masked_lm_untied";

std::string ReadFile(const fs::path& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// A fresh directory holding the plan (TP `tp_size`) and the test model's inputs in the form
// shardctl writes them (rows, seq, flat id lists).
fs::path JobDir(const std::string& name, int tp_size) {
  const fs::path dir = fs::path(testing::TempDir()) / name;
  fs::remove_all(dir);
  fs::create_directories(dir);
  v1::PlanRequest request;
  request.set_checkpoint(kModel);
  request.mutable_parallel()->set_tp_size(tp_size);
  std::ofstream(dir / "plan.pb") << planner::Plan(request).value().SerializeAsString();
  const auto in = nlohmann::json::parse(ReadFile(std::string(kModel) + "/input.json"));
  nlohmann::json inputs = {{"rows", in["input_ids"].size()}, {"seq", in["input_ids"][0].size()}, {"choices", 1}};
  for (const char* key : {"input_ids", "attention_mask", "token_type_ids"}) {
    std::vector<int64_t> flat;
    for (const auto& row : in[key])
      for (const auto& v : row) flat.push_back(v.get<int64_t>());
    inputs[key] = flat;
  }
  std::ofstream(dir / "inputs.json") << inputs.dump();
  return dir;
}

RankOptions Rank(const fs::path& dir, int rank, int master_port) {
  RankOptions o;
  // The run's secret, made once per directory as shardctl makes it.
  o.secret_file = (dir / "rendezvous_secret").string();
  if (!fs::exists(o.secret_file)) {
    EXPECT_TRUE(common::WriteSecretFile(o.secret_file, std::string(32, 'k')).ok());
  }
  o.plan_path = (dir / "plan.pb").string();
  o.rank = rank;
  o.master_port = master_port;
  o.port_file = master_port == 0 ? (dir / "port").string() : "";
  o.checkpoint = kModel;
  o.inputs_path = (dir / "inputs.json").string();
  o.output_path = (dir / "outputs.safetensors").string();
  o.report_path = (dir / ("report" + std::to_string(rank) + ".json")).string();
  o.timeout_seconds = 30;
  o.gemm = model::GemmPath::kBlas;
  return o;
}

// The port rank 0 wrote, once it is there (within a deadline); 0 if it never came.
int WaitForPortFile(const fs::path& path) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!fs::exists(path)) {
    if (std::chrono::steady_clock::now() > deadline) return 0;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return std::stoi(ReadFile(path));
}

float MaxDiffFromReference(const fs::path& outputs) {
  auto got = checkpoint::SafetensorsFile::Open(outputs.string());
  auto want = checkpoint::SafetensorsFile::Open(std::string(kModel) + "/expected.safetensors");
  EXPECT_TRUE(got.ok() && want.ok());
  if (!got.ok() || !want.ok()) return INFINITY;
  const checkpoint::TensorInfo* g = (*got)->Find("logits");
  const checkpoint::TensorInfo* w = (*want)->Find("logits");
  EXPECT_TRUE(g != nullptr && w != nullptr && g->shape == w->shape);
  if (g == nullptr || w == nullptr || g->shape != w->shape) return INFINITY;
  std::vector<float> a(static_cast<size_t>(g->numel())), b(static_cast<size_t>(w->numel()));
  EXPECT_TRUE((*got)->ReadSlice(*g, {}, a.data()).ok());
  EXPECT_TRUE((*want)->ReadSlice(*w, {}, b.data()).ok());
  float max_diff = 0;
  for (size_t i = 0; i < a.size(); ++i) max_diff = std::max(max_diff, std::fabs(a[i] - b[i]));
  return max_diff;
}

class TwoRanks : public testing::TestWithParam<bool> {};  // shared-memory TP transport or Gloo
INSTANTIATE_TEST_SUITE_P(RankRunner, TwoRanks, testing::Bool(),
                         [](const testing::TestParamInfo<bool>& info) { return info.param ? "Shm" : "Gloo"; });

TEST_P(TwoRanks, RankZeroHostsTheRendezvousAndTheHeadWritesTheOutputs) {
  const bool shared_memory = GetParam();
  const fs::path dir = JobDir(shared_memory ? "rank_runner_shm" : "rank_runner_gloo", 2);
  absl::Status status0;
  RankOptions rank0 = Rank(dir, 0, 0);
  rank0.shared_memory = shared_memory;
  rank0.iterations = 2;
  std::thread first([&] { status0 = RunRank(rank0); });
  const int port = WaitForPortFile(dir / "port");
  ASSERT_GT(port, 0) << "rank 0 wrote no port file";
  RankOptions rank1 = Rank(dir, 1, port);
  rank1.shared_memory = shared_memory;
  rank1.iterations = 2;
  const absl::Status status1 = RunRank(rank1);
  first.join();
  ASSERT_TRUE(status0.ok()) << status0;
  ASSERT_TRUE(status1.ok()) << status1;
  EXPECT_LE(MaxDiffFromReference(dir / "outputs.safetensors"), 1e-4f);
  for (int rank = 0; rank < 2; ++rank) {
    const auto report = nlohmann::json::parse(ReadFile(dir / ("report" + std::to_string(rank) + ".json")));
    EXPECT_EQ(report["rank"], rank);
    EXPECT_EQ(report["tp_rank"], rank);
    EXPECT_EQ(report["wrote_outputs"], rank == 0);
    EXPECT_EQ(report["tp_transport"], shared_memory ? "shared memory" : "gloo");
    EXPECT_EQ(report["gemm"], "blas");
    EXPECT_GT(report["checkpoint_bytes_read"].get<int64_t>(), 0);
    EXPECT_EQ(report["forward_seconds_all"].size(), 2u);
    EXPECT_GE(report["load_seconds"].get<double>(), 0);
  }
}

TEST(RankRunner, BadOptionsAreRefusedSayingWhich) {
  const fs::path dir = JobDir("rank_runner_bad", 1);
  RankOptions o = Rank(dir, 0, 0);
  o.backend = "mpi";
  absl::Status s = RunRank(o);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_EQ(s.message(), "unknown backend mpi; valid: gloo, nccl");
  o = Rank(dir, 0, 0);
  o.secret_file = "";  // the rendezvous admits only ranks that know the run's secret
  s = RunRank(o);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_EQ(s.message(), "a rendezvous secret file is required");
  o = Rank(dir, 1, 0);  // a port the system picks is rank 0's to host
  s = RunRank(o);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("master_port 0 (a port the system picks) is for rank 0"), std::string::npos) << s;
  o = Rank(dir, 0, 0);
  o.plan_path = (dir / "inputs.json").string();
  s = RunRank(o);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("is not a ShardPlan"), std::string::npos) << s;
  o = Rank(dir, 0, 0);
  o.checkpoint = "/nonexistent/checkpoint";
  s = RunRank(o);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("has neither model.safetensors"), std::string::npos) << s;
  EXPECT_FALSE(fs::exists(dir / "outputs.safetensors"));
}

// A world of one: rank 0 alone, on a port it hosts, writes the outputs.
TEST(RankRunner, OneRankRunsAlone) {
  const fs::path dir = JobDir("rank_runner_one", 1);
  const absl::Status s = RunRank(Rank(dir, 0, 0));
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_LE(MaxDiffFromReference(dir / "outputs.safetensors"), 1e-4f);
  const auto report = nlohmann::json::parse(ReadFile(dir / "report0.json"));
  EXPECT_EQ(report["tp_transport"], "none");
}

}  // namespace
}  // namespace bertshard::worker
