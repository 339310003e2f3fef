#include "worker/registration.h"

#include <unistd.h>

#include <cstdio>
#include <utility>

#include "absl/time/time.h"
#include "bertshard/v1/coordinator.grpc.pb.h"
#include "grpcpp/grpcpp.h"

namespace bertshard::worker {
namespace {

int64_t FreeMemoryBytes() {
  return static_cast<int64_t>(sysconf(_SC_AVPHYS_PAGES)) * static_cast<int64_t>(sysconf(_SC_PAGESIZE));
}

}  // namespace

Registration::Registration(std::string coordinator, std::string advertise)
    : coordinator_(std::move(coordinator)), advertise_(std::move(advertise)), thread_([this] { Run(); }) {}

Registration::~Registration() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

void Registration::Run() {
  // Reconnect quickly after the coordinator restarts (gRPC's default backoff grows to 2 minutes).
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 200);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  auto stub = v1::Coordinator::NewStub(grpc::CreateCustomChannel(coordinator_, grpc::InsecureChannelCredentials(), args));
  std::string worker_id;
  absl::Duration interval = absl::Seconds(1);
  int failed_heartbeats = 0;
  auto stopped_after = [&](absl::Duration wait) {
    absl::MutexLock lock(&mu_);
    return mu_.AwaitWithTimeout(absl::Condition(&stop_), wait);
  };
  while (true) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + std::max(interval, absl::Seconds(1))));
    if (worker_id.empty()) {
      v1::RegisterWorkerRequest request;
      request.set_address(advertise_);
      request.set_device("cpu");
      request.set_free_memory_bytes(FreeMemoryBytes());
      v1::RegisterWorkerResponse response;
      grpc::Status status = stub->RegisterWorker(&context, request, &response);
      if (status.ok()) {
        worker_id = response.worker_id();
        interval = absl::Milliseconds(std::max(50, response.heartbeat_interval_ms()));
        std::fprintf(stderr, "shard-worker: registered with %s as %s\n", coordinator_.c_str(), worker_id.c_str());
      }
    } else {
      v1::HeartbeatRequest request;
      request.set_worker_id(worker_id);
      request.set_free_memory_bytes(FreeMemoryBytes());
      v1::HeartbeatResponse response;
      grpc::Status status = stub->Heartbeat(&context, request, &response);
      failed_heartbeats = status.ok() ? 0 : failed_heartbeats + 1;
      if (!status.ok() && failed_heartbeats == 1) {
        std::fprintf(stderr, "shard-worker: heartbeat to %s failed (%d): %s\n", coordinator_.c_str(),
                     static_cast<int>(status.error_code()), status.error_message().c_str());
      }
      // NOT_FOUND: the coordinator restarted. Long silence: it has declared us dead anyway.
      if (status.error_code() == grpc::StatusCode::NOT_FOUND || failed_heartbeats >= 5) {
        worker_id.clear();
        failed_heartbeats = 0;
      }
    }
    if (stopped_after(worker_id.empty() ? absl::Milliseconds(200) : interval)) return;
  }
}

}  // namespace bertshard::worker
