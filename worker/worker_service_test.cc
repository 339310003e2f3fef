// Two Worker services (each its own gRPC server on loopback) load the two TP ranks of a job,
// run forwards in sequence and unload -- driven over gRPC as the coordinator will drive them.
#include "worker/worker_service.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <thread>

#include "checkpoint/safetensors.h"
#include "common/grpc_auth.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "planner/planner.h"

namespace bertshard::worker {
namespace {

constexpr char kModel[] = "tests/testdata/model/masked_lm_untied";

struct RunningWorker {
  std::unique_ptr<WorkerService> service;
  std::unique_ptr<grpc::Server> server;
  std::unique_ptr<v1::Worker::Stub> stub;
};

RunningWorker StartWorker(WorkerServiceOptions options = {}) {
  RunningWorker w;
  w.service = std::make_unique<WorkerService>(options);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(w.service.get());
  w.server = builder.BuildAndStart();
  w.stub =
      v1::Worker::NewStub(grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials()));
  return w;
}

std::unique_ptr<grpc::ClientContext> Context() {
  auto c = std::make_unique<grpc::ClientContext>();
  c->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  return c;
}

// The load attempt's rendezvous secret, as the coordinator makes one (32 bytes).
const std::string kSecret(32, 's');

// A job's rendezvous port, hosted by `worker` (its rank 0) from now on, as the coordinator gets it.
// `job`: the job it is for ("" for any).
int ReservePort(RunningWorker& worker, const std::string& job = "") {
  v1::ReservePortRequest request;
  request.set_job_id(job);
  request.set_rendezvous_secret(kSecret);
  v1::ReservePortResponse port;
  const grpc::Status status = worker.stub->ReservePort(Context().get(), request, &port);
  EXPECT_TRUE(status.ok()) << status.error_message();
  return port.port();
}

v1::TokenInputs Inputs() {
  std::ifstream in(std::string(kModel) + "/input.json");
  std::stringstream text;
  text << in.rdbuf();
  const auto j = nlohmann::json::parse(text.str());
  v1::TokenInputs t;
  t.set_rows(static_cast<int64_t>(j["input_ids"].size()));
  t.set_seq(static_cast<int64_t>(j["input_ids"][0].size()));
  for (const char* key : {"input_ids", "attention_mask", "token_type_ids"}) {
    auto* field = std::string(key) == "input_ids"        ? t.mutable_input_ids()
                  : std::string(key) == "attention_mask" ? t.mutable_attention_mask()
                                                         : t.mutable_token_type_ids();
    for (const auto& row : j[key])
      for (const auto& v : row) field->Add(v.get<int64_t>());
  }
  return t;
}

// The bytes rank `rank` of `plan` holds at `element` bytes an element, from the checkpoint's shapes:
// each tensor is [start, end) of split_dim of the file's tensor (all of it for split_dim -1).
int64_t HeldBytes(const v1::RankShard& rank, int64_t element) {
  auto file = checkpoint::SafetensorsFile::Open(std::string(kModel) + "/model.safetensors");
  EXPECT_TRUE(file.ok()) << file.status();
  if (!file.ok()) return -1;
  int64_t bytes = 0;
  for (const v1::TensorShard& t : rank.tensors()) {
    const checkpoint::TensorInfo* info = (*file)->Find(t.name());
    for (const auto& alias : t.aliases()) {
      if (info == nullptr) info = (*file)->Find(alias);
    }
    if (info == nullptr) {
      ADD_FAILURE() << "no checkpoint tensor for " << t.name();
      continue;
    }
    int64_t elements = 1;
    for (size_t d = 0; d < info->shape.size(); ++d) {
      elements *= static_cast<int>(d) == t.split_dim() ? t.end() - t.start() : info->shape[d];
    }
    bytes += elements * element;
  }
  return bytes;
}

// By the workers' --gemm (auto, the default; blas; onednn) and the plan's dtype.
struct Path {
  std::optional<model::GemmPath> gemm;
  v1::Dtype dtype = v1::FP32;
};
class WorkerServicePaths : public ::testing::TestWithParam<Path> {};

TEST_P(WorkerServicePaths, LoadsForwardsInOrderAndUnloads) {
  const std::optional<model::GemmPath> gemm = GetParam().gemm;
  if (gemm.has_value() && !model::GemmPathAvailable(*gemm).ok()) {
    GTEST_SKIP() << model::GemmPathAvailable(*gemm);
  }
  WorkerServiceOptions options;
  options.gemm = gemm;
  v1::PlanRequest request;
  request.set_checkpoint(kModel);
  request.mutable_parallel()->set_tp_size(2);
  request.set_dtype(GetParam().dtype);
  auto plan = planner::Plan(request);
  ASSERT_TRUE(plan.ok()) << plan.status();
  RunningWorker workers[2] = {StartWorker(options), StartWorker(options)};
  const int port = ReservePort(workers[0]);

  std::vector<v1::LoadProgress> last(2);
  std::vector<int> updates(2, 0);
  std::vector<grpc::Status> load_status(2);
  std::vector<std::thread> loads;
  for (int rank = 0; rank < 2; ++rank) {
    loads.emplace_back([&, rank] {
      v1::LoadShardRequest load;
      load.set_job_id("job-1");
      *load.mutable_plan() = *plan;
      load.set_rank(rank);
      load.set_checkpoint(kModel);
      load.set_master_port(port);
      load.set_rendezvous_secret(kSecret);
      load.set_timeout_seconds(30);
      auto context = Context();
      auto reader = workers[rank].stub->LoadShard(context.get(), load);
      v1::LoadProgress p;
      while (reader->Read(&p)) {
        EXPECT_GE(p.bytes_loaded(), last[rank].bytes_loaded());
        last[rank] = p;
        ++updates[rank];
      }
      load_status[rank] = reader->Finish();
    });
  }
  for (auto& t : loads) t.join();
  for (int rank = 0; rank < 2; ++rank) {
    ASSERT_TRUE(load_status[rank].ok()) << load_status[rank].error_message();
    EXPECT_EQ(last[rank].phase(), v1::LoadProgress::READY);
    // What the loader placed, against the file's shapes sliced as the plan says (not the plan's own
    // byte counts, which the loader sums), in the plan's dtype.
    EXPECT_EQ(last[rank].bytes_loaded(), HeldBytes(plan->ranks(rank), GetParam().dtype == v1::BF16 ? 2 : 4));
    EXPECT_GT(updates[rank], plan->ranks(rank).tensors_size());  // one per tensor, then connect/ready
  }

  auto expected_file = checkpoint::SafetensorsFile::Open(std::string(kModel) + "/expected.safetensors");
  ASSERT_TRUE(expected_file.ok());
  const checkpoint::TensorInfo* logits = (*expected_file)->Find("logits");
  std::vector<float> expected(static_cast<size_t>(logits->numel()));
  ASSERT_TRUE((*expected_file)->ReadSlice(*logits, {}, expected.data()).ok());

  for (int sequence = 0; sequence < 2; ++sequence) {
    std::vector<v1::ForwardResponse> responses(2);
    std::vector<grpc::Status> status(2);
    std::vector<std::thread> forwards;
    for (int rank = 0; rank < 2; ++rank) {
      forwards.emplace_back([&, rank] {
        v1::ForwardRequest forward;
        forward.set_job_id("job-1");
        forward.set_sequence(sequence);
        *forward.mutable_inputs() = Inputs();
        auto context = Context();
        status[rank] = workers[rank].stub->Forward(context.get(), forward, &responses[rank]);
      });
    }
    for (auto& t : forwards) t.join();
    ASSERT_TRUE(status[0].ok()) << status[0].error_message();
    ASSERT_TRUE(status[1].ok()) << status[1].error_message();
    ASSERT_EQ(responses[0].outputs_size(), 1);
    EXPECT_EQ(responses[1].outputs_size(), 0);  // TP rank 1 returns nothing
    const v1::NamedTensor& out = responses[0].outputs(0);
    EXPECT_EQ(out.name(), "logits");
    ASSERT_EQ(out.values_size(), static_cast<int>(expected.size()));
    float max_diff = 0, max_want = 0;
    for (int i = 0; i < out.values_size(); ++i) {
      max_diff = std::max(max_diff, std::fabs(out.values(i) - expected[i]));
      max_want = std::max(max_want, std::fabs(expected[i]));
    }
    if (GetParam().dtype == v1::BF16) {
      // bf16 tolerance as in model/bert_shard_test.cc, and not fp32's result.
      EXPECT_LE(max_diff / std::max(1.0f, max_want), 0.05f);
      EXPECT_GT(max_diff, 1e-5f);
    } else {
      EXPECT_LE(max_diff, 1e-5f);
    }
  }

  v1::ForwardRequest stale;
  stale.set_job_id("job-1");
  stale.set_sequence(0);
  *stale.mutable_inputs() = Inputs();
  v1::ForwardResponse response;
  grpc::Status refused = workers[0].stub->Forward(Context().get(), stale, &response);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(refused.error_message().find("forward 0 of job job-1 arrived out of order; next is 2"), std::string::npos)
      << refused.error_message();
  v1::ForwardRequest malformed = stale;
  malformed.set_sequence(2);
  malformed.mutable_inputs()->mutable_input_ids()->RemoveLast();
  refused = workers[0].stub->Forward(Context().get(), malformed, &response);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(refused.error_message().find("inputs must hold rows x seq values"), std::string::npos)
      << refused.error_message();
  // The refusal took its number, as it does on every rank: the next forward is 3, not 2 again.
  refused = workers[0].stub->Forward(Context().get(), malformed, &response);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << refused.error_message();
  EXPECT_NE(refused.error_message().find("next is 3"), std::string::npos) << refused.error_message();

  // What the worker reports to the coordinator: the rank, its world, and the next forward.
  for (int rank = 0; rank < 2; ++rank) {
    const std::vector<v1::HeldShard> held = workers[rank].service->HeldShards();
    ASSERT_EQ(held.size(), 1u);
    EXPECT_EQ(held[0].job_id(), "job-1");
    EXPECT_EQ(held[0].rank(), rank);
    EXPECT_EQ(held[0].world_size(), 2);
    EXPECT_EQ(held[0].next_sequence(), rank == 0 ? 3 : 2);
    EXPECT_FALSE(held[0].forward_running());
    EXPECT_EQ(held[0].broken(), "");
  }

  for (int rank = 0; rank < 2; ++rank) {
    v1::UnloadRequest unload;
    unload.set_job_id("job-1");
    v1::UnloadResponse unloaded;
    ASSERT_TRUE(workers[rank].stub->Unload(Context().get(), unload, &unloaded).ok());
    EXPECT_TRUE(unloaded.was_loaded());
    EXPECT_EQ(workers[rank].service->loaded_jobs(), 0);
  }
  refused = workers[0].stub->Forward(Context().get(), stale, &response);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(refused.error_message().find("job job-1 is not loaded here"), std::string::npos) << refused.error_message();
}

INSTANTIATE_TEST_SUITE_P(Gemm, WorkerServicePaths,
                         ::testing::Values(Path{std::nullopt}, Path{model::GemmPath::kBlas},
                                           Path{model::GemmPath::kOneDnn}, Path{std::nullopt, v1::BF16}),
                         [](const ::testing::TestParamInfo<Path>& info) {
                           if (info.param.dtype == v1::BF16) return std::string("auto_bf16");
                           return info.param.gemm.has_value() ? std::string(model::GemmPathName(*info.param.gemm))
                                                              : std::string("auto");
                         });

// A one-rank load of kModel (job "j") from `checkpoint` on the rendezvous port `port`, and the
// status of a LoadShard call read to its end.
v1::LoadShardRequest OneRankLoad(const std::string& checkpoint, int port) {
  v1::PlanRequest request;
  request.set_checkpoint(kModel);
  v1::LoadShardRequest load;
  load.set_job_id("j");
  *load.mutable_plan() = planner::Plan(request).value();
  load.set_checkpoint(checkpoint);
  load.set_master_port(port);
  load.set_rendezvous_secret(kSecret);
  return load;
}
grpc::Status LoadToTheEnd(RunningWorker& worker, const v1::LoadShardRequest& load) {
  auto context = Context();
  auto reader = worker.stub->LoadShard(context.get(), load);
  v1::LoadProgress p;
  while (reader->Read(&p)) {
  }
  return reader->Finish();
}

TEST(WorkerService, RefusesBadLoadRequests) {
  RunningWorker worker = StartWorker();
  v1::LoadShardRequest load = OneRankLoad("/nonexistent/checkpoint", ReservePort(worker));
  auto read_all = [&](const v1::LoadShardRequest& r) { return LoadToTheEnd(worker, r); };
  // Each refusal with its code and the words that say which part of the request is wrong.
  const auto expect_refused = [&](grpc::StatusCode code, const std::string& words) {
    const grpc::Status s = read_all(load);
    EXPECT_EQ(s.error_code(), code) << s.error_message();
    EXPECT_NE(s.error_message().find(words), std::string::npos) << s.error_message();
  };
  // A checkpoint the worker cannot see is the request's fault (NOT_FOUND becomes INVALID_ARGUMENT).
  expect_refused(grpc::StatusCode::INVALID_ARGUMENT,
                 "checkpoint /nonexistent/checkpoint has neither model.safetensors nor model.safetensors.index.json");
  load.set_checkpoint(kModel);
  load.set_rank(3);
  expect_refused(grpc::StatusCode::INVALID_ARGUMENT, "rank 3 is outside the plan's world of 1");
  load.set_rank(0);
  load.set_job_id("");
  expect_refused(grpc::StatusCode::INVALID_ARGUMENT, "job_id is required");
  load.set_job_id("j");
  load.clear_rendezvous_secret();  // the ranks prove it to the rendezvous: no load without one
  {
    auto context = Context();
    auto reader = worker.stub->LoadShard(context.get(), load);
    v1::LoadProgress p;
    int messages = 0;
    while (reader->Read(&p)) ++messages;
    const grpc::Status s = reader->Finish();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
    EXPECT_NE(s.error_message().find("the rendezvous secret must be 16 to 256 bytes; it is 0"), std::string::npos)
        << s.error_message();
    EXPECT_EQ(messages, 0) << "refused only once the shard was loading";
  }
  load.set_rendezvous_secret(kSecret);
  load.set_backend("mpi");
  expect_refused(grpc::StatusCode::INVALID_ARGUMENT, "backend 'mpi' is not served by this worker: it serves gloo");
  load.set_backend("nccl");  // NCCL jobs go to GPU workers (--device=cuda:N)
  expect_refused(grpc::StatusCode::INVALID_ARGUMENT,
                 "backend 'nccl' is not served by this worker: it serves gloo on the CPU (shard-worker "
                 "--device=cuda:N serves nccl)");
  load.clear_backend();
  // The first request's rank 0 took the reserved store and closed it with its failed load.
  load.set_master_port(ReservePort(worker));
  ASSERT_TRUE(read_all(load).ok());  // world of 1
  expect_refused(grpc::StatusCode::ALREADY_EXISTS, "job j is already loaded here");
  EXPECT_TRUE(worker.service->UnloadJob("j"));
  EXPECT_FALSE(worker.service->UnloadJob("j"));
  EXPECT_TRUE(worker.service->HeldShards().empty());
}

// A load with keep_held replaces the shard held under its job id, taking its tensors instead of
// reading them (a replica changing shape, issue 22); the last progress message says what was kept
// and read. Without keep_held the same load is ALREADY_EXISTS; of another checkpoint, nothing is kept.
TEST(WorkerService, ALoadThatKeepsTheHeldShardReadsOnlyWhatItLacks) {
  RunningWorker worker = StartWorker();
  const auto load_to_end = [&](const v1::LoadShardRequest& load, v1::LoadProgress* last) {
    auto context = Context();
    auto reader = worker.stub->LoadShard(context.get(), load);
    while (reader->Read(last)) {
    }
    return reader->Finish();
  };
  v1::LoadProgress first, kept, other;
  v1::LoadShardRequest load = OneRankLoad(kModel, ReservePort(worker));
  ASSERT_TRUE(load_to_end(load, &first).ok());
  EXPECT_EQ(first.bytes_kept(), 0);
  EXPECT_GT(first.checkpoint_bytes_read(), 0);
  load.set_master_port(ReservePort(worker));
  load.set_keep_held(true);
  ASSERT_TRUE(load_to_end(load, &kept).ok());
  EXPECT_EQ(kept.phase(), v1::LoadProgress::READY);
  EXPECT_EQ(kept.bytes_kept(), kept.bytes_total());  // the same plan: every tensor kept
  EXPECT_EQ(kept.checkpoint_bytes_read(), 0);
  EXPECT_EQ(worker.service->HeldShards().size(), 1u);  // the new shard in place of the old
  // The same files under another name are another checkpoint for the worker: read again.
  const std::string copy = ::testing::TempDir() + "/model_copy";
  std::filesystem::remove_all(copy);
  std::filesystem::copy(kModel, copy, std::filesystem::copy_options::recursive);
  load.set_checkpoint(copy);
  load.set_master_port(ReservePort(worker));
  ASSERT_TRUE(load_to_end(load, &other).ok());
  EXPECT_EQ(other.bytes_kept(), 0);
  EXPECT_EQ(other.checkpoint_bytes_read(), first.checkpoint_bytes_read());
  EXPECT_TRUE(worker.service->UnloadJob("j"));
  EXPECT_TRUE(worker.service->HeldShards().empty());
}

// A job's series exist while it loads or is loaded: refused loads with made-up job ids leave
// /metrics as it was (3,000 of them grew it from 8.4 KB to 8.4 MB for good), and a loaded job's
// series go with its unload.
TEST(WorkerService, MetricSeriesOnlyForLoadedJobs) {
  common::MetricsRegistry registry;
  auto metrics = WorkerMetrics::Register(&registry);
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  RunningWorker worker = StartWorker({.metrics = &*metrics});
  const size_t before = registry.Render().size();
  v1::LoadShardRequest load = OneRankLoad("/nonexistent/checkpoint", 0);
  for (int i = 0; i < 3000; ++i) {
    load.set_job_id("made-up-" + std::to_string(i));
    const grpc::Status s = LoadToTheEnd(worker, load);
    ASSERT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  }
  const std::string after = registry.Render();
  EXPECT_EQ(after.find("made-up-"), std::string::npos);
  EXPECT_LE(after.size(), before + 64) << "refused loads left series behind";  // loose: same lines
  EXPECT_EQ(metrics->loaded_bytes->size(), 0u);

  load = OneRankLoad(kModel, ReservePort(worker));
  ASSERT_TRUE(LoadToTheEnd(worker, load).ok());
  const std::string loaded = registry.Render();
  EXPECT_NE(loaded.find("bertshard_worker_loaded_bytes_total{job=\"j\",rank=\"0\"}"), std::string::npos) << loaded;
  EXPECT_NE(loaded.find("bertshard_worker_forward_rows_count{job=\"j\",rank=\"0\"} 0"), std::string::npos);
  // A second load of the loaded job is refused and leaves its series alone.
  EXPECT_EQ(LoadToTheEnd(worker, load).error_code(), grpc::StatusCode::ALREADY_EXISTS);
  EXPECT_NE(registry.Render().find("job=\"j\""), std::string::npos);
  EXPECT_TRUE(worker.service->UnloadJob("j"));
  EXPECT_EQ(registry.Render().find("job=\"j\""), std::string::npos);
  EXPECT_EQ(metrics->forward_seconds->size(), 0u);
}

// A GPU worker (--device=cuda:N) serves NCCL only; built without NCCL (CI's build), it refuses
// its loads before reading anything.
TEST(WorkerService, AGpuWorkerServesNcclOnly) {
  RunningWorker worker = StartWorker({.gpu = 0});
  v1::LoadShardRequest load = OneRankLoad(kModel, ReservePort(worker));
  grpc::Status s = LoadToTheEnd(worker, load);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_NE(s.error_message().find("it serves nccl on cuda:0 (shard-worker --device=cpu serves gloo)"),
            std::string::npos)
      << s.error_message();
#ifndef BERTSHARD_WITH_NCCL
  load.set_backend("nccl");
  s = LoadToTheEnd(worker, load);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << s.error_message();
  EXPECT_NE(s.error_message().find("built without NCCL"), std::string::npos) << s.error_message();
#endif
  EXPECT_TRUE(worker.service->HeldShards().empty());
}

// With a model root (--model_root), a load reads only checkpoints inside it: relative paths are
// taken under it; absolute paths elsewhere and files that link out are refused before any read,
// and the refusal never quotes a file.
TEST(WorkerService, LoadsOnlyCheckpointsUnderItsModelRoot) {
  namespace fs = std::filesystem;
  const fs::path root = fs::path(testing::TempDir()) / "worker_model_root";
  fs::remove_all(root);
  fs::create_directories(root);
  fs::copy(kModel, root / "model", fs::copy_options::recursive);
  fs::copy(kModel, root / "evil", fs::copy_options::recursive);
  fs::remove(root / "evil" / "config.json");
  fs::create_symlink("/etc/passwd", root / "evil" / "config.json");
  auto model_root = common::ModelRoot::Open(root.string());
  ASSERT_TRUE(model_root.ok()) << model_root.status();
  WorkerServiceOptions options;
  options.model_root = *model_root;
  RunningWorker worker = StartWorker(options);
  auto read_all = [&](const std::string& checkpoint) {
    return LoadToTheEnd(worker, OneRankLoad(checkpoint, ReservePort(worker)));
  };
  grpc::Status s = read_all(fs::absolute(kModel).string());
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("outside the model root"), std::string::npos) << s.error_message();
  // A real checkpoint beside the root, named through "..": outside, not missing.
  fs::remove_all(root.string() + "-sibling");
  fs::copy(kModel, root.string() + "-sibling", fs::copy_options::recursive);
  s = read_all("../" + root.filename().string() + "-sibling");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_NE(s.error_message().find("outside the model root"), std::string::npos) << s.error_message();
  s = read_all("no-such-model");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_NE(s.error_message().find("does not exist under the model root"), std::string::npos) << s.error_message();
  s = read_all("evil");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("config.json is a symbolic link that leads outside the model root"),
            std::string::npos)
      << s.error_message();
  EXPECT_EQ(s.error_message().find("root:"), std::string::npos) << s.error_message();
  s = read_all("model");  // relative to the root
  EXPECT_TRUE(s.ok()) << s.error_message();
  EXPECT_TRUE(worker.service->UnloadJob("j"));
}

