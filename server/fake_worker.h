// File: server/fake_worker.h
// -----------------------------------------------------------------------------
// A fake worker daemon on loopback for the coordinator's tests, on a port of its own on 127.0.0.1:
// it answers ReservePort (port 4321), LoadShard (one READY progress message, then the status it was
// made with), Unload (kept, to be waited for) and Forward (as the test's function says, keeping the
// requests), and serves the standard gRPC health service (what a failure's blame pings). Test-only.
//
// Example:
//   FakeWorker loading(grpc::Status(grpc::StatusCode::INTERNAL, "the disk is on fire"));
//   request.set_address(loading.Address());
//   EXPECT_TRUE(loading.WaitForUnload("job-1"));
//
//   FakeWorker serving([](grpc::ServerContext*, const v1::ForwardRequest&, v1::ForwardResponse* r) {
//     r->add_outputs()->set_name("logits");
//     return grpc::Status::OK;
//   });
//   RankStub rank = serving.Rank("w0");
//
// Failure model: the server shuts down with the object (or at Shutdown); calls then fail
// UNAVAILABLE. A server that cannot start leaves Address() pointing nowhere, and the test's calls
// fail UNAVAILABLE.
//
// Thread safety: thread-safe; the Forward function runs on gRPC's threads.
#ifndef BERTSHARD_SERVER_FAKE_WORKER_H_
#define BERTSHARD_SERVER_FAKE_WORKER_H_

#include <algorithm>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bertshard/v1/worker.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "server/rank_fanout.h"

namespace bertshard::server {

class FakeWorker final : public v1::Worker::Service {
 public:
  using ForwardFn = std::function<grpc::Status(grpc::ServerContext*, const v1::ForwardRequest&, v1::ForwardResponse*)>;

  // A worker whose loads end with `load_status`; Forward answers UNIMPLEMENTED.
  explicit FakeWorker(grpc::Status load_status = grpc::Status::OK) : FakeWorker(std::move(load_status), nullptr) {}
  // A worker whose Forward calls `forward`; loads succeed.
  explicit FakeWorker(ForwardFn forward) : FakeWorker(grpc::Status::OK, std::move(forward)) {}
  ~FakeWorker() override { Shutdown(); }
  FakeWorker(const FakeWorker&) = delete;
  FakeWorker& operator=(const FakeWorker&) = delete;

  std::string Address() const { return address_; }
  // Its next loads end with `status`.
  void SetLoadStatus(grpc::Status status) {
    absl::MutexLock lock(&mu_);
    load_status_ = std::move(status);
  }
  // Stops keeping the load and unload requests it gets (Loads(), WaitForUnload): for tests that
  // measure the coordinator's memory over thousands of jobs in this process.
  void KeepNoRequests() {
    absl::MutexLock lock(&mu_);
    keep_ = false;
  }

  // Stops serving (calls in flight are cancelled): the worker is gone.
  void Shutdown() {
    if (server_ == nullptr) return;
    server_->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(1)));
    server_->Wait();
    server_.reset();
  }

  // A rank served by this worker, over a channel of its own.
  RankStub Rank(const std::string& worker_id) const {
    auto channel = grpc::CreateChannel(address_, grpc::InsecureChannelCredentials());
    return {worker_id, address_, v1::Worker::NewStub(channel), "", grpc::health::v1::Health::NewStub(channel)};
  }

  grpc::Status ReservePort(grpc::ServerContext*, const v1::ReservePortRequest* request,
                           v1::ReservePortResponse* port) override {
    {
      absl::MutexLock lock(&mu_);
      reservations_.push_back(*request);
    }
    port->set_port(4321);
    return grpc::Status::OK;
  }
  grpc::Status LoadShard(grpc::ServerContext*, const v1::LoadShardRequest* request,
                         grpc::ServerWriter<v1::LoadProgress>* writer) override {
    {
      absl::MutexLock lock(&mu_);
      if (keep_) loads_.push_back(*request);
      if (keep_) events_.push_back("load");
    }
    v1::LoadProgress progress;
    progress.set_phase(v1::LoadProgress::READY);
    writer->Write(progress);
    absl::MutexLock lock(&mu_);
    return load_status_;
  }
  grpc::Status Unload(grpc::ServerContext*, const v1::UnloadRequest* request, v1::UnloadResponse*) override {
    absl::MutexLock lock(&mu_);
    if (keep_) unloaded_.push_back(request->job_id());
    if (keep_) events_.push_back("unload");
    return grpc::Status::OK;
  }
  grpc::Status Forward(grpc::ServerContext* context, const v1::ForwardRequest* request,
                       v1::ForwardResponse* response) override {
    {
      absl::MutexLock lock(&mu_);
      requests_.push_back(*request);
    }
    if (!forward_) return grpc::Status(grpc::StatusCode::UNIMPLEMENTED, "this fake worker serves no Forward");
    return forward_(context, *request, response);
  }

  std::vector<v1::LoadShardRequest> Loads() const {
    absl::MutexLock lock(&mu_);
    return loads_;
  }
  // The ReservePort requests received, in order.
  std::vector<v1::ReservePortRequest> Reservations() const {
    absl::MutexLock lock(&mu_);
    return reservations_;
  }
  // The Forward requests received, in order.
  std::vector<v1::ForwardRequest> requests() const {
    absl::MutexLock lock(&mu_);
    return requests_;
  }
  // "load" and "unload", one per LoadShard and Unload call received, in order.
  std::vector<std::string> Events() const {
    absl::MutexLock lock(&mu_);
    return events_;
  }
  // The Unload calls received.
  int Unloads() const {
    absl::MutexLock lock(&mu_);
    return static_cast<int>(unloaded_.size());
  }
  // Waits (up to 30 s) until job `job_id` was unloaded here `times` times or more.
  bool WaitForUnload(const std::string& job_id, int times = 1) {
    absl::MutexLock lock(&mu_);
    const auto unloaded = [&] {
      mu_.AssertHeld();
      return std::count(unloaded_.begin(), unloaded_.end(), job_id) >= times;
    };
    return mu_.AwaitWithTimeout(absl::Condition(&unloaded), absl::Seconds(30));
  }

 private:
  FakeWorker(grpc::Status load_status, ForwardFn forward)
      : load_status_(std::move(load_status)), forward_(std::move(forward)) {
    grpc::EnableDefaultHealthCheckService(true);
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(this);
    server_ = builder.BuildAndStart();
    address_ = absl::StrCat("127.0.0.1:", port_);
  }

  grpc::Status load_status_ ABSL_GUARDED_BY(mu_);
  const ForwardFn forward_;
  int port_ = 0;
  std::string address_;
  std::unique_ptr<grpc::Server> server_;
  mutable absl::Mutex mu_;
  bool keep_ ABSL_GUARDED_BY(mu_) = true;
  std::vector<v1::LoadShardRequest> loads_ ABSL_GUARDED_BY(mu_);
  std::vector<v1::ReservePortRequest> reservations_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> events_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> unloaded_ ABSL_GUARDED_BY(mu_);
  std::vector<v1::ForwardRequest> requests_ ABSL_GUARDED_BY(mu_);
};

}  // namespace bertshard::server

#endif  // BERTSHARD_SERVER_FAKE_WORKER_H_
