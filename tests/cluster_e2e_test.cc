// The service end to end: a coordinator and four shard-worker processes on loopback. Submit,
// watch to READY, infer (equal to the reference), concurrent infers, text input, cancel; a worker
// killed with SIGKILL fails its job with a cause naming it, and a restarted coordinator still
// lists its jobs and takes the workers back.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <thread>

#include "bertshard/v1/coordinator.grpc.pb.h"
#include "checkpoint/safetensors.h"
#include "absl/time/clock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/test_process.h"

namespace bertshard {
namespace {

using testing::ReadAll;
using testing::Spawn;
using testing::TempDir;
using testing::WaitExit;
using testing::WaitForPort;

constexpr char kModel[] = "tests/testdata/model/masked_lm_untied";

std::unique_ptr<grpc::ClientContext> Context(int seconds = 60) {
  auto c = std::make_unique<grpc::ClientContext>();
  c->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(seconds));
  return c;
}

class Cluster : public ::testing::Test {
 protected:
  void SetUp() override {
    data_dir_ = TempDir() + "/coordinator-" + std::to_string(++counter_);
    StartCoordinator();
    for (int i = 0; i < 4; ++i) {
      spawn_index_.push_back(i);
      workers_.push_back(Spawn({"worker/shard-worker", "--listen=127.0.0.1:0", "--threads=1",
                                "--coordinator=127.0.0.1:" + std::to_string(port_)},
                               WorkerLog(i)));
    }
    ASSERT_TRUE(WaitForWorkers(4)) << ReadAll(WorkerLog(0));
  }

  void TearDown() override {
    for (pid_t w : workers_) {
      kill(w, SIGTERM);
      WaitExit(w);
    }
    StopCoordinator();
  }

  std::string WorkerLog(size_t i) const { return data_dir_ + "-worker" + std::to_string(i) + ".log"; }

  void StartCoordinator() {
    const std::string log = data_dir_ + ".log";
    std::ofstream(log, std::ios::trunc).close();
    coordinator_ = Spawn({"server/bertshard-coordinator", "--listen=127.0.0.1:" + std::to_string(port_),
                          "--data_dir=" + data_dir_, "--heartbeat_interval=1s", "--collective_timeout_s=8"},
                         log);
    const int port = WaitForPort(log);
    ASSERT_GT(port, 0) << ReadAll(log);
    port_ = port;
    stub_ = v1::Coordinator::NewStub(grpc::CreateChannel("127.0.0.1:" + std::to_string(port_),
                                                         grpc::InsecureChannelCredentials()));
  }

  void StopCoordinator() {
    if (coordinator_ <= 0) return;
    kill(coordinator_, SIGTERM);
    EXPECT_EQ(WaitExit(coordinator_), 0);
    coordinator_ = -1;
  }

  int HealthyIdle() {
    v1::ListWorkersResponse workers;
    if (!stub_->ListWorkers(Context().get(), v1::ListWorkersRequest(), &workers).ok()) return -1;
    int n = 0;
    for (const auto& w : workers.workers()) n += (w.healthy() && w.job_id().empty()) ? 1 : 0;
    return n;
  }

  // Heartbeats every second and death after two missed ones: slow enough that a loaded 2-core CI
  // machine does not make healthy workers flap.
  bool WaitForWorkers(int n) {
    for (int i = 0; i < 400; ++i) {
      if (HealthyIdle() >= n) return true;
      usleep(50 * 1000);
    }
    return false;
  }

  v1::Job Submit(const std::string& checkpoint) {
    v1::SubmitJobRequest submit;
    submit.mutable_request()->set_checkpoint(std::filesystem::absolute(checkpoint).string());
    submit.mutable_request()->mutable_parallel()->set_tp_size(2);
    submit.mutable_request()->mutable_parallel()->set_pp_size(2);
    v1::Job job;
    grpc::Status s = stub_->SubmitJob(Context().get(), submit, &job);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return job;
  }

  // Watches until the job settles; returns the last event.
  v1::JobEvent Watch(const std::string& id, int* progress_events = nullptr) {
    v1::GetJobRequest request;
    request.set_job_id(id);
    auto context = Context();
    auto reader = stub_->WatchJob(context.get(), request);
    v1::JobEvent event, last;
    while (reader->Read(&event)) {
      if (progress_events != nullptr) {
        for (const auto& r : event.ranks()) *progress_events += r.progress().tensors_loaded() > 0 ? 1 : 0;
      }
      last = event;
    }
    EXPECT_TRUE(reader->Finish().ok());
    return last;
  }

