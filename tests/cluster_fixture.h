// File: tests/cluster_fixture.h
// -----------------------------------------------------------------------------
// The one way tests start a cluster: LocalCluster runs a coordinator and shard-worker processes on
// loopback, built from this workspace's binaries (start, restart on the same port, add, kill and
// stop workers, wait for them to register, read the logs). Cluster is the per-test gtest fixture
// on it (a coordinator and four workers per test) with helpers to submit, watch, infer, find and
// kill the worker serving a rank, hold workers at pause points, and ask a worker directly whether
// it still holds a job; the cluster tests derive their fixtures from it. A suite whose tests share
// one cluster holds a LocalCluster of its own (tests/serving_fixture.h).
//
// Example:
//   LocalCluster cluster("serving", {"--max_batch_delay_ms=200"});
//   ASSERT_EQ(cluster.Start(/*workers=*/3), "");
//   cluster.stub().Infer(Context().get(), request, &response);
//
// Failure model: a process that does not come up is an error string with its log (LocalCluster)
// or a fatal test failure (Cluster's SetUp); the destructor stops whatever is still running.
//
// Thread safety: the helpers may be called from several test threads at once (each makes its own
// gRPC context); starting, stopping and killing processes only from the test's main thread.
#ifndef BERTSHARD_TESTS_CLUSTER_FIXTURE_H_
#define BERTSHARD_TESTS_CLUSTER_FIXTURE_H_

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/time/clock.h"
#include "bertshard/v1/coordinator.grpc.pb.h"
#include "bertshard/v1/worker.grpc.pb.h"
#include "checkpoint/safetensors.h"
#include "common/grpc_auth.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/closed_loop_clients.h"
#include "tests/test_process.h"

namespace bertshard::testing {

inline constexpr char kModel[] = "tests/testdata/model/masked_lm_untied";

// A call's context with a deadline `timeout` from now. Carries $BERTSHARD_TOKEN when set
// (TokenCluster sets it for this process and the cluster's).
inline std::unique_ptr<grpc::ClientContext> Context(std::chrono::milliseconds timeout) {
  auto c = std::make_unique<grpc::ClientContext>();
  c->set_deadline(std::chrono::system_clock::now() + timeout);
  const char* token = std::getenv("BERTSHARD_TOKEN");
  common::AttachToken(c.get(), token == nullptr ? "" : token);
  return c;
}
inline std::unique_ptr<grpc::ClientContext> Context(int seconds = 60) { return Context(std::chrono::seconds(seconds)); }

// What a shardctl run printed: `output` is stdout then stderr.
struct Cli {
  int exit_code;
  std::string output;
  std::string out, err;
  std::string all() const { return output; }
};

inline Cli Shardctl(std::vector<std::string> args) {
  args.insert(args.begin(), "client/shardctl");
  testing::Captured c = testing::Run(args);
  return {c.exit_code, c.out + c.err, c.out, c.err};
}

// The output `name` of an Infer answer; null if it has none.
inline const v1::NamedTensor* FindOutput(const v1::InferResponse& response, const std::string& name) {
  for (const auto& t : response.outputs()) {
    if (t.name() == name) return &t;
  }
  return nullptr;
}

inline std::vector<int64_t> Shape(const v1::NamedTensor& t) { return {t.shape().begin(), t.shape().end()}; }

// A copy of `model`'s config.json and model.safetensors in TempDir()/`name`, with a vocab.txt of
// the model's 99 ids: [PAD] [UNK] [CLS] [SEP] [MASK] are 0-4 and "wN" is id N, so a test can write
// text whose token ids it knows. Returns the directory.
inline std::string CheckpointWithWordVocabulary(const std::string& model, const std::string& name) {
  const std::string dir = TempDir() + "/" + name;
  std::filesystem::create_directories(dir);
  for (const char* f : {"config.json", "model.safetensors"}) {
    std::filesystem::copy_file(model + "/" + f, dir + "/" + f, std::filesystem::copy_options::overwrite_existing);
  }
  std::ofstream vocab(dir + "/vocab.txt");
  vocab << "[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\n";
  for (int i = 5; i < 99; ++i) vocab << "w" << i << "\n";
  return dir;
}

// A coordinator and shard-worker processes on loopback, from this workspace's binaries: the one
// launcher of the tests. A test suite that shares one cluster among its tests holds one (started in
// SetUpTestSuite); the Cluster fixture below is one per test. Settings are read when a process
// starts, so a test sets them first (a derived fixture in its constructor).
class LocalCluster {
 public:
  LocalCluster() = default;
  // `name`: its data directory and logs go in TempDir()/name; `coordinator_flags` are added to the
  // coordinator's own.
  LocalCluster(const std::string& name, std::vector<std::string> coordinator_flags)
      : data_dir_(TempDir() + "/" + name), coordinator_flags_(std::move(coordinator_flags)) {}
  // Stops what is still running.
  virtual ~LocalCluster() {
    TerminateWorkers();
    TerminateCoordinator();
  }
  LocalCluster(const LocalCluster&) = delete;
  LocalCluster& operator=(const LocalCluster&) = delete;

