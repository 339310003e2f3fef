#include "http/http_server.h"

#include <civetweb.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>
#include <utility>

#include "absl/base/call_once.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/metrics_endpoint.h"

// civetweb's threads get a large enough stack through common/metrics_endpoint.cc's
// pthread_attr_setstacksize (linked in by this library's dependency on it).

namespace bertshard::http {
namespace {

const char* Reason(int status) {
  switch (status) {
    case 200:
      return "OK";
    case 400:
      return "Bad Request";
    case 401:
      return "Unauthorized";
    case 403:
      return "Forbidden";
    case 404:
      return "Not Found";
    case 405:
      return "Method Not Allowed";
    case 413:
      return "Payload Too Large";
    case 415:
      return "Unsupported Media Type";
    case 422:
      return "Unprocessable Entity";
    case 424:
      return "Failed Dependency";
    case 429:
      return "Too Many Requests";
    case 500:
      return "Internal Server Error";
    case 503:
      return "Service Unavailable";
    case 504:
      return "Gateway Timeout";
    default:
      return "Status";
  }
}

enum class BodyRead { kWhole, kTooLarge, kBroken };

// The request's body, up to `limit` bytes: kTooLarge when it is longer (the rest is left unread),
// kBroken when the connection failed or timed out before its end (a declared length not reached).
BodyRead ReadBody(mg_connection* connection, int64_t declared, int64_t limit, std::string* body) {
  if (declared > limit) return BodyRead::kTooLarge;
  // What the client declares is not trusted for more than a first buffer.
  if (declared >= 0) body->reserve(static_cast<size_t>(std::min<int64_t>(declared, int64_t{1} << 20)));
  char buffer[16384];
  while (true) {
    const int n = mg_read(connection, buffer, sizeof(buffer));
    if (n < 0) return BodyRead::kBroken;
    if (n == 0) {
      return declared >= 0 && static_cast<int64_t>(body->size()) < declared ? BodyRead::kBroken : BodyRead::kWhole;
    }
    if (static_cast<int64_t>(body->size()) + n > limit) return BodyRead::kTooLarge;
    body->append(buffer, static_cast<size_t>(n));
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<HttpServer>> HttpServer::Start(const HttpServerOptions& options, HttpHandler handler) {
  std::string listening;
  if (auto parsed = common::CivetwebListeningPort(options.listen, "HTTP", 8080); parsed.ok()) {
    listening = *std::move(parsed);
  } else {
    return parsed.status();
  }
  if (options.max_body_bytes < 1 || options.threads < 1 || options.request_timeout_ms < 1 ||
      options.keep_alive_timeout_ms < 1) {
    return absl::InvalidArgumentError(
        "the HTTP body limit, thread count, request timeout and keep-alive timeout must be >= 1");
  }
  static absl::once_flag init_once;
  // mg_start would call it too, but not thread-safely. No TLS feature: see the header.
  absl::call_once(init_once, [] { mg_init_library(0); });
  std::unique_ptr<HttpServer> server(new HttpServer(options, std::move(handler)));
  const std::string threads = std::to_string(options.threads);
  const std::string timeout = std::to_string(options.request_timeout_ms);
  const std::string keep_alive = std::to_string(options.keep_alive_timeout_ms);
  // Keep-alive on: clients that send many small requests (OpenAI's SDK, a TEI client) reuse one
  // connection. Each kept connection holds a civetweb thread while it waits for the next request,
  // so an idle one is dropped after keep_alive_timeout_ms (a pool of idle SDK connections would
  // otherwise hold the threads that answer 429 and /health). tcp_nodelay: answers go out at once;
  // with Nagle's algorithm on, the part of an answer after its first write waited for the client's
  // delayed ACK (+60 ms per request for TEI's /embed on a kept connection, bench/http_benchmark.sh).
  const char* civet_options[] = {"listening_ports",
                                 listening.c_str(),
                                 "num_threads",
                                 threads.c_str(),
                                 "request_timeout_ms",
                                 timeout.c_str(),
                                 "keep_alive_timeout_ms",
                                 keep_alive.c_str(),
                                 "enable_keep_alive",
                                 "yes",
                                 "tcp_nodelay",
                                 "1",
                                 nullptr};
  mg_callbacks callbacks{};
  char error_text[256] = "";
  unsigned error_code = 0;
  mg_error_data error{&error_code, error_text, sizeof(error_text)};
  mg_init_data init{&callbacks, server.get(), civet_options};
  server->context_ = mg_start2(&init, &error);
  if (server->context_ == nullptr) {
    return absl::UnavailableError(absl::StrCat("cannot serve HTTP on ", options.listen, " (", error_text,
                                               ": address in use, or not an address of this machine)"));
  }
  mg_server_port ports[1] = {};
  if (mg_get_server_ports(server->context_, 1, ports) != 1 || ports[0].port <= 0) {
    return absl::InternalError(absl::StrCat("civetweb started on ", options.listen, " but reports no port"));
  }
  server->port_ = ports[0].port;
  mg_set_request_handler(server->context_, "/", &HttpServer::HandleRequest, server.get());
  return server;
}

HttpServer::~HttpServer() {
  if (context_ != nullptr) mg_stop(context_);
}

int HttpServer::HandleRequest(mg_connection* connection, void* data) {
  auto* server = static_cast<HttpServer*>(data);
  const mg_request_info* info = mg_get_request_info(connection);
  HttpRequest request;
  request.method = info->request_method != nullptr ? info->request_method : "";
  request.path = info->local_uri != nullptr ? info->local_uri : "";
  if (const char* authorization = mg_get_header(connection, "Authorization"); authorization != nullptr) {
    request.authorization = authorization;
  }
  for (int i = 0; i < info->num_headers; ++i) {
    const mg_header& header = info->http_headers[i];
    if (header.name != nullptr && header.value != nullptr) request.headers.emplace_back(header.name, header.value);
  }
  request.connection = absl::StrCat(info->remote_addr, ":", info->remote_port);
  request.client = absl::StrCat("host:", info->remote_addr);
  HttpResponse response;
  // Nothing may unwind into civetweb's C code (std::terminate: the whole coordinator): a request
  // that runs out of memory, or any other throw on its path, is this request's 500 alone.
  try {
    const BodyRead read = ReadBody(connection, info->content_length, server->options_.max_body_bytes, &request.body);
    request.body_too_large = read != BodyRead::kWhole;  // either way the connection closes after
    if (request.body_too_large) request.body.clear();
    if (read == BodyRead::kBroken) {
      // Never handled as if whole: a truncated JSON body could still parse.
      response = {400,
                  "application/json",
                  "{\"error\":\"the request body ended before its declared length\",\"error_type\":\"Validation\"}",
                  {}};
    } else {
      response = server->handler_(request);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "http: %s %s failed: %s\n", request.method.c_str(), request.path.c_str(), e.what());
    response = {500, "application/json", "{\"error\":\"internal error\",\"error_type\":\"Backend\"}", {}};
    request.body_too_large = true;  // close the connection: what was left of the body is unknown
  }
  std::string head =
      absl::StrCat("HTTP/1.1 ", response.status, " ", Reason(response.status),
                   "\r\nContent-Type: ", response.content_type, "\r\nContent-Length: ", response.body.size(), "\r\n");
  for (const auto& [name, value] : response.headers) absl::StrAppend(&head, name, ": ", value, "\r\n");
  // An unread body cannot be skipped safely on a kept connection: close it after the answer.
  absl::StrAppend(&head, request.body_too_large ? "Connection: close\r\n" : "", "\r\n");
  // A small answer in one write, so one segment: head and body apart would be two. A large one is
  // not copied to join its head.
  constexpr size_t kJoinedBody = 64 << 10;
  if (response.body.size() <= kJoinedBody) {
    head += response.body;
    mg_write(connection, head.data(), head.size());
  } else {
    mg_write(connection, head.data(), head.size());
    mg_write(connection, response.body.data(), response.body.size());
  }
  return response.status;
}

}  // namespace bertshard::http