// With the cluster token set, every worker RPC needs it: a stranger can neither load, forward,
// reserve ports nor unload.
TEST(WorkerService, EveryRpcNeedsTheClusterTokenWhenOneIsSet) {
  WorkerServiceOptions options;
  options.token = "cluster-secret-1";
  RunningWorker worker = StartWorker(options);
  const auto context = [](const std::string& token) {
    auto c = Context();
    common::AttachToken(c.get(), token);
    return c;
  };
  for (const std::string token : {"", "not-the-secret"}) {
    v1::ReservePortResponse port;
    EXPECT_EQ(worker.stub->ReservePort(context(token).get(), v1::ReservePortRequest(), &port).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
    v1::UnloadRequest unload;
    unload.set_job_id("j");
    v1::UnloadResponse unloaded;
    EXPECT_EQ(worker.stub->Unload(context(token).get(), unload, &unloaded).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
    v1::ForwardRequest forward;
    forward.set_job_id("j");
    v1::ForwardResponse forwarded;
    EXPECT_EQ(worker.stub->Forward(context(token).get(), forward, &forwarded).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
    auto c = context(token);
    auto reader = worker.stub->LoadShard(c.get(), v1::LoadShardRequest());
    v1::LoadProgress p;
    while (reader->Read(&p)) {
    }
    EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::UNAUTHENTICATED);
  }
  v1::ReservePortRequest reserve;
  reserve.set_rendezvous_secret(kSecret);
  v1::ReservePortResponse port;
  EXPECT_TRUE(worker.stub->ReservePort(context("cluster-secret-1").get(), reserve, &port).ok());
}

// A reservation needs the load attempt's secret: a store nobody has to prove anything to is never
// hosted.
TEST(WorkerService, ReservePortNeedsARendezvousSecret) {
  RunningWorker worker = StartWorker();
  v1::ReservePortRequest reserve;
  reserve.set_job_id("j");
  v1::ReservePortResponse port;
  const grpc::Status s = worker.stub->ReservePort(Context().get(), reserve, &port);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_NE(s.error_message().find("the rendezvous secret must be 16 to 256 bytes"), std::string::npos)
      << s.error_message();
}

// Whether something accepts connections on `address`:`port` (an IPv4 loopback address).
bool Listening(int port, uint32_t address = INADDR_LOOPBACK) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(address);
  const bool connected = connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  close(fd);
  return connected;
}

// errno of binding `port` on every interface; 0 if the bind succeeded. SO_REUSEADDR, so that only a
// listening socket makes it fail, not connections to a closed one still in TIME_WAIT.
int BindError(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  const int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  const int error = bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 ? 0 : errno;
  close(fd);
  return error;
}

// Whether nothing listens on `port` any more within `timeout` (closing a store is not instant).
bool ReleasedWithin(int port, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (Listening(port)) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return true;
}

// ReservePort binds the rendezvous port itself, before any load, and the job's rank 0 takes that
// store over: nothing on the host can take the port between the answer and the rendezvous.
TEST(WorkerService, ReservePortHostsTheRendezvousThatRankZeroTakesOver) {
  WorkerServiceOptions options;
  options.port_reservation_ttl = absl::Seconds(2);
  RunningWorker worker = StartWorker(options);
  v1::LoadShardRequest load = OneRankLoad(kModel, 0);  // the plan first: the expiry runs from the reservation
  // Reserved for another job: job "j"'s rank 0 does not take it, and hosting its own store on the
  // port then fails (the address is in use) instead of joining the other job's rendezvous.
  const int foreign = ReservePort(worker, "another-job");
  load.set_master_port(foreign);
  const grpc::Status refused = LoadToTheEnd(worker, load);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::UNAVAILABLE) << refused.error_message();
  EXPECT_TRUE(Listening(foreign));  // still reserved for its own job
  const int port = ReservePort(worker, "j");
  ASSERT_GT(port, 0);
  EXPECT_TRUE(Listening(port));
  EXPECT_EQ(BindError(port), EADDRINUSE);
  // A second reservation is a port of its own.
  const int other = ReservePort(worker);
  EXPECT_NE(other, port);
  EXPECT_TRUE(Listening(other));
  // Rank 0 loads on the reserved port: it can only have used the reserved store, since hosting
  // another store on the port would fail (address in use).
  load.set_master_port(port);
  const grpc::Status loaded = LoadToTheEnd(worker, load);
  ASSERT_TRUE(loaded.ok()) << loaded.error_message();
  // The job holds the store past the reservation's expiry: `other`, reserved after `port`, being
  // closed shows that expiry has passed for both.
  EXPECT_TRUE(ReleasedWithin(other, std::chrono::seconds(5)));
  EXPECT_TRUE(Listening(port));
  // Unloading the job closes its store.
  EXPECT_TRUE(worker.service->UnloadJob("j"));
  EXPECT_TRUE(ReleasedWithin(port, std::chrono::seconds(5)));
}