  // The coordinator and `workers` workers, waiting until every worker is registered and healthy;
  // "" on success, else what went wrong (with the logs).
  std::string Start(int workers) {
    std::string error = LaunchCoordinator();
    if (!error.empty()) return error;
    for (int i = 0; i < workers; ++i) LaunchWorker();
    return WaitForHealthy(workers) ? "" : "the workers did not register: " + Logs();
  }

  // Starts the coordinator on port_ (any free port the first time, the same one again after a
  // restart) and connects stub_ to it; "" on success, else why not (with its log).
  std::string LaunchCoordinator() {
    const std::string log = data_dir_ + ".log";
    std::ofstream(log, std::ios::trunc).close();
    std::vector<std::string> args = {"server/bertshard-coordinator", "--listen=127.0.0.1:" + std::to_string(port_),
                                     "--data_dir=" + data_dir_, "--heartbeat_interval=" + heartbeat_interval_,
                                     "--collective_timeout_s=" + collective_timeout_s_};
    if (!readopt_grace_.empty()) args.push_back("--readopt_grace=" + readopt_grace_);
    if (!drain_timeout_.empty()) args.push_back("--drain_timeout=" + drain_timeout_);
    args.insert(args.end(), coordinator_flags_.begin(), coordinator_flags_.end());
    args.insert(args.end(), tls_flags_.begin(), tls_flags_.end());
    coordinator_ = Spawn(args, log);
    const int port = WaitForPort(log);
    if (port <= 0) return "the coordinator did not start: " + ReadAll(log);
    port_ = port;
    grpc::ChannelArguments channel_args;
    if (max_receive_message_bytes_ > 0) channel_args.SetMaxReceiveMessageSize(max_receive_message_bytes_);
    stub_ = v1::Coordinator::NewStub(grpc::CreateCustomChannel(
        "127.0.0.1:" + std::to_string(port_),
        client_credentials_ != nullptr ? client_credentials_ : grpc::InsecureChannelCredentials(), channel_args));
    return "";
  }

  // SIGTERM to the coordinator; its exit status (-1 if none was running).
  int TerminateCoordinator() {
    if (coordinator_ <= 0) return -1;
    // Close this test's connection first. An idle client channel notices the server's GOAWAY only
    // at gRPC's backup poll (every 5 s), and the server's graceful shutdown waits for it: every
    // stop took 3-5 s before this.
    stub_.reset();
    kill(coordinator_, SIGTERM);
    const int status = WaitExit(coordinator_);
    coordinator_ = -1;
    return status;
  }

  // Starts one more shard-worker process (its log: WorkerLog(spawn_index_.back())); returns its
  // index in workers_.
  int LaunchWorker() {
    const int log = next_log_++;
    std::vector<std::string> args = {"worker/shard-worker", "--listen=127.0.0.1:0", "--threads=1",
                                     "--coordinator=127.0.0.1:" + std::to_string(port_)};
    args.insert(args.end(), tls_flags_.begin(), tls_flags_.end());
    workers_.push_back(Spawn(args, WorkerLog(static_cast<size_t>(log))));
    spawn_index_.push_back(log);
    return static_cast<int>(workers_.size()) - 1;
  }

