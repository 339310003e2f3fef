#include "http/http_server.h"

#include <civetweb.h>
#include <dlfcn.h>
#include <openssl/err.h>
#include <openssl/ssl.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>

#include "absl/base/call_once.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

// civetweb's threads get a large enough stack through common/metrics_endpoint.cc's
// pthread_attr_setstacksize (linked in by this library's dependency on it).

// Debian's civetweb 1.15 is built for OpenSSL 1.1's API and loads libssl by name at run time;
// Debian 12's libssl is OpenSSL 3, which exports SSL_get_peer_certificate only as a macro for
// SSL_get1_peer_certificate (the same function: a new reference the caller frees). civetweb's
// lookup finds nothing, keeps a null pointer, and calls it on every TLS connection (a crash at the
// first HTTPS request). So this process's dlsym answers that one name, looked up in a library's
// own handle and found missing there, with SSL_get1_peer_certificate; every other lookup passes
// through unchanged (RTLD_NEXT and RTLD_DEFAULT lookups are relative to this object from here: the
// coordinator is one executable, where that is the same object).
namespace {
X509* PeerCertificate(const SSL* ssl) { return SSL_get1_peer_certificate(ssl); }
}  // namespace

extern "C" void* dlsym(void* handle, const char* symbol) noexcept {
  using Dlsym = void* (*)(void*, const char*);
  static const Dlsym next = [] {
    void* found = dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34");
    if (found == nullptr) found = dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5");
    return reinterpret_cast<Dlsym>(found);
  }();
  if (next == nullptr) return nullptr;
  void* found = next(handle, symbol);
  if (found == nullptr && handle != RTLD_NEXT && handle != RTLD_DEFAULT &&
      std::strcmp(symbol, "SSL_get_peer_certificate") == 0) {
    return reinterpret_cast<void*>(&PeerCertificate);
  }
  return found;
}

