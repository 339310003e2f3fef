// File: common/grpc_serving.h
// -----------------------------------------------------------------------------
// What every bertshard server does the same way: listen on host:port (port 0 picks one, and the
// port is never shared with another process), serve the standard grpc.health.v1 health service
// and server reflection, and on SIGTERM/SIGINT go NOT_SERVING and drain in-flight calls for a
// deadline before exiting. Given a metrics registry, every call of every service on the server
// (health and reflection included) is counted by method and status code and timed:
//   bertshard_grpc_requests_total{method,code}            counter
//   bertshard_grpc_request_duration_seconds{method}       histogram, seconds
// `method` is gRPC's full name ("/bertshard.v1.Coordinator/Plan"; "unknown" for a method of no proto
// linked into the binary), `code` the status code's name ("OK", "INVALID_ARGUMENT"). A call is
// recorded just before its status is sent, so a client that has its answer finds it counted.
//
// Example:
//   InstallShutdownHandlers();              // early in main
//   ASSIGN_OR_RETURN(auto server, StartServer("0.0.0.0:50051", {&service}));
//   WaitForShutdownSignal("my-server");     // returns on SIGTERM/SIGINT
//   DrainAndShutdown(server.server.get(), absl::Seconds(10));
//
// Thread safety: StartServer is thread-safe; the signal helpers are for main().
#ifndef BERTSHARD_COMMON_GRPC_SERVING_H_
#define BERTSHARD_COMMON_GRPC_SERVING_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"

namespace bertshard::common {

class MetricsRegistry;

struct StartedServer {
  std::unique_ptr<grpc::Server> server;
  int port = 0;
};

// How a server treats its connections beyond the message limit.
struct ServerTransport {
  // The largest message received, when smaller than the send limit (0: the same). gRPC parses a
  // message whole before any handler can look at it, and a packed repeated int64 takes 8 bytes
  // per element however few it had on the wire: a server whose requests are small should not
  // receive what it may send.
  int max_receive_bytes = 0;
  // gRPC's memory quota for the server's transports (grpc::ResourceQuota; 0: none). gRPC reads a
  // message whole before it checks it against max_receive_bytes, so without a quota a message of
  // any size (up to 4 GiB) is held before it is refused; with one, once the connections' read
  // buffers reach it, a stream is reset (RESOURCE_EXHAUSTED, "RST_STREAM with error code 11") and
  // its bytes dropped. The stream gRPC picks may be another connection's than the largest
  // sender's: the quota trades an out-of-memory kill for a reset call. Make it several times
  // max_receive_bytes: concurrent requests share it.
  int64_t max_transport_memory_bytes = 0;
  // HTTP/2 keepalive: every `keepalive_time` the server pings each connection with calls in flight
  // (gRPC's default: none without calls), and closes one whose ping is not answered within
  // `keepalive_timeout` (a client process stopped or gone without a FIN), ending its calls. Zero:
  // no pings. Durations are clamped to [1 ms, INT_MAX ms].
  absl::Duration keepalive_time = absl::ZeroDuration();
  absl::Duration keepalive_timeout = absl::Seconds(20);
};

// INVALID_ARGUMENT for an address that is not host:port; UNAVAILABLE when it cannot be bound.
// `metrics` (optional, must outlive the server): where the per-call metrics above are recorded;
// its errors (INVALID_ARGUMENT, ALREADY_EXISTS) if they cannot be registered there.
absl::StatusOr<StartedServer> StartServer(const std::string& address, const std::vector<grpc::Service*>& services,
                                          int max_message_bytes = 64 << 20, MetricsRegistry* metrics = nullptr,
                                          std::shared_ptr<grpc::ServerCredentials> credentials = nullptr,
                                          const ServerTransport& transport = {});

// Health NOT_SERVING, then stop accepting calls and give in-flight ones `drain` to finish.
void DrainAndShutdown(grpc::Server* server, absl::Duration drain);

// Catches SIGTERM and SIGINT from now on, in whatever thread they arrive (libraries such as
// LibTorch start threads before main, so blocking the signals in main would not be enough).
void InstallShutdownHandlers();

// Waits for SIGTERM/SIGINT (caught by InstallShutdownHandlers) and says so on stderr.
void WaitForShutdownSignal(const char* program);

}  // namespace bertshard::common

#endif  // BERTSHARD_COMMON_GRPC_SERVING_H_
