// File: common/metrics_endpoint.h
// -----------------------------------------------------------------------------
// The HTTP side of common/metrics.h: serves `GET /metrics` with the registry rendered in the
// Prometheus text format 0.0.4 (Content-Type `text/plain; version=0.0.4; charset=utf-8`), 404 for
// any other path and 405 for any other method. Built on Debian's civetweb; it serves nothing else
// (no files, no CGI).
//
// Example:
//   MetricsRegistry registry;
//   ASSIGN_OR_RETURN(auto endpoint, MetricsEndpoint::Start("0.0.0.0:9090", &registry));
//   int port = endpoint->port();    // the bound port (useful with port 0)
//   ...
//   endpoint.reset();               // stops listening, waits for scrapes in flight
//
// Thread safety: thread-safe. The registry must outlive the endpoint.
#ifndef BERTSHARD_COMMON_METRICS_ENDPOINT_H_
#define BERTSHARD_COMMON_METRICS_ENDPOINT_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/metrics.h"

struct mg_connection;
struct mg_context;

namespace bertshard::common {

class MetricsEndpoint {
 public:
  // Listens on `address`, HOST:PORT with an IPv4 address or host name (port 0 picks a free port).
  // INVALID_ARGUMENT if the address is not HOST:PORT with a port in 0..65535; UNAVAILABLE if it
  // cannot be bound (in use, or not an address of this machine).
  static absl::StatusOr<std::unique_ptr<MetricsEndpoint>> Start(const std::string& address, MetricsRegistry* registry);

  // Stops listening and waits for requests in flight; up to ~2 s, as civetweb's accept loop only
  // looks for the stop every 2 s.
  ~MetricsEndpoint();
  MetricsEndpoint(const MetricsEndpoint&) = delete;
  MetricsEndpoint& operator=(const MetricsEndpoint&) = delete;

  int port() const { return port_; }

 private:
  explicit MetricsEndpoint(MetricsRegistry* registry) : registry_(registry) {}
  // civetweb's request handler; `endpoint` is this.
  static int HandleRequest(mg_connection* connection, void* endpoint);

  MetricsRegistry* const registry_;
  mg_context* context_ = nullptr;
  int port_ = 0;
};

}  // namespace bertshard::common

#endif  // BERTSHARD_COMMON_METRICS_ENDPOINT_H_
