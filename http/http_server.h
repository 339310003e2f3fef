// File: http/http_server.h
// -----------------------------------------------------------------------------
// The coordinator's HTTP/1.1 listener (--http_listen), on Debian's civetweb as /metrics is
// (common/metrics_endpoint.h): one handler for every request, which answers in its protocol's
// shapes (http/http_api.h routes TEI's and OpenAI's). Nothing else is served: no files, no CGI.
// This layer knows sockets, TLS and bodies; it knows nothing of jobs, tokens or JSON.
//
// TLS: with HttpTls cert + key the port serves HTTPS only (the same PEM files as gRPC's --tls_cert,
// --tls_key); with ca as well, clients must present a certificate ca signed (mutual TLS, as the
// gRPC port asks), and a verified one's common name is the request's client. Loaded by OpenSSL
// here, through civetweb's init_ssl hook: the key is never copied to another file.
//
// Bodies: at most `max_body_bytes` are read. A larger one (declared by Content-Length, or found
// while reading a chunked one) is not read further: the handler gets body_too_large set, answers
// 413 in its own words, and the connection is closed after the answer. A client silent for
// request_timeout_ms mid-request is dropped then, so idle sockets cannot hold every thread.
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

struct HttpTls {
  std::string cert;  // PEM chain; with key: HTTPS
  std::string key;
  std::string ca;  // with cert + key: clients must present a certificate it signed
  bool enabled() const { return !cert.empty() || !key.empty() || !ca.empty(); }
};

struct HttpServerOptions {
  // HOST:PORT with an IPv4 address or host name; port 0 picks a free port.
  std::string listen;
  HttpTls tls;
  int64_t max_body_bytes = 2000000;  // TEI's --payload-limit default
  int threads = 64;
  int request_timeout_ms = 30000;
};

class HttpServer {
 public:
  // INVALID_ARGUMENT for an address that is not HOST:PORT or TLS files that cannot be used (cert
  // without key, a ca without them, unreadable or not PEM, a key that is not the cert's);
  // UNAVAILABLE when the address cannot be bound.
  static absl::StatusOr<std::unique_ptr<HttpServer>> Start(const HttpServerOptions& options, HttpHandler handler);

  // Stops listening and waits for the requests in flight (civetweb looks for the stop every ~2 s).
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  int port() const { return port_; }
  bool tls() const { return tls_; }

 private:
  HttpServer(HttpServerOptions options, HttpHandler handler)
      : options_(std::move(options)), handler_(std::move(handler)) {}
  static int HandleRequest(mg_connection* connection, void* server);
  static int InitSsl(void* ssl_context, void* server);

  const HttpServerOptions options_;
  const HttpHandler handler_;
  std::string tls_error_;  // what InitSsl refused, for Start's message
  mg_context* context_ = nullptr;
  int port_ = 0;
  bool tls_ = false;
};

}  // namespace bertshard::http

#endif  // BERTSHARD_HTTP_HTTP_SERVER_H_
