// The load path of every rank, for real: the test model's checkpoint opened and loaded, Gloo
// groups over the rendezvous store on loopback (TP ranks are threads), and a forward checked against the
// HuggingFace reference outputs.
#include "worker/shard_loader.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>
#include <vector>

#include "checkpoint/safetensors.h"
#include "common/model_root.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "planner/planner.h"

namespace bertshard::worker {
namespace {

constexpr char kModel[] = "tests/testdata/model/masked_lm_untied";

v1::ShardPlan PlanWithTp(int tp_size) {
  v1::PlanRequest request;
  request.set_checkpoint(kModel);
  request.mutable_parallel()->set_tp_size(tp_size);
  return planner::Plan(request).value();
}

model::ModelInputs Inputs() {
  std::ifstream in(std::string(kModel) + "/input.json");
  std::stringstream text;
  text << in.rdbuf();
  const auto j = nlohmann::json::parse(text.str());
  auto tensor = [&](const char* key) {
    std::vector<int64_t> values;
    for (const auto& row : j[key])
      for (const auto& v : row) values.push_back(v.get<int64_t>());
    return at::tensor(values, at::kLong).view({static_cast<int64_t>(j[key].size()), -1});
  };
  return {tensor("input_ids"), tensor("attention_mask"), tensor("token_type_ids"), 1};
}

// Largest difference between `logits` and the reference's.
float MaxDiffFromReference(const at::Tensor& logits) {
  auto file = checkpoint::SafetensorsFile::Open(std::string(kModel) + "/expected.safetensors");
  EXPECT_TRUE(file.ok()) << file.status();
  const checkpoint::TensorInfo* info = (*file)->Find("logits");
  std::vector<float> expected(static_cast<size_t>(info->numel()));
  EXPECT_TRUE((*file)->ReadSlice(*info, {}, expected.data()).ok());
  const at::Tensor got = logits.contiguous();
  EXPECT_EQ(got.numel(), info->numel());
  if (got.numel() != info->numel()) return INFINITY;
  float max_diff = 0;
  for (int64_t i = 0; i < got.numel(); ++i) {
    max_diff = std::max(max_diff, std::fabs(got.data_ptr<float>()[i] - expected[static_cast<size_t>(i)]));
  }
  return max_diff;
}

const std::string kSecret(32, 's');  // the job's rendezvous secret

// The options of one rank of a job whose rendezvous `store` hosts (handed to rank 0).
ShardLoadOptions RankOptions(const c10::intrusive_ptr<HostedStore>& store, int rank) {
  ShardLoadOptions options;
  options.checkpoint = kModel;
  options.collectives.rendezvous = {
      .master_port = store->getPort(),
      .timeout = std::chrono::seconds(30),
      .secret = kSecret,
      .store = rank == 0 ? c10::intrusive_ptr<c10d::Store>(store) : c10::intrusive_ptr<c10d::Store>()};
  return options;
}

// One rank: progress for every tensor, then `loaded`, then the groups; the shard forwards to the
// reference's logits.
TEST(ShardLoader, LoadsReportsProgressThenConnects) {
  const v1::ShardPlan plan = PlanWithTp(1);
  auto store = HostStore("127.0.0.1", kSecret, std::chrono::seconds(30)).value();
  ShardLoadOptions options = RankOptions(store, 0);
  std::vector<std::string> events;
  int64_t last_bytes = 0, total_bytes = -1;
  options.load.progress = [&](int loaded, int total, int64_t bytes, int64_t total_in_bytes) {
    if (events.empty() || events.back() != "progress") events.push_back("progress");
    EXPECT_LE(loaded, total);
    EXPECT_GE(bytes, last_bytes);
    last_bytes = bytes;
    total_bytes = total_in_bytes;
    return true;
  };
  options.loaded = [&](const model::BertShard& shard) {
    events.push_back("loaded");
    EXPECT_EQ(shard.param_bytes(), total_bytes);
  };
  auto loaded = LoadAndConnect(plan, 0, options);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(events, (std::vector<std::string>{"progress", "loaded"}));
  EXPECT_EQ(last_bytes, total_bytes);
  EXPECT_GT(loaded->checkpoint_bytes_read, 0u);
  EXPECT_EQ(loaded->collectives.tp_transport, "none");
  auto outputs = loaded->shard->Forward(Inputs(), 1, loaded->collectives.comm.get());
  ASSERT_TRUE(outputs.ok()) << outputs.status();
  EXPECT_LE(MaxDiffFromReference(outputs->at("logits")), 1e-4f);
}

// Two TP ranks, each loading its half and joining the other through the shared rendezvous: the
// rank and sizes come from the plan, and TP rank 0's logits are the reference's.
TEST(ShardLoader, TwoTensorParallelRanksMeetAndForwardTogether) {
  const v1::ShardPlan plan = PlanWithTp(2);
  auto store = HostStore("127.0.0.1", kSecret, std::chrono::seconds(30)).value();
  std::vector<std::string> failures(2);
  std::vector<at::Tensor> logits(2);
  std::vector<std::thread> ranks;
  for (int rank = 0; rank < 2; ++rank) {
    ranks.emplace_back([&, rank] {
      auto loaded = LoadAndConnect(plan, rank, RankOptions(store, rank));
      if (!loaded.ok()) {
        failures[rank] = loaded.status().ToString();
        return;
      }
      if (loaded->collectives.comm->tp_rank() != rank) failures[rank] += "tp rank; ";
      if (loaded->collectives.tp_transport != "shared memory") failures[rank] += loaded->collectives.tp_transport;
      auto outputs = loaded->shard->Forward(Inputs(), 1, loaded->collectives.comm.get());
      if (!outputs.ok()) {
        failures[rank] += outputs.status().ToString();
        return;
      }
      if (outputs->count("logits")) logits[rank] = outputs->at("logits");
    });
  }
  for (auto& t : ranks) t.join();
  for (int rank = 0; rank < 2; ++rank) EXPECT_EQ(failures[rank], "") << "rank " << rank;
  ASSERT_TRUE(logits[0].defined());
  EXPECT_LE(MaxDiffFromReference(logits[0]), 1e-4f);
}

// Refusals before any tensor is read, and a load stopped by its caller, never reach the
// rendezvous: a world of 2 whose peer never comes would otherwise end UNAVAILABLE, not as asked.
TEST(ShardLoader, RefusalsComeBeforeTheLoadAndTheRendezvous) {
  const v1::ShardPlan plan = PlanWithTp(2);
  auto store = HostStore("127.0.0.1", kSecret, std::chrono::seconds(2)).value();
  ShardLoadOptions options = RankOptions(store, 0);
  options.collectives.rendezvous.timeout = std::chrono::seconds(2);
  int progress_calls = 0, loaded_calls = 0;
  options.load.progress = [&](int, int, int64_t, int64_t) { return ++progress_calls < 3; };
  options.loaded = [&](const model::BertShard&) { ++loaded_calls; };

  options.collectives.backend = "mpi";
  auto refused = LoadAndConnect(plan, 0, options);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  EXPECT_NE(refused.status().message().find("unknown backend mpi"), std::string::npos) << refused.status();
  options.collectives.backend = "gloo";

  // A checkpoint that is not there is the request's fault.
  options.checkpoint = "/nonexistent/checkpoint";
  refused = LoadAndConnect(plan, 0, options);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  EXPECT_NE(refused.status().message().find("has neither model.safetensors"), std::string::npos) << refused.status();
  EXPECT_EQ(progress_calls, 0);

  // Confined to a model root that does not hold it.
  namespace fs = std::filesystem;
  const fs::path root = fs::path(testing::TempDir()) / "shard_loader_root";
  fs::create_directories(root);
  options.model_root = common::ModelRoot::Open(root.string()).value();
  options.checkpoint = fs::absolute(kModel).string();
  refused = LoadAndConnect(plan, 0, options);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  EXPECT_NE(refused.status().message().find("outside the model root"), std::string::npos) << refused.status();
  EXPECT_EQ(progress_calls, 0);

  // Inside it (relative to it), the load starts; the caller stops it at its third tensor.
  fs::copy(kModel, root / "model", fs::copy_options::recursive | fs::copy_options::overwrite_existing);
  options.checkpoint = "model";
  refused = LoadAndConnect(plan, 0, options);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kCancelled) << refused.status();
  EXPECT_EQ(progress_calls, 3);
  EXPECT_EQ(loaded_calls, 0);
}

// `dir`/model.safetensors copied with every value zero: weights a load must never serve.
void WriteZeroWeights(const std::string& from, const std::string& to) {
  auto file = checkpoint::SafetensorsFile::Open(from);
  ASSERT_TRUE(file.ok()) << file.status();
  std::vector<checkpoint::TensorData> tensors;
  for (const auto& [name, info] : (*file)->tensors()) {
    tensors.push_back({name, info.shape, std::vector<float>(static_cast<size_t>(info.numel()), 0.0f)});
  }
  ASSERT_TRUE(checkpoint::WriteSafetensors(to, tensors).ok());
}

// Issue 21: confinement was checked on the path and the weights opened again by path, so swapping
// model.safetensors with a symbolic link leading out of the root in between served the outside
// weights. Swapped as fast as the box allows for 3 s while loads run: every load that succeeds
// forwards to the reference (the inside weights; the outside ones are all zero).
TEST(ShardLoader, ARenameRaceNeverLoadsWeightsFromOutsideTheRoot) {
  namespace fs = std::filesystem;
  const fs::path base = fs::path(testing::TempDir()) / "shard_loader_race";
  fs::remove_all(base);
  const fs::path root = base / "models";
  fs::create_directories(root / "spare");
  fs::create_directories(base / "outside");
  fs::copy(kModel, root / "model", fs::copy_options::recursive);
  ASSERT_NO_FATAL_FAILURE(
      WriteZeroWeights(std::string(kModel) + "/model.safetensors", (base / "outside" / "model.safetensors").string()));
  // The link waits beside the checkpoint (inside the root, outside the checkpoint's directory).
  fs::create_symlink(base / "outside" / "model.safetensors", root / "spare" / "model.safetensors");
  const std::string inside = (root / "model" / "model.safetensors").string();
  const std::string spare = (root / "spare" / "model.safetensors").string();

  const v1::ShardPlan plan = PlanWithTp(1);
  std::atomic<bool> stop{false};
  std::atomic<int> swaps{0};
  std::thread swapper([&] {
    while (!stop.load()) {
      // One atomic exchange of the two names: the file and the link trade places.
      if (renameat2(AT_FDCWD, inside.c_str(), AT_FDCWD, spare.c_str(), RENAME_EXCHANGE) == 0) ++swaps;
    }
  });
  int inside_loads = 0, outside_loads = 0, refused = 0;
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(3);
  while (std::chrono::steady_clock::now() < end) {
    auto store = HostStore("127.0.0.1", kSecret, std::chrono::seconds(30)).value();
    ShardLoadOptions options = RankOptions(store, 0);
    options.model_root = common::ModelRoot::Open(root.string()).value();
    options.checkpoint = "model";
    auto loaded = LoadAndConnect(plan, 0, options);
    if (!loaded.ok()) {
      ++refused;
      continue;
    }
    auto outputs = loaded->shard->Forward(Inputs(), 1, loaded->collectives.comm.get());
    if (!outputs.ok()) {
      ADD_FAILURE() << outputs.status();
      break;
    }
    (MaxDiffFromReference(outputs->at("logits")) <= 1e-4f ? inside_loads : outside_loads) += 1;
  }
  stop = true;
  swapper.join();
  std::cerr << "swaps " << swaps << ", loads of the inside weights " << inside_loads << ", of the outside ones "
            << outside_loads << ", refused " << refused << "\n";
  EXPECT_GT(swaps.load(), 0);
  EXPECT_GT(inside_loads + refused, 0);
  EXPECT_EQ(outside_loads, 0);
}

// A hard link is the file itself wherever it was made: under a model root, weights linked from
// outside it (link count 2) are refused, and the load never starts.
TEST(ShardLoader, HardLinkedWeightsAreRefusedUnderAModelRoot) {
  namespace fs = std::filesystem;
  const fs::path base = fs::path(testing::TempDir()) / "shard_loader_hard_link";
  fs::remove_all(base);
  const fs::path root = base / "models";
  fs::create_directories(root / "model");
  fs::create_directories(base / "outside");
  for (const char* name : {"config.json", "input.json"}) {
    fs::copy_file(fs::path(kModel) / name, root / "model" / name);
  }
  fs::copy_file(fs::path(kModel) / "model.safetensors", base / "outside" / "model.safetensors");
  fs::create_hard_link(base / "outside" / "model.safetensors", root / "model" / "model.safetensors");

  const v1::ShardPlan plan = PlanWithTp(1);
  auto store = HostStore("127.0.0.1", kSecret, std::chrono::seconds(5)).value();
  ShardLoadOptions options = RankOptions(store, 0);
  options.model_root = common::ModelRoot::Open(root.string()).value();
  options.checkpoint = "model";
  int progress_calls = 0;
  options.load.progress = [&](int, int, int64_t, int64_t) { return ++progress_calls > 0; };
  auto refused = LoadAndConnect(plan, 0, options);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  EXPECT_NE(refused.status().message().find("hard link"), std::string::npos) << refused.status();
  EXPECT_EQ(progress_calls, 0);
}

}  // namespace
}  // namespace bertshard::worker