  // SIGTERM to every worker (continued first: a stopped one would never handle it), then waits
  // for them all.
  void TerminateWorkers() {
    for (pid_t w : workers_) {
      kill(w, SIGCONT);
      kill(w, SIGTERM);
    }
    for (pid_t w : workers_) WaitExit(w);
    workers_.clear();
    spawn_index_.clear();
  }

  void KillWorker(int i) {
    kill(workers_[static_cast<size_t>(i)], SIGKILL);
    WaitExit(workers_[static_cast<size_t>(i)]);
    workers_.erase(workers_.begin() + i);
    spawn_index_.erase(spawn_index_.begin() + i);
  }

  // The log of the `i`th worker process started (an index in spawn_index_'s terms, not workers_').
  std::string WorkerLog(size_t i) const { return data_dir_ + "-worker" + std::to_string(i) + ".log"; }

  // The coordinator's log and every worker's.
  std::string Logs() const {
    std::string logs = "--- coordinator:\n" + ReadAll(data_dir_ + ".log");
    for (int i = 0; i < next_log_; ++i) {
      logs += "--- worker " + std::to_string(i) + ":\n" + ReadAll(WorkerLog(static_cast<size_t>(i)));
    }
    return logs;
  }

  v1::Coordinator::Stub& stub() { return *stub_; }
  std::string server() const { return "--server=127.0.0.1:" + std::to_string(port_); }

  // Healthy workers with no job; -1 if the coordinator does not answer.
  int HealthyIdle() {
    v1::ListWorkersResponse workers;
    if (!stub_->ListWorkers(Context().get(), v1::ListWorkersRequest(), &workers).ok()) return -1;
    int n = 0;
    for (const auto& w : workers.workers()) n += (w.healthy() && w.job_id().empty()) ? 1 : 0;
    return n;
  }

  // Waits up to ~20 s for `n` healthy idle workers. Heartbeats every second and death after 3
  // intervals of silence (the coordinator's default): slow enough that a loaded 2-core CI machine
  // does not make healthy workers flap.
  bool WaitForWorkers(int n) {
    for (int i = 0; i < 400; ++i) {
      if (HealthyIdle() >= n) return true;
      usleep(50 * 1000);
    }
    return false;
  }

  // Waits up to ~20 s for `n` healthy workers, busy or not (after a coordinator restart the
  // workers register again holding their jobs).
  // Up to 2 minutes: workers load LibTorch as they start, and a 2-core machine running the suite's
  // other tests beside them has been seen to take more than 20 s for five of them.
  bool WaitForHealthy(int n) {
    for (int i = 0; i < 2400; ++i) {
      v1::ListWorkersResponse workers;
      int healthy = 0;
      if (stub_->ListWorkers(Context().get(), v1::ListWorkersRequest(), &workers).ok()) {
        for (const auto& w : workers.workers()) healthy += w.healthy() ? 1 : 0;
      }
      if (healthy >= n) return true;
      usleep(50 * 1000);
    }
    return false;
  }

  // Watches `id` until it settles; "" if READY, else why not (with the logs).
  std::string WaitReady(const std::string& id) {
    v1::GetJobRequest request;
    request.set_job_id(id);
    auto context = Context(120);
    auto reader = stub_->WatchJob(context.get(), request);
    v1::JobEvent event, last;
    while (reader->Read(&event)) last = event;
    const grpc::Status s = reader->Finish();
    if (!s.ok()) return "WatchJob(" + id + "): " + s.error_message();
    if (last.job().state() != v1::READY) {
      return "job " + id + " is " + v1::JobState_Name(last.job().state()) + ": " + last.job().failure_cause() + "\n" +
             Logs();
    }
    return "";
  }

