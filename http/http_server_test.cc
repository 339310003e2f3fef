// The HTTP listener over real loopback sockets: requests reach the handler with their body and
// caller, over-limit bodies are flagged unread, bad addresses and TLS files are refused at start,
// and HTTPS (tools/make_test_certs.sh) serves only clients that trust its CA, and with a CA of
// its own only clients with a certificate from it.
#include "http/http_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <openssl/ssl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <optional>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace bertshard::http {
namespace {

int Connect(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  timeval timeout{10, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  if (connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

// Sends `request` and reads until the server closes (requests here say Connection: close).
std::string Exchange(int port, const std::string& request) {
  const int fd = Connect(port);
  if (fd < 0) return "";
  (void)send(fd, request.data(), request.size(), MSG_NOSIGNAL);
  std::string answer;
  char buffer[4096];
  ssize_t n;
  while ((n = recv(fd, buffer, sizeof(buffer), 0)) > 0) answer.append(buffer, static_cast<size_t>(n));
  close(fd);
  return answer;
}

// The same over TLS, verifying the server against `ca` and presenting `cert` + `key` when given.
// nullopt when the handshake or the exchange fails.
std::optional<std::string> TlsExchange(int port, const std::string& request, const std::string& ca,
                                       const std::string& cert = "", const std::string& key = "") {
  SSL_CTX* context = SSL_CTX_new(TLS_client_method());
  SSL_CTX_load_verify_locations(context, ca.c_str(), nullptr);
  SSL_CTX_set_verify(context, SSL_VERIFY_PEER, nullptr);
  if (!cert.empty()) {
    SSL_CTX_use_certificate_chain_file(context, cert.c_str());
    SSL_CTX_use_PrivateKey_file(context, key.c_str(), SSL_FILETYPE_PEM);
  }
  const int fd = Connect(port);
  SSL* ssl = SSL_new(context);
  SSL_set_fd(ssl, fd);
  std::optional<std::string> answer;
  if (fd >= 0 && SSL_connect(ssl) == 1 && SSL_write(ssl, request.data(), static_cast<int>(request.size())) > 0) {
    std::string text;
    char buffer[4096];
    int n;
    while ((n = SSL_read(ssl, buffer, sizeof(buffer))) > 0) text.append(buffer, static_cast<size_t>(n));
    if (!text.empty()) answer = text;
  }
  SSL_free(ssl);
  if (fd >= 0) close(fd);
  SSL_CTX_free(context);
  return answer;
}

HttpResponse Echo(const HttpRequest& request) {
  HttpResponse response;
  response.status = request.body_too_large ? 413 : 200;
  response.content_type = "text/plain";
  response.body = absl::StrCat(request.method, " ", request.path, " ", request.body.size(), " [", request.body, "] ",
                               request.authorization, " ", request.client);
  response.headers = {{"x-test", "yes"}};
  return response;
}

TEST(HttpServer, ServesTheHandlerWithBodyAndCaller) {
  auto server = HttpServer::Start({.listen = "127.0.0.1:0"}, Echo);
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_FALSE((*server)->tls());
  const std::string answer = Exchange((*server)->port(),
                                      "POST /embed?x=1 HTTP/1.1\r\nHost: a\r\nAuthorization: Bearer t\r\n"
                                      "Content-Length: 5\r\nConnection: close\r\n\r\nhello");
  EXPECT_TRUE(absl::StartsWith(answer, "HTTP/1.1 200 OK\r\n")) << answer;
  EXPECT_NE(answer.find("x-test: yes\r\n"), std::string::npos) << answer;
  EXPECT_NE(answer.find("Content-Type: text/plain\r\n"), std::string::npos) << answer;
  EXPECT_NE(answer.find("POST /embed 5 [hello] Bearer t host:127.0.0.1"), std::string::npos) << answer;
}

TEST(HttpServer, FlagsABodyOverTheLimitWithoutReadingIt) {
  auto server = HttpServer::Start({.listen = "127.0.0.1:0", .max_body_bytes = 4}, Echo);
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string declared = Exchange((*server)->port(),
                                        "POST /embed HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n"
                                        "Connection: close\r\n\r\nhello");
  EXPECT_TRUE(absl::StartsWith(declared, "HTTP/1.1 413 Payload Too Large\r\n")) << declared;
  EXPECT_NE(declared.find("POST /embed 0 []"), std::string::npos) << declared;
  EXPECT_NE(declared.find("Connection: close\r\n"), std::string::npos) << declared;
  const std::string chunked = Exchange((*server)->port(),
                                       "POST /embed HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n"
                                       "Connection: close\r\n\r\n3\r\nabc\r\n3\r\ndef\r\n0\r\n\r\n");
  EXPECT_TRUE(absl::StartsWith(chunked, "HTTP/1.1 413 Payload Too Large\r\n")) << chunked;
  const std::string fits = Exchange((*server)->port(),
                                    "POST /embed HTTP/1.1\r\nHost: a\r\nContent-Length: 4\r\n"
                                    "Connection: close\r\n\r\nabcd");
  EXPECT_TRUE(absl::StartsWith(fits, "HTTP/1.1 200 OK\r\n")) << fits;
}

TEST(HttpServer, RefusesBadAddressesAndTakenPorts) {
  for (const char* address : {"nonsense", ":80", "127.0.0.1:99999", "127.0.0.1:80s", "a,b:1", "127.0.0.1:"}) {
    SCOPED_TRACE(address);
    EXPECT_EQ(HttpServer::Start({.listen = address}, Echo).status().code(), absl::StatusCode::kInvalidArgument);
  }
  auto first = HttpServer::Start({.listen = "127.0.0.1:0"}, Echo);
  ASSERT_TRUE(first.ok()) << first.status();
  const auto taken = HttpServer::Start({.listen = absl::StrCat("127.0.0.1:", (*first)->port())}, Echo);
  EXPECT_EQ(taken.status().code(), absl::StatusCode::kUnavailable) << taken.status();
}

class HttpsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string((std::filesystem::path(testing::TempDir()) / "http_certs").string());
    const int rc = std::system(("bash tools/make_test_certs.sh " + *dir_).c_str());
    ASSERT_EQ(rc, 0) << "tools/make_test_certs.sh failed (Debian's openssl?); see " << *dir_ << "/make.log";
  }
  static std::string F(const std::string& name) { return *dir_ + "/" + name; }
  static std::string* dir_;
  static constexpr char kRequest[] = "GET /info HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n";
};
std::string* HttpsTest::dir_ = nullptr;

TEST_F(HttpsTest, ServesOnlyOverTlsToClientsThatTrustItsCa) {
  auto server = HttpServer::Start({.listen = "127.0.0.1:0", .tls = {F("server.pem"), F("server.key"), ""}}, Echo);
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_TRUE((*server)->tls());
  const std::optional<std::string> answer = TlsExchange((*server)->port(), kRequest, F("ca.pem"));
  ASSERT_TRUE(answer.has_value());
  EXPECT_TRUE(absl::StartsWith(*answer, "HTTP/1.1 200 OK\r\n")) << *answer;
  EXPECT_FALSE(TlsExchange((*server)->port(), kRequest, F("other-ca.pem")).has_value());
  const std::string plain = Exchange((*server)->port(), kRequest);
  EXPECT_FALSE(absl::StartsWith(plain, "HTTP/1.1 200")) << plain;  // no plaintext answer on the TLS port
}

TEST_F(HttpsTest, WithACaAsksClientsForACertificateFromIt) {
  auto server =
      HttpServer::Start({.listen = "127.0.0.1:0", .tls = {F("server.pem"), F("server.key"), F("ca.pem")}}, Echo);
  ASSERT_TRUE(server.ok()) << server.status();
  const std::optional<std::string> with =
      TlsExchange((*server)->port(), kRequest, F("ca.pem"), F("client.pem"), F("client.key"));
  ASSERT_TRUE(with.has_value());
  EXPECT_TRUE(absl::StartsWith(*with, "HTTP/1.1 200 OK\r\n")) << *with;
  EXPECT_FALSE(TlsExchange((*server)->port(), kRequest, F("ca.pem")).has_value());
  EXPECT_FALSE(
      TlsExchange((*server)->port(), kRequest, F("ca.pem"), F("client-other.pem"), F("client.key")).has_value());
}

TEST_F(HttpsTest, RefusesTlsFilesThatCannotServe) {
  const std::vector<HttpTls> bad = {
      {F("server.pem"), "", ""},                // a certificate without its key
      {"", "", F("ca.pem")},                    // a CA alone
      {F("missing.pem"), F("server.key"), ""},  // unreadable
      {F("server.pem"), F("client.key"), ""},   // another certificate's key
      {F("server.pem"), F("server.key"), F("missing-ca.pem")},
  };
  for (const HttpTls& tls : bad) {
    SCOPED_TRACE(tls.cert + " " + tls.key + " " + tls.ca);
    const auto server = HttpServer::Start({.listen = "127.0.0.1:0", .tls = tls}, Echo);
    EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument) << server.status();
  }
}

}  // namespace
}  // namespace bertshard::http
