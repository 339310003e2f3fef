// File: tests/behaviour_cluster.h
// -----------------------------------------------------------------------------
// The fixture of the coordinator-behaviour tests (cluster_pool_test, cluster_cancel_test,
// cluster_service_test): tests/cluster_fixture.h's Cluster (a coordinator and four shard-worker
// processes on loopback, fresh per test) whose workers get a fault directory, so that a test holds
// a phase with the workers' pause points (common/fault_point.h): it creates <point>.hold there and
// waits for the workers' <point>.<pid>.reached markers. No sleep stands in for synchronisation:
// every wait polls for a condition with a bound (PollFor).
//
// Example:
//   TEST_F(BehaviourCluster, Something) {
//     Hold("worker_load");
//     const v1::Job job = Submit(kModel);
//     ASSERT_FALSE(WaitReached("worker_load", 4).empty());
//   }
//
// Failure model: helpers report RPC errors as test failures; TearDown continues every worker a
// test stopped and releases every pause point, whatever happened.
//
// Thread safety: as Cluster's.
#ifndef BERTSHARD_TESTS_BEHAVIOUR_CLUSTER_H_
#define BERTSHARD_TESTS_BEHAVIOUR_CLUSTER_H_

#include <signal.h>

#include <chrono>
#include <filesystem>
#include <functional>
#include <set>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "bertshard/v1/coordinator.grpc.pb.h"
#include "checkpoint/safetensors.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/cluster_fixture.h"

namespace bertshard::testing {

inline constexpr char kMultipleChoice[] = "tests/testdata/model/multiple_choice";

inline constexpr char kBertModel[] = "tests/testdata/model/bert_model";

inline int64_t NowMillis() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// Polls `condition` every 50 ms for up to `seconds`; whether it came true.
inline bool PollFor(double seconds, const std::function<bool()>& condition) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(static_cast<int>(seconds * 1000));
  while (true) {
    if (condition()) return true;
    if (std::chrono::steady_clock::now() >= end) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

// The float32 tensor `name` of a safetensors file, with its shape; empty when missing.
inline std::pair<std::vector<int64_t>, std::vector<float>> ReadTensor(const std::string& path,
                                                                      const std::string& name) {
  auto file = checkpoint::SafetensorsFile::Open(path);
  if (!file.ok()) return {};
  const checkpoint::TensorInfo* info = (*file)->Find(name);
  if (info == nullptr) return {};
  std::vector<float> values(static_cast<size_t>(info->numel()));
  if (!(*file)->ReadSlice(*info, {}, values.data()).ok()) return {};
  return {std::vector<int64_t>(info->shape.begin(), info->shape.end()), values};
}

inline std::vector<v1::JobState> States(const v1::Job& job) {
  std::vector<v1::JobState> states;
  for (const auto& change : job.history()) states.push_back(change.state());
  return states;
}

// A DEADLINE_EXCEEDED seen by the caller comes from its own gRPC library ("Deadline Exceeded") or,
// when the server answered first, from the coordinator with the reason.
inline bool DeadlineMessage(const grpc::Status& s, const std::string& server_reason) {
  return s.error_message() == "Deadline Exceeded" || s.error_message().find(server_reason) != std::string::npos;
}

// Likewise CANCELLED after the caller's TryCancel: its own library's message, or the server's reason.
inline bool CancelledMessage(const grpc::Status& s, const std::string& server_reason) {
  return s.error_message() == "Cancelled" || s.error_message() == "CANCELLED" ||
         s.error_message().find(server_reason) != std::string::npos;
}

class BehaviourCluster : public Cluster {
 protected:
  // The workers SetUp spawns get a fault directory (the fixture's Hold / Release / WaitReached).
  BehaviourCluster() { UseFaultDir("behaviour-" + std::to_string(++instances_)); }

  void TearDown() override {
    for (pid_t p : stopped_) kill(p, SIGCONT);
    Cluster::TearDown();  // releases every pause point first
  }

  // The pause points' markers say which process got there; they are kept (one per process and
  // point) until cleared, so a point is cleared before it is held a second time.
  void ClearReached(const std::string& point) {
    std::error_code ignored;
    for (const auto& entry : std::filesystem::directory_iterator(fault_dir_, ignored)) {
      const std::string name = entry.path().filename().string();
      if (name.rfind(point + ".", 0) == 0 && name.find(".reached") != std::string::npos) {
        std::filesystem::remove(entry.path(), ignored);
      }
    }
  }

  grpc::Status Cancel(const std::string& id, v1::Job* job) {
    v1::GetJobRequest cancel;
    cancel.set_job_id(id);
    return stub_->CancelJob(Context().get(), cancel, job);
  }

  v1::ListWorkersResponse Workers() {
    v1::ListWorkersResponse workers;
    const grpc::Status s = stub_->ListWorkers(Context().get(), v1::ListWorkersRequest(), &workers);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return workers;
  }

  // The listed workers by value (a range-for over Workers().workers() would outlive the response).
  std::vector<v1::WorkerInfo> ListedWorkers() {
    const v1::ListWorkersResponse workers = Workers();
    return {workers.workers().begin(), workers.workers().end()};
  }

  // Every worker process is listed exactly once: as many entries as processes, one per address
  // and per id.
  void ExpectListedOnce(const v1::ListWorkersResponse& workers) {
    std::set<std::string> addresses, ids;
    for (const auto& w : workers.workers()) {
      EXPECT_TRUE(addresses.insert(w.address()).second) << "address listed twice: " << workers.DebugString();
      EXPECT_TRUE(ids.insert(w.worker_id()).second) << "id listed twice: " << workers.DebugString();
    }
    EXPECT_EQ(workers.workers_size(), static_cast<int>(workers_.size())) << workers.DebugString();
  }

  // Infers the reference input on `job`; the status, and the output in `response`.
  grpc::Status InferReference(const std::string& job, v1::InferResponse* response, grpc::ClientContext* context) {
    v1::InferRequest infer;
    infer.set_job_id(job);
    *infer.mutable_tokens() = Tokens();
    return stub_->Infer(context, infer, response);
  }

  static int Count(const std::string& text, const std::string& what) {
    int n = 0;
    for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
    return n;
  }

  std::vector<pid_t> stopped_;  // SIGSTOPped by a test: continued in TearDown whatever happened
  inline static int instances_ = 0;
};

}  // namespace bertshard::testing

#endif  // BERTSHARD_TESTS_BEHAVIOUR_CLUSTER_H_