  // SIGKILLs the worker process serving `rank` of `job`; returns its worker id ("" if none).
  std::string KillWorkerServing(const std::string& job, int rank) {
    v1::ListWorkersResponse workers;
    if (!stub_->ListWorkers(Context().get(), v1::ListWorkersRequest(), &workers).ok()) return "";
    std::string victim_id;
    for (const auto& w : workers.workers()) {
      if (w.job_id() == job && w.rank() == rank) victim_id = w.worker_id();
    }
    if (victim_id.empty()) return "";
    for (size_t i = 0; i < workers_.size(); ++i) {
      if (ReadAll(WorkerLog(static_cast<size_t>(spawn_index_[i]))).find("as " + victim_id + "\n") != std::string::npos) {
        kill(workers_[i], SIGKILL);
        WaitExit(workers_[i]);
        workers_.erase(workers_.begin() + static_cast<long>(i));
        spawn_index_.erase(spawn_index_.begin() + static_cast<long>(i));
        return victim_id;
      }
    }
    return "";
  }

  static v1::TokenInputs Tokens(int row = -1) {
    const auto j = nlohmann::json::parse(ReadAll(std::string(kModel) + "/input.json"));
    v1::TokenInputs t;
    t.set_seq(static_cast<int64_t>(j["input_ids"][0].size()));
    t.set_choices(1);
    for (size_t r = 0; r < j["input_ids"].size(); ++r) {
      if (row >= 0 && static_cast<int>(r) != row) continue;
      t.set_rows(t.rows() + 1);
      for (const auto& v : j["input_ids"][r]) t.add_input_ids(v.get<int64_t>());
      for (const auto& v : j["attention_mask"][r]) t.add_attention_mask(v.get<int64_t>());
      for (const auto& v : j["token_type_ids"][r]) t.add_token_type_ids(v.get<int64_t>());
    }
    return t;
  }

  static std::vector<float> Expected(int row = -1) {
    auto file = checkpoint::SafetensorsFile::Open(std::string(kModel) + "/expected.safetensors");
    const checkpoint::TensorInfo* logits = (*file)->Find("logits");
    std::vector<float> all(static_cast<size_t>(logits->numel()));
    EXPECT_TRUE((*file)->ReadSlice(*logits, {}, all.data()).ok());
    if (row < 0) return all;
    const size_t per_row = all.size() / static_cast<size_t>(logits->shape[0]);
    return std::vector<float>(all.begin() + row * per_row, all.begin() + (row + 1) * per_row);
  }

  static float MaxDiff(const v1::NamedTensor& got, const std::vector<float>& want) {
    if (got.values_size() != static_cast<int>(want.size())) return 1e9f;
    float m = 0;
    for (size_t i = 0; i < want.size(); ++i) m = std::max(m, std::fabs(got.values(static_cast<int>(i)) - want[i]));
    return m;
  }

