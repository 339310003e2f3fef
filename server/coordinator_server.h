// File: server/coordinator_server.h
// -----------------------------------------------------------------------------
// The coordinator's gRPC server: the Coordinator service (a thin layer over the planner and the
// Cluster), KServe v2's inference.GRPCInferenceService (server/kserve_service.h, over the same
// request path), the standard grpc.health.v1 health service and server reflection, so that
// grpcurl-style clients can list and describe everything.
//
// Example:
//   auto server = CoordinatorServer::Start({.listen_address = "127.0.0.1:0"});
//   if (!server.ok()) return server.status();
//   int port = (*server)->port();          // the bound port (useful with port 0)
//   ...
//   (*server)->Shutdown(absl::Seconds(10));  // NOT_SERVING, then drain in-flight calls
//
// Thread safety: thread-safe. Shutdown may be called from any thread, more than once.
#ifndef BERTSHARD_SERVER_COORDINATOR_SERVER_H_
#define BERTSHARD_SERVER_COORDINATOR_SERVER_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/grpc_auth.h"
#include "common/metrics.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "http/http_api.h"
#include "http/http_server.h"
#include "server/cluster.h"
#include "server/http_backend.h"
#include "server/kserve_service.h"

namespace bertshard::server {

struct CoordinatorOptions {
  // host:port; port 0 picks a free port.
  std::string listen_address = "0.0.0.0:50051";
  // Largest message sent (answers: hidden states of big batches, plans of big models) and, unless
  // max_request_bytes says less, received.
  int max_message_bytes = 256 << 20;
  // Largest request received; 0: DefaultMaxRequestBytes(cluster.batching). gRPC parses a request
  // whole before a handler sees it, and token ids take 8 bytes each once parsed, so a request the
  // serving limits would refuse must not be received: 96 MB of ids cost 844 MiB before this.
  int max_request_bytes = 0;
  // gRPC's memory quota for reading requests (common/grpc_serving.h ServerTransport): gRPC reads a
  // request whole before refusing it as too large, so this is what bounds a message of any size.
  // 0: 4 x the request limit, at least 64 MiB; negative: none.
  int64_t max_transport_memory_bytes = 0;
  // HTTP/2 keepalive (common/grpc_serving.h ServerTransport): a client that stops reading (a
  // stopped process) holds each of its calls' threads and answers until its connection closes; a
  // ping unanswered for keepalive_timeout closes it. Zero keepalive_time: no pings.
  absl::Duration keepalive_time = absl::Seconds(30);
  absl::Duration keepalive_timeout = absl::Seconds(20);
  ClusterOptions cluster;
  // Optional, not owned, must outlive the server: gets the per-call gRPC metrics and the
  // coordinator's own (bertshard_coordinator_jobs{state}, bertshard_coordinator_workers{health});
  // with an HTTP listener, served there too as GET /metrics (TEI's route).
  common::MetricsRegistry* metrics = nullptr;
  // Bearer tokens the RPCs need (common/grpc_auth.h); off by default. The admin token is also what
  // the coordinator presents to the workers (cluster.worker_token).
  common::AuthConfig auth;
  // TLS (common/grpc_tls.h); null: plaintext. The channels to the workers are cluster.worker_credentials.
  std::shared_ptr<grpc::ServerCredentials> server_credentials;
  // HTTP/JSON (TEI's routes, OpenAI's embeddings: docs/http.md), served when http.listen is set,
  // plain HTTP only (http/http_server.h says why). http_api's tokens are set from `auth`.
  http::HttpServerOptions http;
  http::HttpApiOptions http_api;
};

// The largest request every limit of `batching` admits: its texts (max_request_text_bytes), the
// framing of max_batch_tokens tokens (three int64 arrays of up to 10 bytes per token, and the texts'
// own framing), and 1 MiB for the rest (job id, options, the other RPCs). At the defaults 33.6
// MiB; at least 4 MiB. 0 (no bound beyond the message limit) when the text bytes are uncapped.
int DefaultMaxRequestBytes(const BatchLimits& batching);

class CoordinatorServer {
 public:
  // Builds and starts the server. UNAVAILABLE if the address cannot be bound;
  // INVALID_ARGUMENT if it is malformed or the job database is not one.
  static absl::StatusOr<std::unique_ptr<CoordinatorServer>> Start(const CoordinatorOptions& options);

  ~CoordinatorServer();
  CoordinatorServer(const CoordinatorServer&) = delete;
  CoordinatorServer& operator=(const CoordinatorServer&) = delete;

  int port() const { return port_; }
  // The HTTP port (0 when none is served).
  int http_port() const { return http_port_; }

  // Marks the health service NOT_SERVING (load balancers stop sending), then stops accepting
  // calls and waits up to `drain` for in-flight calls before cancelling them.
  void Shutdown(absl::Duration drain);

  // Blocks until the server has shut down.
  void Wait();

 private:
  class Service;
  CoordinatorServer(std::unique_ptr<Cluster> cluster, std::unique_ptr<Service> service,
                    std::unique_ptr<grpc::Server> server, int port);

  std::unique_ptr<Cluster> cluster_;
  std::unique_ptr<Service> service_;
  std::unique_ptr<KServeService> kserve_service_;  // registered on server_ beside service_
  std::unique_ptr<grpc::Server> server_;
  const int port_;
  // After cluster_, so that they go first; the server is stopped by Shutdown (its requests in
  // flight finish on the cluster), the api and backend with the object.
  std::unique_ptr<ClusterHttpBackend> http_backend_;  // the HTTP protocols' and KServe's gRPC
  std::unique_ptr<http::HttpApi> http_api_;
  std::unique_ptr<http::HttpServer> http_server_ ABSL_GUARDED_BY(mu_);
  int http_port_ = 0;
  absl::Mutex mu_;
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
  // Last, so they go first: their collectors read cluster_.
  std::vector<common::MetricsRegistry::CollectorHandle> collectors_;
};

}  // namespace bertshard::server

#endif  // BERTSHARD_SERVER_COORDINATOR_SERVER_H_
