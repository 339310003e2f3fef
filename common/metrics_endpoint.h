// File: common/metrics_endpoint.h
// -----------------------------------------------------------------------------
// The HTTP side of common/metrics.h: serves `GET /metrics` with the registry rendered in the
// Prometheus text format 0.0.4 (Content-Type `text/plain; version=0.0.4; charset=utf-8`), 404 for
// any other path and 405 for any other method. Built on Debian's civetweb; it serves nothing else
// (no files, no CGI).
//
// Access: with `bearer_tokens` given, a scrape must send `Authorization: Bearer <one of them>`
// (Prometheus' bearer_token_file) or gets 401: the series name jobs, which the RPCs show only to
// holders of the read token. Without, it is open.
//
// Connections: each is served by one of kThreads threads, with no keep-alive; a connection silent
// for kRequestTimeoutMs (a half-open socket, a client that sends half a request) is dropped then,
// so a few idle sockets cannot hold every thread and stall Prometheus' scrape.
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
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/metrics.h"

struct mg_connection;
struct mg_context;

namespace bertshard::common {

// HOST:PORT -> civetweb's listening_ports syntax, refusing what civetweb would read as something
// else: a list (`,`), SSL or redirect suffixes (`s`, `r`), a bare port (every interface).
// INVALID_ARGUMENT says "<what> address 'X' is not HOST:PORT ... (e.g. 0.0.0.0:<example_port>, ...)".
// Shared with the HTTP API's listener (http/http_server.h).
absl::StatusOr<std::string> CivetwebListeningPort(const std::string& address, absl::string_view what, int example_port);

class MetricsEndpoint {
 public:
  // Listens on `address`, HOST:PORT with an IPv4 address or host name (port 0 picks a free port).
  // INVALID_ARGUMENT if the address is not HOST:PORT with a port in 0..65535; UNAVAILABLE if it
  // cannot be bound (in use, or not an address of this machine).
  // `bearer_tokens`: the tokens a scrape may present (empty strings ignored); none: no token needed.
  static absl::StatusOr<std::unique_ptr<MetricsEndpoint>> Start(const std::string& address, MetricsRegistry* registry,
                                                                std::vector<std::string> bearer_tokens = {});

  static constexpr int kThreads = 16;
  static constexpr int kRequestTimeoutMs = 3000;

  // Stops listening and waits for requests in flight; up to ~2 s, as civetweb's accept loop only
  // looks for the stop every 2 s.
  ~MetricsEndpoint();
  MetricsEndpoint(const MetricsEndpoint&) = delete;
  MetricsEndpoint& operator=(const MetricsEndpoint&) = delete;

  int port() const { return port_; }

 private:
  MetricsEndpoint(MetricsRegistry* registry, std::vector<std::string> tokens)
      : registry_(registry), tokens_(std::move(tokens)) {}
  // Whether the request carries one of tokens_ (or none is needed).
  bool Authorized(mg_connection* connection) const;
  // civetweb's request handler; `endpoint` is this.
  static int HandleRequest(mg_connection* connection, void* endpoint);

  MetricsRegistry* const registry_;
  const std::vector<std::string> tokens_;
  mg_context* context_ = nullptr;
  int port_ = 0;
};

}  // namespace bertshard::common

#endif  // BERTSHARD_COMMON_METRICS_ENDPOINT_H_