  // The job once every replica it wants is READY and no live update runs (or it ended, or 60 s passed).
  v1::Job WatchAllReplicas(const std::string& id) {
    v1::GetJobRequest request;
    request.set_job_id(id);
    request.set_all_replicas(true);
    auto context = Context(60);
    auto reader = stub_->WatchJob(context.get(), request);
    v1::JobEvent event;
    v1::Job last;
    while (reader->Read(&event)) last = event.job();
    const grpc::Status finished = reader->Finish();
    EXPECT_TRUE(finished.ok()) << finished.error_message() << " " << last.DebugString();
    return last;
  }
  v1::Job GetJob(const std::string& id) {
    v1::GetJobRequest get;
    get.set_job_id(id);
    v1::Job job;
    EXPECT_TRUE(stub_->GetJob(Context().get(), get, &job).ok());
    return job;
  }

  // Why `job` last went back to PENDING to be placed again after losing a worker (its latest
  // "recovering: ..." history entry); "" when it never did.
  static std::string RecoveryReason(const v1::Job& job) {
    std::string reason;
    for (const v1::StateChange& change : job.history()) {
      if (change.state() == v1::PENDING && change.reason().rfind("recovering: ", 0) == 0) reason = change.reason();
    }
    return reason;
  }

  // Polls GetJob until `job` has lost its group at least once (it is recovering, or has recovered:
  // its history says so) or has ended, for up to `limit`; the job as last seen.
  v1::Job WaitLost(const std::string& job, absl::Duration limit = absl::Seconds(20)) {
    v1::Job seen;
    const absl::Time end = absl::Now() + limit;
    while (absl::Now() < end) {
      v1::GetJobRequest get;
      get.set_job_id(job);
      if (stub_->GetJob(Context(5).get(), get, &seen).ok() &&
          (!RecoveryReason(seen).empty() || seen.state() == v1::FAILED || seen.state() == v1::CANCELLED)) {
        return seen;
      }
      usleep(20 * 1000);
    }
    return seen;
  }

  // Settings: the coordinator's flags (an empty one is not passed), the flags given to the
  // coordinator and every worker (TlsCluster), the test's own channel credentials and the most
  // it takes in one answer (0: gRPC's default, 4 MiB).
  std::string data_dir_;
  std::vector<std::string> coordinator_flags_;
  std::string heartbeat_interval_ = "1s";
  std::string collective_timeout_s_ = "8";
  std::string readopt_grace_ = "6s";
  std::string drain_timeout_ = "10s";
  std::vector<std::string> tls_flags_;
  std::shared_ptr<grpc::ChannelCredentials> client_credentials_;
  int max_receive_message_bytes_ = 0;
  // State.
  int port_ = 0;
  pid_t coordinator_ = -1;
  std::vector<pid_t> workers_;
  std::vector<int> spawn_index_;  // which log each entry of workers_ writes
  int next_log_ = 0;              // the next worker's log
  std::unique_ptr<v1::Coordinator::Stub> stub_;
};

// One cluster per test: a coordinator and four workers started in SetUp, stopped in TearDown, with
// helpers to submit, watch, infer, kill and probe. A test file changes the cluster's settings by
// deriving a fixture that sets them in its constructor.
class Cluster : public ::testing::Test, public LocalCluster {
 protected:
  void SetUp() override {
    data_dir_ = TempDir() + "/coordinator-" + std::to_string(++counter_);
    StartCoordinator();
    for (int i = 0; i < 4; ++i) LaunchWorker();
    ASSERT_TRUE(WaitForWorkers(4)) << ReadAll(WorkerLog(0));
  }

  void TearDown() override {
    if (!fault_dir_.empty()) {
      std::filesystem::remove_all(fault_dir_);  // no worker stays held
      unsetenv("BERTSHARD_FAULT_DIR");
    }
    TerminateWorkers();
    StopCoordinator();
  }

  void StartCoordinator() {
    const std::string error = LaunchCoordinator();
    ASSERT_TRUE(error.empty()) << error;
  }

  void StopCoordinator() {
    if (coordinator_ > 0) {
      EXPECT_EQ(TerminateCoordinator(), 0);
    }
  }

