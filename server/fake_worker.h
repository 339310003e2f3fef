// File: server/fake_worker.h
// -----------------------------------------------------------------------------
// An in-process Worker gRPC service for the serving tests (rank_fanout_test, job_serving_test):
// it answers Forward as the test says, keeps the requests it got, and serves the standard health
// check, on a port of its own on 127.0.0.1.
//
// Example:
//   FakeWorker worker([](grpc::ServerContext*, const v1::ForwardRequest&, v1::ForwardResponse* r) {
//     r->add_outputs()->set_name("logits");
//     return grpc::Status::OK;
//   });
//   RankStub rank = worker.Rank("w0");
//
// Failure model: test-only; a server that cannot start leaves Rank() pointing nowhere, and the
// test's calls fail with UNAVAILABLE.
//
// Thread safety: thread-safe; the handler runs on gRPC's threads.
#ifndef BERTSHARD_SERVER_FAKE_WORKER_H_
#define BERTSHARD_SERVER_FAKE_WORKER_H_

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "bertshard/v1/worker.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "server/rank_fanout.h"

namespace bertshard::server {

class FakeWorker : public v1::Worker::Service {
 public:
  using ForwardFn = std::function<grpc::Status(grpc::ServerContext*, const v1::ForwardRequest&, v1::ForwardResponse*)>;

  explicit FakeWorker(ForwardFn forward) : forward_(std::move(forward)) {
    grpc::EnableDefaultHealthCheckService(true);
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(this);
    server_ = builder.BuildAndStart();
    address_ = absl::StrCat("127.0.0.1:", port_);
  }
  ~FakeWorker() override { Shutdown(); }
  FakeWorker(const FakeWorker&) = delete;
  FakeWorker& operator=(const FakeWorker&) = delete;

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

  std::vector<v1::ForwardRequest> requests() const {
    absl::MutexLock lock(&mu_);
    return requests_;
  }

  grpc::Status Forward(grpc::ServerContext* context, const v1::ForwardRequest* request,
                       v1::ForwardResponse* response) override {
    {
      absl::MutexLock lock(&mu_);
      requests_.push_back(*request);
    }
    return forward_(context, *request, response);
  }

 private:
  const ForwardFn forward_;
  int port_ = 0;
  std::string address_;
  std::unique_ptr<grpc::Server> server_;
  mutable absl::Mutex mu_;
  std::vector<v1::ForwardRequest> requests_ ABSL_GUARDED_BY(mu_);
};

}  // namespace bertshard::server

#endif  // BERTSHARD_SERVER_FAKE_WORKER_H_