// The store a reservation hosts listens on the worker's advertised host only (bind_host): another
// address of the same host (127.0.0.2 is loopback too) reaches nothing.
TEST(WorkerService, TheReservedStoreListensOnTheAdvertisedHostOnly) {
  WorkerServiceOptions options;
  options.bind_host = "127.0.0.1";
  RunningWorker worker = StartWorker(options);
  const int port = ReservePort(worker, "j");
  ASSERT_GT(port, 0);
  EXPECT_TRUE(Listening(port));
  EXPECT_FALSE(Listening(port, INADDR_LOOPBACK + 1)) << "the rendezvous answers on 127.0.0.2";
}

// A reservation no load claims (its coordinator died after asking) does not hold the port for good.
TEST(WorkerService, AnUnclaimedReservationIsReleasedAfterItsExpiry) {
  WorkerServiceOptions options;
  options.port_reservation_ttl = absl::Milliseconds(300);
  RunningWorker worker = StartWorker(options);
  const auto asked = std::chrono::steady_clock::now();
  const int port = ReservePort(worker);
  ASSERT_GT(port, 0);
  EXPECT_TRUE(Listening(port));
  EXPECT_TRUE(ReleasedWithin(port, std::chrono::seconds(5)));
  EXPECT_GE(std::chrono::steady_clock::now() - asked, std::chrono::milliseconds(290));  // not before its time
}

}  // namespace
}  // namespace bertshard::worker