  // Pause points (common/fault_point.h). UseFaultDir, called from a derived fixture's constructor,
  // gives the workers SetUp spawns a fault directory; Hold(point) then stops every worker that
  // reaches `point` until Release(point).
  void UseFaultDir(const std::string& name) {
    fault_dir_ = TempDir() + "/faults-" + std::to_string(getpid()) + "-" + name;
    std::filesystem::remove_all(fault_dir_);
    std::filesystem::create_directories(fault_dir_);
    setenv("BERTSHARD_FAULT_DIR", fault_dir_.c_str(), 1);  // inherited by the processes spawned
  }
  void Hold(const std::string& point) { std::ofstream(fault_dir_ + "/" + point + ".hold").close(); }
  void Release(const std::string& point) { std::filesystem::remove(fault_dir_ + "/" + point + ".hold"); }

  // The pids of the processes that reached `point`, once at least `n` have (up to 60 s); empty
  // on timeout.
  std::vector<pid_t> WaitReached(const std::string& point, size_t n) {
    const std::string prefix = point + ".";
    for (int i = 0; i < 6000; ++i) {
      std::vector<pid_t> pids;
      for (const auto& entry : std::filesystem::directory_iterator(fault_dir_)) {
        const std::string f = entry.path().filename().string();
        if (f.rfind(prefix, 0) == 0 && f.size() > 8 && f.substr(f.size() - 8) == ".reached") {
          pids.push_back(std::atoi(f.c_str() + prefix.size()));
        }
      }
      if (pids.size() >= n) return pids;
      usleep(10 * 1000);
    }
    return {};
  }

  // The index in workers_ of process `pid`; -1 if it is not one of them.
  int IndexOf(pid_t pid) const {
    for (size_t i = 0; i < workers_.size(); ++i) {
      if (workers_[i] == pid) return static_cast<int>(i);
    }
    return -1;
  }

  // The worker id worker process `i` last registered as ("" if its log does not say yet).
  std::string IdOf(int i) const {
    const std::string log = ReadAll(WorkerLog(static_cast<size_t>(spawn_index_[static_cast<size_t>(i)])));
    const size_t at = log.rfind(" as worker-");  // the latest: a worker registers again under a new id
    return at == std::string::npos ? "" : log.substr(at + 4, log.find(' ', at + 4) - (at + 4));
  }

  v1::Job Submit(const std::string& checkpoint, int tp = 2, int pp = 2) {
    v1::SubmitJobRequest submit;
    submit.mutable_request()->set_checkpoint(std::filesystem::absolute(checkpoint).string());
    submit.mutable_request()->mutable_parallel()->set_tp_size(tp);
    submit.mutable_request()->mutable_parallel()->set_pp_size(pp);
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

  // The index in workers_ of the process serving `rank` of `job`, and its worker id; -1 if none.
  int WorkerServing(const std::string& job, int rank, std::string* id) {
    v1::ListWorkersResponse workers;
    if (!stub_->ListWorkers(Context().get(), v1::ListWorkersRequest(), &workers).ok()) return -1;
    for (const auto& w : workers.workers()) {
      if (w.job_id() == job && w.rank() == rank) *id = w.worker_id();
    }
    return id->empty() ? -1 : IndexOfId(*id);
  }

  // The index in workers_ of the process that registered as `id` at some point; -1 if none.
  int IndexOfId(const std::string& id) const {
    for (size_t i = 0; i < workers_.size(); ++i) {
      if (ReadAll(WorkerLog(static_cast<size_t>(spawn_index_[i]))).find("as " + id + " (") != std::string::npos) {
        return static_cast<int>(i);
      }
    }
    return -1;
  }

  // Polls GetJob until `job` is in `want` or has ended (FAILED, CANCELLED), for up to `limit`; the
  // job as last seen.
  v1::Job WaitState(const std::string& job, v1::JobState want, absl::Duration limit = absl::Seconds(20)) {
    v1::Job seen;
    const absl::Time end = absl::Now() + limit;
    while (absl::Now() < end) {
      v1::GetJobRequest get;
      get.set_job_id(job);
      if (stub_->GetJob(Context(5).get(), get, &seen).ok() &&
          (seen.state() == want || seen.state() == v1::FAILED || seen.state() == v1::CANCELLED)) {
        return seen;
      }
      usleep(20 * 1000);
    }
    return seen;
  }

  // SIGKILLs the worker process serving `rank` of `job`; returns its worker id ("" if none).
  std::string KillWorkerServing(const std::string& job, int rank) {
    std::string victim_id;
    const int i = WorkerServing(job, rank, &victim_id);
    if (i < 0) return "";
    KillWorker(i);
    return victim_id;
  }

  // Whether worker process `i` (an index in workers_) still holds `job`, asked directly: it
  // refuses a forward numbered -1 as out of order when it holds the job, as not loaded otherwise.
  bool Holds(size_t i, const std::string& job) {
    return ProbeForward(i, job).error_message().find("is not loaded here") == std::string::npos;
  }

  // The forward sequence number worker process `i` expects next for `job` (-1 if it does not hold
  // it). The probe waits for a forward running there, which holds the job's lock, to finish.
  int64_t NextSequence(size_t i, const std::string& job) {
    const std::string message = ProbeForward(i, job).error_message();
    const size_t at = message.find("next is ");
    return at == std::string::npos ? -1 : std::atoll(message.c_str() + at + 8);
  }

  // A forward numbered -1 of `job`, sent straight to worker process `i`: refused as out of order
  // when it holds the job, as not loaded otherwise.
  grpc::Status ProbeForward(size_t i, const std::string& job) {
    const int port = WaitForPort(WorkerLog(static_cast<size_t>(spawn_index_[i])));
    auto worker = v1::Worker::NewStub(
        grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials()));
    v1::ForwardRequest probe;
    probe.set_job_id(job);
    probe.set_sequence(-1);
    *probe.mutable_inputs() = Tokens();
    v1::ForwardResponse ignored;
    return worker->Forward(Context(10).get(), probe, &ignored);
  }