  static int counter_;
  std::string data_dir_;
  int port_ = 0;
  pid_t coordinator_ = -1;
  std::vector<pid_t> workers_;
  std::vector<int> spawn_index_;  // which log each entry of workers_ writes
  std::unique_ptr<v1::Coordinator::Stub> stub_;
};

int Cluster::counter_ = 0;

TEST_F(Cluster, SubmitWatchInferConcurrentlyAndCancel) {
  const v1::Job job = Submit(kModel);
  int progress_events = 0;
  const v1::JobEvent ready = Watch(job.id(), &progress_events);
  ASSERT_EQ(ready.job().state(), v1::READY) << ready.job().failure_cause();
  EXPECT_GT(progress_events, 0);
  EXPECT_EQ(ready.job().ranks_size(), 4);

  v1::InferRequest infer;
  infer.set_job_id(job.id());
  *infer.mutable_tokens() = Tokens();
  v1::InferResponse response;
  grpc::Status status = stub_->Infer(Context().get(), infer, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  ASSERT_EQ(response.outputs_size(), 1);
  EXPECT_EQ(response.outputs(0).name(), "logits");
  EXPECT_LE(MaxDiff(response.outputs(0), Expected()), 1e-5f);

  // Several clients at once: each gets its own row's answer.
  std::vector<float> diffs(6, 1e9f);
  std::vector<std::thread> clients;
  for (int c = 0; c < 6; ++c) {
    clients.emplace_back([&, c] {
      v1::InferRequest one;
      one.set_job_id(job.id());
      *one.mutable_tokens() = Tokens(c % 2);
      v1::InferResponse answer;
      if (stub_->Infer(Context().get(), one, &answer).ok() && answer.outputs_size() == 1) {
        diffs[static_cast<size_t>(c)] = MaxDiff(answer.outputs(0), Expected(c % 2));
      }
    });
  }
  for (auto& t : clients) t.join();
  for (float d : diffs) EXPECT_LE(d, 1e-5f);

  // Bad input over the API.
  v1::InferRequest bad = infer;
  bad.mutable_tokens()->set_input_ids(0, 99);  // == vocab_size
  EXPECT_EQ(stub_->Infer(Context().get(), bad, &response).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  bad = infer;
  bad.mutable_tokens()->mutable_input_ids()->RemoveLast();
  EXPECT_EQ(stub_->Infer(Context().get(), bad, &response).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  bad.set_job_id("job-that-does-not-exist");
  EXPECT_EQ(stub_->Infer(Context().get(), bad, &response).error_code(), grpc::StatusCode::NOT_FOUND);
  v1::SubmitJobRequest missing;
  missing.mutable_request()->set_checkpoint("/nonexistent/checkpoint");
  v1::Job refused;
  EXPECT_EQ(stub_->SubmitJob(Context().get(), missing, &refused).error_code(), grpc::StatusCode::INVALID_ARGUMENT);

  v1::GetJobRequest cancel;
  cancel.set_job_id(job.id());
  v1::Job cancelled;
  ASSERT_TRUE(stub_->CancelJob(Context().get(), cancel, &cancelled).ok());
  EXPECT_EQ(cancelled.state(), v1::CANCELLED);
  EXPECT_EQ(stub_->Infer(Context().get(), infer, &response).error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_TRUE(WaitForWorkers(4));
}

TEST_F(Cluster, TextInputUsesTheCheckpointVocabulary) {
  const std::string dir = TempDir() + "/text_model";
  std::filesystem::create_directories(dir);
  for (const char* f : {"config.json", "model.safetensors"}) {
    std::filesystem::copy_file(std::string(kModel) + "/" + f, dir + "/" + f,
                               std::filesystem::copy_options::overwrite_existing);
  }
  std::ofstream vocab(dir + "/vocab.txt");
  vocab << "[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\n";
  for (int i = 5; i < 99; ++i) vocab << "w" << i << "\n";
  vocab.close();
  const v1::Job job = Submit(dir);
  ASSERT_EQ(Watch(job.id()).job().state(), v1::READY);
  v1::InferRequest infer;
  infer.set_job_id(job.id());
  infer.mutable_text()->add_texts("w7 W8 w9!");   // "!" is unknown here
  infer.mutable_text()->add_texts("w10");
  v1::InferResponse response;
  grpc::Status status = stub_->Infer(Context().get(), infer, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  // [CLS] w7 w8 w9 [UNK] [SEP], and the second text padded to 6 (seq 6: a multiple of tp 2).
  EXPECT_EQ(std::vector<int64_t>(response.tokens().input_ids().begin(), response.tokens().input_ids().end()),
            (std::vector<int64_t>{2, 7, 8, 9, 1, 3, 2, 10, 3, 0, 0, 0}));
  EXPECT_EQ(std::vector<int64_t>(response.outputs(0).shape().begin(), response.outputs(0).shape().end()),
            (std::vector<int64_t>{2, 6, 99}));
}

TEST_F(Cluster, KilledWorkerFailsItsJobAndCoordinatorRestartKeepsJobs) {
  const v1::Job job = Submit(kModel);
  const v1::JobEvent ready = Watch(job.id());
  ASSERT_EQ(ready.job().state(), v1::READY) << ready.job().failure_cause();
  // Kill the worker serving rank 3 between requests.
  const std::string victim_id = KillWorkerServing(job.id(), 3);
  ASSERT_FALSE(victim_id.empty());
  v1::InferRequest infer;
  infer.set_job_id(job.id());
  *infer.mutable_tokens() = Tokens();
  v1::InferResponse response;
  EXPECT_FALSE(stub_->Infer(Context().get(), infer, &response).ok());
  v1::GetJobRequest get;
  get.set_job_id(job.id());
  v1::Job failed;
  for (int i = 0; i < 100; ++i) {
    ASSERT_TRUE(stub_->GetJob(Context().get(), get, &failed).ok());
    if (failed.state() == v1::FAILED) break;
    usleep(50 * 1000);
  }
  EXPECT_EQ(failed.state(), v1::FAILED);
  EXPECT_NE(failed.failure_cause().find(victim_id), std::string::npos) << failed.failure_cause();
  EXPECT_NE(failed.failure_cause().find("rank 3"), std::string::npos) << failed.failure_cause();
  EXPECT_TRUE(WaitForWorkers(3));  // the survivors are idle again
  // Within two heartbeat intervals the coordinator marks the killed worker dead.
  bool dead = false;
  v1::ListWorkersResponse workers;
  for (int i = 0; i < 100 && !dead; ++i) {
    ASSERT_TRUE(stub_->ListWorkers(Context().get(), v1::ListWorkersRequest(), &workers).ok());
    for (const auto& w : workers.workers()) dead |= (w.worker_id() == victim_id && !w.healthy());
    if (!dead) usleep(50 * 1000);
  }
  EXPECT_TRUE(dead);

  // A new job while one worker is gone stays PENDING, or is refused when asked not to wait.
  v1::SubmitJobRequest no_wait;
  no_wait.mutable_request()->set_checkpoint(std::filesystem::absolute(kModel).string());
  no_wait.mutable_request()->mutable_parallel()->set_tp_size(2);
  no_wait.mutable_request()->mutable_parallel()->set_pp_size(2);
  no_wait.set_fail_if_no_workers(true);
  v1::Job refused;
  EXPECT_EQ(stub_->SubmitJob(Context().get(), no_wait, &refused).error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  const v1::Job pending = Submit(kModel);
  EXPECT_EQ(pending.state(), v1::PENDING);

  // Restart the coordinator: it still lists every job, and the workers register again.
  StopCoordinator();
  StartCoordinator();
  v1::ListJobsResponse jobs;
  ASSERT_TRUE(stub_->ListJobs(Context().get(), v1::ListJobsRequest(), &jobs).ok());
  ASSERT_EQ(jobs.jobs_size(), 2);
  EXPECT_EQ(jobs.jobs(0).id(), job.id());
  EXPECT_EQ(jobs.jobs(0).state(), v1::FAILED);
  EXPECT_EQ(jobs.jobs(1).state(), v1::PENDING);
  EXPECT_TRUE(WaitForWorkers(3)) << ReadAll(data_dir_ + ".log") << ReadAll(WorkerLog(0)) << ReadAll(WorkerLog(1))
                                << ReadAll(WorkerLog(2)) << ReadAll(WorkerLog(3)) << [&] {
                                     std::string alive;
                                     for (pid_t p : workers_) {  // survivors still running?
                                       int status = 0;
                                       const pid_t r = waitpid(p, &status, WNOHANG);
                                       alive += "pid " + std::to_string(p) + (r == 0 ? " alive; " : " exited with " + std::to_string(status) + "; ");
                                     }
                                     return alive;
                                   }() << [&] {
                                     v1::ListWorkersResponse w;
                                     stub_->ListWorkers(Context().get(), v1::ListWorkersRequest(), &w);
                                     return w.DebugString();
                                   }();
}

struct Cli {
  int exit_code;
  std::string output;
};

Cli Shardctl(std::vector<std::string> args) {
  args.insert(args.begin(), "client/shardctl");
  testing::Captured c = testing::Run(args);
  return {c.exit_code, c.out + c.err};
}

TEST_F(Cluster, ShardctlDrivesTheCluster) {
  const std::string server = "--server=127.0.0.1:" + std::to_string(port_);
  const std::string model = std::filesystem::absolute(kModel).string();
  Cli submit = Shardctl({"submit", server, "--checkpoint", model, "--tp", "2", "--pp", "2"});
  ASSERT_EQ(submit.exit_code, 0) << submit.output;
  const std::string id = submit.output.substr(0, submit.output.find('\n'));
  Cli watch = Shardctl({"watch", id, server});
  EXPECT_EQ(watch.exit_code, 0) << watch.output;
  EXPECT_NE(watch.output.find("READY"), std::string::npos) << watch.output;
  const std::string out = TempDir() + "/cli_out.safetensors";
  Cli infer = Shardctl({"infer", id, server, "--input", model + "/input.json", "--output", out});
  ASSERT_EQ(infer.exit_code, 0) << infer.output;
  auto file = checkpoint::SafetensorsFile::Open(out);
  ASSERT_TRUE(file.ok()) << file.status();
  std::vector<float> got(static_cast<size_t>((*file)->Find("logits")->numel()));
  ASSERT_TRUE((*file)->ReadSlice(*(*file)->Find("logits"), {}, got.data()).ok());
  const std::vector<float> want = Expected();
  ASSERT_EQ(got.size(), want.size());
  float max_diff = 0;
  for (size_t i = 0; i < got.size(); ++i) max_diff = std::max(max_diff, std::fabs(got[i] - want[i]));
  EXPECT_LE(max_diff, 1e-5f);
  Cli jobs = Shardctl({"jobs", server});
  EXPECT_NE(jobs.output.find(id), std::string::npos) << jobs.output;
  Cli workers = Shardctl({"workers", server});
  EXPECT_EQ(std::count(workers.output.begin(), workers.output.end(), '\n'), 5) << workers.output;
  EXPECT_EQ(Shardctl({"job", "no-such-job", server}).exit_code, 3);
  Cli text = Shardctl({"infer", id, server, "--text", "hello"});  // this checkpoint has no vocab.txt
  EXPECT_EQ(text.exit_code, 1);
  EXPECT_NE(text.output.find("vocab.txt"), std::string::npos) << text.output;
  EXPECT_EQ(Shardctl({"infer", id, server}).exit_code, 2);
  Cli cancel = Shardctl({"cancel", id, server});
  EXPECT_EQ(cancel.exit_code, 0);
  EXPECT_NE(cancel.output.find("CANCELLED"), std::string::npos) << cancel.output;
  EXPECT_EQ(Shardctl({"cancel", id, server}).exit_code, 1);  // already cancelled
}

TEST_F(Cluster, WorkerKilledWhileLoadingFailsTheJobWithoutHanging) {
  const v1::Job job = Submit(kModel);
  // Ranks are assigned when SubmitJob returns: kill rank 3's worker before it can finish.
  const std::string victim_id = KillWorkerServing(job.id(), 3);
  ASSERT_FALSE(victim_id.empty());
  const v1::JobEvent last = Watch(job.id());  // returns: the job settles, nothing hangs
  EXPECT_EQ(last.job().state(), v1::FAILED);
  EXPECT_NE(last.job().failure_cause().find(victim_id), std::string::npos) << last.job().failure_cause();
  EXPECT_TRUE(WaitForWorkers(3));
}

TEST_F(Cluster, WorkerKilledDuringAnInferenceFailsItWithoutHanging) {
  // A model big enough that a forward takes a while on two cores.
  const std::string dir = TempDir() + "/slow_model";
  Cli init = Shardctl({"init-checkpoint", "--variant", "BertModel", "--seed", "3", "--out", dir, "--config",
                       R"({"vocab_size": 1000, "hidden_size": 256, "num_attention_heads": 4,
                           "intermediate_size": 1024, "num_hidden_layers": 8, "max_position_embeddings": 512})"});
  ASSERT_EQ(init.exit_code, 0) << init.output;
  const v1::Job job = Submit(dir);
  ASSERT_EQ(Watch(job.id()).job().state(), v1::READY);
  v1::InferRequest infer;
  infer.set_job_id(job.id());
  v1::TokenInputs* t = infer.mutable_tokens();
  t->set_rows(16);
  t->set_seq(512);
  for (int i = 0; i < 16 * 512; ++i) t->add_input_ids(1 + i % 997);
  infer.set_micro_batches(8);
  grpc::Status status;
  absl::Time started;
  std::thread client([&] {
    v1::InferResponse response;
    started = absl::Now();
    status = stub_->Infer(Context().get(), infer, &response);
  });
  usleep(300 * 1000);  // the forward is under way
  const std::string victim_id = KillWorkerServing(job.id(), 2);
  EXPECT_FALSE(victim_id.empty());  // not ASSERT: the client thread must be joined
  client.join();
  EXPECT_FALSE(status.ok()) << "the inference finished before the kill; make the model bigger";
  EXPECT_LT(absl::Now() - started, absl::Seconds(30));  // bounded by the collective timeout, no hang
  v1::GetJobRequest get;
  get.set_job_id(job.id());
  v1::Job failed;
  ASSERT_TRUE(stub_->GetJob(Context().get(), get, &failed).ok());
  EXPECT_EQ(failed.state(), v1::FAILED);
  EXPECT_NE(failed.failure_cause().find(victim_id), std::string::npos) << failed.failure_cause();
  EXPECT_NE(failed.failure_cause().find("rank 2"), std::string::npos) << failed.failure_cause();
  EXPECT_TRUE(WaitForWorkers(3)) << [&] {
    v1::ListWorkersResponse w;
    stub_->ListWorkers(Context().get(), v1::ListWorkersRequest(), &w);
    return w.DebugString() + ReadAll(WorkerLog(0)) + ReadAll(WorkerLog(1)) + ReadAll(WorkerLog(2)) + ReadAll(WorkerLog(3));
  }();
}

}  // namespace
}  // namespace bertshard
