// File: http/http_message.h
// -----------------------------------------------------------------------------
// One HTTP request as the listener (http/http_server.h) hands it over, and the answer a handler
// gives back: plain values, so that the protocols (http/http_api.h) need nothing of sockets, TLS or
// civetweb, and their tests and fuzzers build without them.
//
// Example:
//   HttpHandler hello = [](const HttpRequest& r) { return HttpResponse{200, "text/plain", "hi " + r.path}; };
//
// Thread safety: values (thread-compatible).
#ifndef BERTSHARD_HTTP_HTTP_MESSAGE_H_
#define BERTSHARD_HTTP_HTTP_MESSAGE_H_

#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace bertshard::http {

struct HttpRequest {
  std::string method;         // "GET", "POST", ...
  std::string path;           // without the query string
  std::string authorization;  // the Authorization header, "" when absent
  std::string body;           // empty when body_too_large
  bool body_too_large = false;
  // Who is calling, as the gRPC side says it (coordinator_server.cc ClientOf): "cn:<name>" of a
  // verified client certificate, else "host:<address>"; and the connection ("<address>:<port>").
  std::string client;
  std::string connection;
  // Every request header as sent (names in the client's case), for protocols that read more than
  // Authorization (KServe's Inference-Header-Content-Length).
  std::vector<std::pair<std::string, std::string>> headers;
};

// The value of header `name` (matched ignoring ASCII case), or null when it is absent.
inline const std::string* FindHeader(const HttpRequest& request, const std::string& name) {
  for (const auto& [key, value] : request.headers) {
    if (key.size() != name.size()) continue;
    bool same = true;
    for (size_t i = 0; i < key.size() && same; ++i) {
      const auto lower = [](char c) { return c >= 'A' && c <= 'Z' ? static_cast<char>(c - 'A' + 'a') : c; };
      same = lower(key[i]) == lower(name[i]);
    }
    if (same) return &value;
  }
  return nullptr;
}

struct HttpResponse {
  int status = 200;
  std::string content_type = "application/json";
  std::string body;
  std::vector<std::pair<std::string, std::string>> headers;  // extra ones; values must be one line
};

using HttpHandler = std::function<HttpResponse(const HttpRequest&)>;

}  // namespace bertshard::http

#endif  // BERTSHARD_HTTP_HTTP_MESSAGE_H_
