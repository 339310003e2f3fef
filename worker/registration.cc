#include "worker/registration.h"

#include <unistd.h>

#include <cstdio>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "bertshard/v1/coordinator.grpc.pb.h"
#include "common/grpc_auth.h"
#include "grpcpp/grpcpp.h"

namespace bertshard::worker {
namespace {

int64_t FreeMemoryBytes() {
  return static_cast<int64_t>(sysconf(_SC_AVPHYS_PAGES)) * static_cast<int64_t>(sysconf(_SC_PAGESIZE));
}

// After a failed call: retry soon, so that a restarted coordinator gets its workers (and their
// jobs) back within a fraction of a second of starting.
constexpr absl::Duration kRetry = absl::Milliseconds(200);
// Heartbeats failing this many times in a row: register again.
constexpr int kFailedHeartbeatsBeforeRegistering = 5;

}  // namespace

absl::StatusOr<std::string> AdvertisedHost(const std::string& advertise) {
  if (advertise.empty()) return std::string();
  const size_t colon = advertise.rfind(':');
  std::string host = colon == std::string::npos ? "" : advertise.substr(0, colon);
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  int port = 0;
  const bool parsed = colon != std::string::npos && absl::SimpleAtoi(advertise.substr(colon + 1), &port);
  if (host.empty() || !parsed || host.find_first_of("[]") != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("--advertise '", advertise, "' is not HOST:PORT"));
  }
  if (port < 1 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--advertise '", advertise,
        "': the port must be 1 to 65535, the one the coordinator reaches this worker on "
        "(a port the system picks is not known before the worker listens; leave --advertise out to advertise "
        "127.0.0.1 and the port served)"));
  }
  return host;
}

Registration::Registration(RegistrationOptions options) : options_(std::move(options)), thread_([this] { Run(); }) {}

Registration::~Registration() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

std::vector<v1::HeldShard> Registration::Held() const {
  return options_.held_shards ? options_.held_shards() : std::vector<v1::HeldShard>();
}

void Registration::Unload(const google::protobuf::RepeatedPtrField<std::string>& job_ids) const {
  if (!options_.unload) return;
  for (const std::string& job : job_ids) {
    std::fprintf(stderr, "shard-worker: unloading job %s: the coordinator does not keep it here\n", job.c_str());
    options_.unload(job);
  }
}

void Registration::Run() {
  // Reconnect quickly after the coordinator restarts (gRPC's default backoff grows to 2 minutes).
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 200);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  auto stub = v1::Coordinator::NewStub(grpc::CreateCustomChannel(
      options_.coordinator, options_.credentials != nullptr ? options_.credentials : grpc::InsecureChannelCredentials(),
      args));
  std::string worker_id;
  absl::Duration interval = absl::Seconds(1);
  int failed_heartbeats = 0;
  int failed_registrations = 0;
  auto stopped_after = [&](absl::Duration wait) {
    absl::MutexLock lock(&mu_);
    return mu_.AwaitWithTimeout(absl::Condition(&stop_), wait);
  };
  // Beats on a fixed schedule (start to start), not an interval after each call returns: a slow
  // call or a brief stall must not stretch the silence the coordinator sees. `next`: when the next
  // call is due.
  absl::Time next = absl::Now();
  while (true) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + std::max(interval, absl::Seconds(1))));
    common::AttachToken(&context, options_.token);
    bool ok = false;
    if (worker_id.empty()) {
      v1::RegisterWorkerRequest request;
      request.set_address(options_.advertise);
      request.set_device(options_.device);
      request.set_gpu_bus_id(options_.gpu_bus_id);
      request.set_free_memory_bytes(FreeMemoryBytes());
      for (v1::HeldShard& h : Held()) *request.add_held() = std::move(h);
      v1::RegisterWorkerResponse response;
      grpc::Status status = stub->RegisterWorker(&context, request, &response);
      ok = status.ok();
      // Said once a streak: a coordinator that refuses us (a device it cannot read, a wrong token)
      // or is not up yet, retried meanwhile.
      failed_registrations = ok ? 0 : failed_registrations + 1;
      if (failed_registrations == 1) {
        std::fprintf(stderr, "shard-worker: registering with %s failed (%d): %s\n", options_.coordinator.c_str(),
                     static_cast<int>(status.error_code()), status.error_message().c_str());
      }
      if (ok) {
        worker_id = response.worker_id();
        interval = absl::Milliseconds(std::max(50, response.heartbeat_interval_ms()));
        std::fprintf(stderr, "shard-worker: registered with %s as %s (holding %d shards)\n",
                     options_.coordinator.c_str(), worker_id.c_str(), request.held_size());
        Unload(response.unload_job_ids());
      }
    } else {
      v1::HeartbeatRequest request;
      request.set_worker_id(worker_id);
      request.set_free_memory_bytes(FreeMemoryBytes());
      for (v1::HeldShard& h : Held()) *request.add_held() = std::move(h);
      v1::HeartbeatResponse response;
      grpc::Status status = stub->Heartbeat(&context, request, &response);
      ok = status.ok();
      failed_heartbeats = ok ? 0 : failed_heartbeats + 1;
      if (ok) Unload(response.unload_job_ids());
      if (!ok && failed_heartbeats == 1) {
        std::fprintf(stderr, "shard-worker: heartbeat to %s failed (%d): %s\n", options_.coordinator.c_str(),
                     static_cast<int>(status.error_code()), status.error_message().c_str());
      }
      // NOT_FOUND: the coordinator restarted. Long silence: it may have restarted, or declared us
      // dead; registering again tells it what we hold either way.
      if (status.error_code() == grpc::StatusCode::NOT_FOUND ||
          failed_heartbeats >= kFailedHeartbeatsBeforeRegistering) {
        worker_id.clear();
        failed_heartbeats = 0;
        ok = false;
      }
    }
    const absl::Time now = absl::Now();
    if (ok) {
      next += interval;
      if (next < now) next = now;  // behind (a stall, a slow call): at once, the schedule from now
    } else {
      // Retries run from now: failed calls must not push the schedule ahead of time (after the
      // coordinator came back, the first beat would then wait for all the skipped intervals).
      next = now + std::min(interval, kRetry);
    }
    if (stopped_after(next - now)) {
      // Shutting down: say so, so that the coordinator places no job here meanwhile. Best effort.
      if (!worker_id.empty()) {
        grpc::ClientContext leave;
        leave.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(1)));
        common::AttachToken(&leave, options_.token);
        v1::HeartbeatRequest request;
        request.set_worker_id(worker_id);
        request.set_leaving(true);
        v1::HeartbeatResponse ignored;
        stub->Heartbeat(&leave, request, &ignored);
      }
      return;
    }
  }
}

}  // namespace bertshard::worker
