#include "common/metrics_endpoint.h"

#include <civetweb.h>
#include <dlfcn.h>
#include <pthread.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/call_once.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

// Debian builds civetweb with USE_STACK_SIZE=102400: every thread it starts asks for a 100 KiB
// stack. glibc carves the static TLS of every loaded library out of a thread's stack, and in a
// process that links LibTorch (OpenBLAS alone takes 60 KiB, glog 30 KiB) that is too little:
// pthread_create fails with EINVAL and civetweb cannot start ("Cannot create first worker
// thread"). Elsewhere the stack is merely tight for a scrape that reads SQLite. So this process's
// pthread_attr_setstacksize gives civetweb's threads, and only civetweb's (told by the caller's
// shared object), at least kCivetwebThreadStack; every other call passes through unchanged.
namespace {
constexpr size_t kCivetwebThreadStack = size_t{1} << 20;
}  // namespace

extern "C" int pthread_attr_setstacksize(pthread_attr_t* attr, size_t size) {
  using SetStackSize = int (*)(pthread_attr_t*, size_t);
  static const SetStackSize next = reinterpret_cast<SetStackSize>(dlsym(RTLD_NEXT, "pthread_attr_setstacksize"));
  if (next == nullptr) return ENOSYS;
  Dl_info caller;
  if (size < kCivetwebThreadStack && dladdr(__builtin_return_address(0), &caller) != 0 && caller.dli_fname != nullptr &&
      std::strstr(caller.dli_fname, "libcivetweb") != nullptr) {
    size = kCivetwebThreadStack;
  }
  return next(attr, size);
}

namespace bertshard::common {
namespace {

constexpr char kContentType[] = "text/plain; version=0.0.4; charset=utf-8";

void Respond(mg_connection* connection, int code, const char* reason, const std::string& body,
             const char* extra_headers = "") {
  mg_printf(connection, "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\n%sConnection: close\r\n\r\n",
            code, reason, code == 200 ? kContentType : "text/plain; charset=utf-8", body.size(), extra_headers);
  mg_write(connection, body.data(), body.size());
}

// Compares in time that depends only on the lengths, not on where the first difference is.
bool SameSecret(absl::string_view a, absl::string_view b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

}  // namespace

absl::StatusOr<std::string> CivetwebListeningPort(const std::string& address, absl::string_view what,
                                                  int example_port) {
  const auto invalid = [&]() {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " address '", address,
                     "' is not HOST:PORT with a port in 0..65535 (e.g. 0.0.0.0:", example_port, ", 127.0.0.1:0)"));
  };
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon == 0) return invalid();
  const std::string host = address.substr(0, colon);
  const std::string port = address.substr(colon + 1);
  int number = -1;
  if (port.empty() || port.find_first_not_of("0123456789") != std::string::npos || port.size() > 5 ||
      !absl::SimpleAtoi(port, &number) || number > 65535) {
    return invalid();
  }
  if (host.find_first_of(",: \t") != std::string::npos) return invalid();
  return absl::StrCat(host, ":", number);
}

absl::StatusOr<std::unique_ptr<MetricsEndpoint>> MetricsEndpoint::Start(const std::string& address,
                                                                        MetricsRegistry* registry,
                                                                        std::vector<std::string> bearer_tokens) {
  std::string listening;
  if (auto parsed = CivetwebListeningPort(address, "metrics", 9090); parsed.ok()) {
    listening = *std::move(parsed);
  } else {
    return parsed.status();
  }
  // mg_start would call it too, but not thread-safely.
  static absl::once_flag init_once;
  absl::call_once(init_once, [] { mg_init_library(0); });

  bearer_tokens.erase(std::remove(bearer_tokens.begin(), bearer_tokens.end(), ""), bearer_tokens.end());
  std::unique_ptr<MetricsEndpoint> endpoint(new MetricsEndpoint(registry, std::move(bearer_tokens)));
  // Scrapes are rare and short, but a thread is held by each open connection until it sends a
  // request or times out: enough threads that a few silent sockets leave one for Prometheus, and a
  // timeout that frees a silent one in seconds (a render takes milliseconds). No keep-alive: an
  // idle kept connection would hold a thread too.
  const std::string threads = std::to_string(kThreads);
  const std::string timeout = std::to_string(kRequestTimeoutMs);
  const char* options[] = {"listening_ports", listening.c_str(),   "num_threads", threads.c_str(), "request_timeout_ms",
                           timeout.c_str(),   "enable_keep_alive", "no",          nullptr};
  mg_callbacks callbacks{};
  char error_text[256] = "";
  unsigned error_code = 0;
  mg_error_data error{&error_code, error_text, sizeof(error_text)};
  mg_init_data init{&callbacks, endpoint.get(), options};
  endpoint->context_ = mg_start2(&init, &error);
  if (endpoint->context_ == nullptr) {
    return absl::UnavailableError(absl::StrCat("cannot serve metrics on ", address, " (", error_text,
                                               ": address in use, or not an address of this machine)"));
  }
  mg_server_port ports[1] = {};
  if (mg_get_server_ports(endpoint->context_, 1, ports) != 1 || ports[0].port <= 0) {
    return absl::InternalError(absl::StrCat("civetweb started on ", address, " but reports no port"));
  }
  endpoint->port_ = ports[0].port;
  // One handler for every path, so 404 and 405 are ours and nothing falls through to civetweb's
  // file serving.
  mg_set_request_handler(endpoint->context_, "/", &MetricsEndpoint::HandleRequest, endpoint.get());
  return endpoint;
}

MetricsEndpoint::~MetricsEndpoint() {
  if (context_ != nullptr) mg_stop(context_);
}

bool MetricsEndpoint::Authorized(mg_connection* connection) const {
  if (tokens_.empty()) return true;
  const char* header = mg_get_header(connection, "Authorization");
  if (header == nullptr) return false;
  absl::string_view value(header);
  constexpr absl::string_view kScheme = "Bearer ";
  if (value.size() <= kScheme.size() || !absl::EqualsIgnoreCase(value.substr(0, kScheme.size()), kScheme)) {
    return false;
  }
  value = absl::StripAsciiWhitespace(value.substr(kScheme.size()));
  bool match = false;
  for (const std::string& token : tokens_) match |= SameSecret(value, token);  // no early exit
  return match;
}

int MetricsEndpoint::HandleRequest(mg_connection* connection, void* data) {
  auto* endpoint = static_cast<MetricsEndpoint*>(data);
  const mg_request_info* request = mg_get_request_info(connection);
  const char* path = request->local_uri != nullptr ? request->local_uri : "";
  if (std::strcmp(path, "/metrics") != 0) {
    Respond(connection, 404, "Not Found", "not found: metrics are at /metrics\n");
    return 404;
  }
  if (std::strcmp(request->request_method, "GET") != 0) {
    Respond(connection, 405, "Method Not Allowed", "only GET is served\n", "Allow: GET\r\n");
    return 405;
  }
  if (!endpoint->Authorized(connection)) {
    // The same answer for a missing and a wrong token, and never the token itself.
    Respond(connection, 401, "Unauthorized", "a bearer token is needed (Authorization: Bearer <read token>)\n",
            "WWW-Authenticate: Bearer\r\n");
    return 401;
  }
  Respond(connection, 200, "OK", endpoint->registry_->Render());
  return 200;
}

}  // namespace bertshard::common
