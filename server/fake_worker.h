// File: server/fake_worker.h
// -----------------------------------------------------------------------------
// A fake worker daemon on loopback for the coordinator's tests: it answers ReservePort (port
// 4321), LoadShard (one READY progress message, then the status it was made with) and Unload (kept,
// to be waited for), and serves the standard gRPC health service (what a failure's blame pings).
// Test-only.
//
// Example:
//   FakeWorker worker(grpc::Status(grpc::StatusCode::INTERNAL, "the disk is on fire"));
//   request.set_address(worker.Address());
//   EXPECT_TRUE(worker.WaitForUnload("job-1"));
//
// Failure model: the server shuts down with the object; calls then fail UNAVAILABLE.
// Thread safety: thread-safe.
#ifndef BERTSHARD_SERVER_FAKE_WORKER_H_
#define BERTSHARD_SERVER_FAKE_WORKER_H_

#include <algorithm>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "bertshard/v1/worker.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"

namespace bertshard::server {

class FakeWorker final : public v1::Worker::Service {
 public:
  explicit FakeWorker(grpc::Status load_status = grpc::Status::OK) : load_status_(std::move(load_status)) {
    grpc::EnableDefaultHealthCheckService(true);
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(this);
    server_ = builder.BuildAndStart();
  }
  ~FakeWorker() override { server_->Shutdown(); }

  std::string Address() const { return "127.0.0.1:" + std::to_string(port_); }

  grpc::Status ReservePort(grpc::ServerContext*, const v1::ReservePortRequest*,
                           v1::ReservePortResponse* port) override {
    port->set_port(4321);
    return grpc::Status::OK;
  }
  grpc::Status LoadShard(grpc::ServerContext*, const v1::LoadShardRequest* request,
                         grpc::ServerWriter<v1::LoadProgress>* writer) override {
    {
      absl::MutexLock lock(&mu_);
      loads_.push_back(*request);
    }
    v1::LoadProgress progress;
    progress.set_phase(v1::LoadProgress::READY);
    writer->Write(progress);
    return load_status_;
  }
  grpc::Status Unload(grpc::ServerContext*, const v1::UnloadRequest* request, v1::UnloadResponse*) override {
    absl::MutexLock lock(&mu_);
    unloaded_.push_back(request->job_id());
    return grpc::Status::OK;
  }

  std::vector<v1::LoadShardRequest> Loads() {
    absl::MutexLock lock(&mu_);
    return loads_;
  }
  // Waits (up to 30 s) until job `job_id` was unloaded here.
  bool WaitForUnload(const std::string& job_id) {
    absl::MutexLock lock(&mu_);
    const auto unloaded = [&] {
      mu_.AssertHeld();
      return std::find(unloaded_.begin(), unloaded_.end(), job_id) != unloaded_.end();
    };
    return mu_.AwaitWithTimeout(absl::Condition(&unloaded), absl::Seconds(30));
  }

 private:
  const grpc::Status load_status_;
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
  absl::Mutex mu_;
  std::vector<v1::LoadShardRequest> loads_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> unloaded_ ABSL_GUARDED_BY(mu_);
};

}  // namespace bertshard::server

#endif  // BERTSHARD_SERVER_FAKE_WORKER_H_