  // Waits up to ~10 s for every worker process to have dropped `job`.
  bool WaitUnloadedEverywhere(const std::string& job) {
    for (int attempt = 0; attempt < 200; ++attempt) {
      bool any = false;
      for (size_t i = 0; i < workers_.size() && !any; ++i) any = Holds(i, job);
      if (!any) return true;
      usleep(50 * 1000);
    }
    return false;
  }

  // `n` closed-loop clients sending the reference input to `job` (Infer), each answer checked
  // against the reference logits.
  std::unique_ptr<ClosedLoopClients> ReferenceClients(const std::string& job, int n) {
    return std::make_unique<ClosedLoopClients>(n, [this, job, expected = Expected()] {
      v1::InferRequest infer;
      infer.set_job_id(job);
      *infer.mutable_tokens() = Tokens();
      v1::InferResponse response;
      const grpc::Status status = stub_->Infer(Context(60).get(), infer, &response);
      return ClosedLoopClients::Outcome{
          status, response.outputs_size() == 1 && MaxDiff(response.outputs(0), expected) <= 1e-5f};
    });
  }

  // Infers the reference input on `job`; the largest difference from the reference logits.
  float InferDiff(const std::string& job) {
    v1::InferRequest infer;
    infer.set_job_id(job);
    *infer.mutable_tokens() = Tokens();
    v1::InferResponse response;
    grpc::Status status = stub_->Infer(Context().get(), infer, &response);
    EXPECT_TRUE(status.ok()) << status.error_message();
    if (!status.ok() || response.outputs_size() != 1) return 1e9f;
    return MaxDiff(response.outputs(0), Expected());
  }

  // Submits kModel (TP 2 x PP 2), waits for READY and checks one Infer answers: the start of the
  // tests that then try something against a serving job.
  void SubmitUntilServing(v1::Job* job) {
    *job = Submit(kModel);
    const v1::JobEvent ready = Watch(job->id());
    ASSERT_EQ(ready.job().state(), v1::READY) << ready.job().failure_cause();
    v1::InferRequest infer;
    infer.set_job_id(job->id());
    *infer.mutable_tokens() = Tokens();
    v1::InferResponse response;
    const grpc::Status status = stub_->Infer(Context().get(), infer, &response);
    ASSERT_TRUE(status.ok()) << status.error_message();
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

  inline static int counter_ = 0;
  std::string fault_dir_;  // empty unless UseFaultDir
};

}  // namespace bertshard::testing

#endif  // BERTSHARD_TESTS_CLUSTER_FIXTURE_H_
