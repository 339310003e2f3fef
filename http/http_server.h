// File: http/http_server.h
// -----------------------------------------------------------------------------
// The coordinator's HTTP/1.1 listener (--http_listen), on Debian's civetweb as /metrics is
// (common/metrics_endpoint.h): one handler for every request, which answers in its protocol's
// shapes (http/http_api.h routes TEI's and OpenAI's). Nothing else is served: no files, no CGI.
// This layer knows sockets and bodies; it knows nothing of jobs, tokens or JSON.
//
// Plain HTTP only: HTTPS is absent. Debian 12's civetweb 1.15 loads OpenSSL by name at run time
// (the unversioned libssl.so, which only libssl-dev installs) with OpenSSL 1.1's API, and on every
// TLS connection calls SSL_get_peer_certificate, which OpenSSL 3 has only as a macro: a null call.
// Working around that takes a dlsym interposer or a shim library named libssl.so, either of which
// reaches well past this listener; a civetweb built here for OpenSSL 3 is the way to add HTTPS.
// Until then TLS is terminated in front of the port (an Ingress, a proxy), and the coordinator
// refuses --http_listen beside the gRPC port's TLS files rather than serve tokens in the clear.
//
// Bodies: at most `max_body_bytes` are read. A larger one (declared by Content-Length, or found
// while reading a chunked one) is not read further: the handler gets body_too_large set, answers
// 413 in its own words, and the connection is closed after the answer. A body cut short (the
// connection failed, or ended before the declared length) is answered 400 without the handler. A
// client silent for request_timeout_ms mid-request, or keep_alive_timeout_ms between requests, is
// dropped then, so idle sockets cannot hold every thread for long.
//
// Example:
//   ASSIGN_OR_RETURN(auto server, HttpServer::Start({.listen = "127.0.0.1:0"}, [](const HttpRequest& r) {
//     return HttpResponse{200, "text/plain", "hello " + r.path};
//   }));
//   int port = server->port();
//   server.reset();  // stops accepting, waits for the requests in flight
//
// Thread safety: thread-safe; the handler is called on up to `threads` threads at once.
#ifndef BERTSHARD_HTTP_HTTP_SERVER_H_
#define BERTSHARD_HTTP_HTTP_SERVER_H_

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "http/http_message.h"

struct mg_connection;
struct mg_context;

namespace bertshard::http {

struct HttpServerOptions {
  // HOST:PORT with an IPv4 address or host name; port 0 picks a free port.
  std::string listen;
  int64_t max_body_bytes = 2000000;  // TEI's --payload-limit default
  int threads = 64;
  int request_timeout_ms = 30000;
  // How long a kept-alive connection may wait for its next request (it holds a thread meanwhile).
  int keep_alive_timeout_ms = 5000;
};

class HttpServer {
 public:
  // INVALID_ARGUMENT for an address that is not HOST:PORT or limits below 1; UNAVAILABLE when the
  // address cannot be bound.
  static absl::StatusOr<std::unique_ptr<HttpServer>> Start(const HttpServerOptions& options, HttpHandler handler);

  // Stops listening and waits for the requests in flight (civetweb looks for the stop every ~2 s).
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  int port() const { return port_; }

 private:
  HttpServer(HttpServerOptions options, HttpHandler handler)
      : options_(std::move(options)), handler_(std::move(handler)) {}
  static int HandleRequest(mg_connection* connection, void* server);

  const HttpServerOptions options_;
  const HttpHandler handler_;
  mg_context* context_ = nullptr;
  int port_ = 0;
};

}  // namespace bertshard::http

#endif  // BERTSHARD_HTTP_HTTP_SERVER_H_