namespace bertshard::http {
namespace {

// HOST:PORT -> civetweb's listening_ports syntax ("s" for TLS), refusing what civetweb would read as
// something else: a list (`,`), SSL or redirect suffixes, a bare port (every interface).
absl::StatusOr<std::string> ListeningPort(const std::string& address, bool tls) {
  const auto invalid = [&address]() {
    return absl::InvalidArgumentError(absl::StrCat("HTTP address '", address,
                                                   "' is not HOST:PORT with a port in 0..65535 "
                                                   "(e.g. 0.0.0.0:8080, 127.0.0.1:0)"));
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
  return absl::StrCat(host, ":", number, tls ? "s" : "");
}

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

// The request's body, up to `limit` bytes; false when it is longer (the rest is left unread).
bool ReadBody(mg_connection* connection, int64_t declared, int64_t limit, std::string* body) {
  if (declared > limit) return false;
  if (declared >= 0) body->reserve(static_cast<size_t>(declared));
  char buffer[16384];
  while (true) {
    const int n = mg_read(connection, buffer, sizeof(buffer));
    if (n <= 0) return true;
    if (static_cast<int64_t>(body->size()) + n > limit) return false;
    body->append(buffer, static_cast<size_t>(n));
  }
}

// "CN=name" out of an OpenSSL one-line subject ("/C=XX/O=org/CN=name" or "C=XX, CN=name").
std::string CommonName(absl::string_view subject) {
  const size_t at = subject.rfind("CN=");
  if (at == absl::string_view::npos) return "";
  absl::string_view cn = subject.substr(at + 3);
  cn = cn.substr(0, std::min(cn.find('/'), cn.find(',')));
  return std::string(cn);
}

std::string OpenSslError() {
  const unsigned long code = ERR_get_error();
  ERR_clear_error();
  if (code == 0) return "no detail";
  char text[256];
  ERR_error_string_n(code, text, sizeof(text));
  return text;
}

}  // namespace

absl::StatusOr<std::unique_ptr<HttpServer>> HttpServer::Start(const HttpServerOptions& options, HttpHandler handler) {
  const HttpTls& tls = options.tls;
  if (tls.enabled() && (tls.cert.empty() || tls.key.empty())) {
    return absl::InvalidArgumentError("HTTPS needs a certificate and its key together (--tls_cert, --tls_key)");
  }
  std::string listening;
  if (auto parsed = ListeningPort(options.listen, tls.enabled()); parsed.ok()) {
    listening = *std::move(parsed);
  } else {
    return parsed.status();
  }
  if (options.max_body_bytes < 1 || options.threads < 1 || options.request_timeout_ms < 1) {
    return absl::InvalidArgumentError("the HTTP body limit, thread count and request timeout must be >= 1");
  }
  static absl::once_flag init_once;
  // mg_start would call it too, but not thread-safely. The TLS feature loads libssl.
  absl::call_once(init_once, [] { mg_init_library(MG_FEATURES_TLS); });
  std::unique_ptr<HttpServer> server(new HttpServer(options, std::move(handler)));
  const std::string threads = std::to_string(options.threads);
  const std::string timeout = std::to_string(options.request_timeout_ms);
  // Keep-alive on: clients that send many small requests (OpenAI's SDK, a TEI client) reuse one
  // connection; a silent kept connection is dropped after the request timeout.
  const char* civet_options[] = {"listening_ports",
                                 listening.c_str(),
                                 "num_threads",
                                 threads.c_str(),
                                 "request_timeout_ms",
                                 timeout.c_str(),
                                 "keep_alive_timeout_ms",
                                 timeout.c_str(),
                                 "enable_keep_alive",
                                 "yes",
                                 nullptr};
  mg_callbacks callbacks{};
  if (tls.enabled()) callbacks.init_ssl = &HttpServer::InitSsl;
  char error_text[256] = "";
  unsigned error_code = 0;
  mg_error_data error{&error_code, error_text, sizeof(error_text)};
  mg_init_data init{&callbacks, server.get(), civet_options};
  server->context_ = mg_start2(&init, &error);
  if (server->context_ == nullptr) {
    if (!server->tls_error_.empty()) return absl::InvalidArgumentError(server->tls_error_);
    return absl::UnavailableError(absl::StrCat("cannot serve HTTP on ", options.listen, " (", error_text,
                                               ": address in use, or not an address of this machine)"));
  }
  mg_server_port ports[1] = {};
  if (mg_get_server_ports(server->context_, 1, ports) != 1 || ports[0].port <= 0) {
    return absl::InternalError(absl::StrCat("civetweb started on ", options.listen, " but reports no port"));
  }
  server->port_ = ports[0].port;
  server->tls_ = ports[0].is_ssl != 0;
  mg_set_request_handler(server->context_, "/", &HttpServer::HandleRequest, server.get());
  return server;
}

HttpServer::~HttpServer() {
  if (context_ != nullptr) mg_stop(context_);
}

int HttpServer::InitSsl(void* ssl_context, void* data) {
  auto* server = static_cast<HttpServer*>(data);
  auto* context = static_cast<SSL_CTX*>(ssl_context);
  const HttpTls& tls = server->options_.tls;
  const auto refuse = [server](const std::string& what) {
    server->tls_error_ = absl::StrCat("HTTPS: ", what, " (", OpenSslError(), ")");
    return -1;
  };
  if (SSL_CTX_use_certificate_chain_file(context, tls.cert.c_str()) != 1) {
    return refuse(absl::StrCat("cannot use ", tls.cert, " as a PEM certificate chain"));
  }
  if (SSL_CTX_use_PrivateKey_file(context, tls.key.c_str(), SSL_FILETYPE_PEM) != 1) {
    return refuse(absl::StrCat("cannot use ", tls.key, " as a PEM private key"));
  }
  if (SSL_CTX_check_private_key(context) != 1) {
    return refuse(absl::StrCat(tls.key, " is not the key of ", tls.cert));
  }
  SSL_CTX_set_min_proto_version(context, TLS1_2_VERSION);
  if (!tls.ca.empty()) {
    if (SSL_CTX_load_verify_locations(context, tls.ca.c_str(), nullptr) != 1) {
      return refuse(absl::StrCat("cannot use ", tls.ca, " as PEM certificate authorities"));
    }
    SSL_CTX_set_verify(context, SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT, nullptr);
  }
  return 1;  // set up here: civetweb loads nothing itself
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
  request.connection = absl::StrCat(info->remote_addr, ":", info->remote_port);
  request.client = absl::StrCat("host:", info->remote_addr);
  if (info->client_cert != nullptr && info->client_cert->subject != nullptr) {
    if (std::string cn = CommonName(info->client_cert->subject); !cn.empty()) request.client = "cn:" + cn;
  }
  request.body_too_large = !ReadBody(connection, info->content_length, server->options_.max_body_bytes, &request.body);
  if (request.body_too_large) request.body.clear();
  const HttpResponse response = server->handler_(request);
  std::string head =
      absl::StrCat("HTTP/1.1 ", response.status, " ", Reason(response.status),
                   "\r\nContent-Type: ", response.content_type, "\r\nContent-Length: ", response.body.size(), "\r\n");
  for (const auto& [name, value] : response.headers) absl::StrAppend(&head, name, ": ", value, "\r\n");
  // An unread body cannot be skipped safely on a kept connection: close it after the answer.
  absl::StrAppend(&head, request.body_too_large ? "Connection: close\r\n" : "", "\r\n");
  mg_write(connection, head.data(), head.size());
  mg_write(connection, response.body.data(), response.body.size());
  return response.status;
}

}  // namespace bertshard::http
