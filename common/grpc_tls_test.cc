// TLS and mutual TLS on a real gRPC server, with certificates made at test time by Debian's
// openssl (tools/make_test_certs.sh): a CA and a second, unrelated CA; server and client
// certificates from the first; a client certificate from the second; an expired client and an
// expired server certificate. The right
// files connect; a wrong CA, an expired certificate or plaintext is refused at the handshake.
#include "common/grpc_tls.h"

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "gtest/gtest.h"

namespace bertshard::common {
namespace {

class GrpcTls : public testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string(testing::TempDir() + "/grpc_tls");
    std::filesystem::remove_all(*dir_);
    std::filesystem::create_directories(*dir_);
    const int rc = std::system(("bash tools/make_test_certs.sh " + *dir_).c_str());
    ASSERT_EQ(rc, 0) << "tools/make_test_certs.sh could not make the test certificates (is Debian's openssl "
                        "installed? tools/install_deps.sh installs it); see "
                     << *dir_ << "/make.log";
  }
  static std::string F(const std::string& name) { return *dir_ + "/" + name; }

  // A server with the health service on `files`; returns its port.
  int Serve(const TlsFiles& files) {
    auto credentials = ServerCredentials(files);
    EXPECT_TRUE(credentials.ok()) << credentials.status();
    grpc::EnableDefaultHealthCheckService(true);
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", *credentials, &port);
    server_ = builder.BuildAndStart();
    EXPECT_NE(server_, nullptr);
    return port;
  }
  // Whether a health check over a channel with `files` succeeds.
  bool Connects(int port, const TlsFiles& files) {
    auto credentials = ChannelCredentials(files);
    EXPECT_TRUE(credentials.ok()) << credentials.status();
    auto stub =
        grpc::health::v1::Health::NewStub(grpc::CreateChannel("127.0.0.1:" + std::to_string(port), *credentials));
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    grpc::health::v1::HealthCheckResponse response;
    const grpc::Status s = stub->Check(&context, grpc::health::v1::HealthCheckRequest(), &response);
    return s.ok();
  }

  static std::string* dir_;
  std::unique_ptr<grpc::Server> server_;
};
std::string* GrpcTls::dir_ = nullptr;

TEST_F(GrpcTls, MutualTlsConnectsWithTheRightFilesOnly) {
  const int port = Serve({F("server.pem"), F("server.key"), F("ca.pem")});
  EXPECT_TRUE(Connects(port, {F("client.pem"), F("client.key"), F("ca.pem")}));
  EXPECT_FALSE(Connects(port, {})) << "plaintext";
  EXPECT_FALSE(Connects(port, {"", "", F("ca.pem")})) << "no client certificate";
  EXPECT_FALSE(Connects(port, {F("client-other.pem"), F("client.key"), F("ca.pem")}))
      << "client certificate of another CA";
  EXPECT_FALSE(Connects(port, {F("client-expired.pem"), F("client.key"), F("ca.pem")})) << "expired client certificate";
  EXPECT_FALSE(Connects(port, {F("client.pem"), F("client.key"), F("other-ca.pem")}))
      << "server not from the CA trusted";
}

TEST_F(GrpcTls, ServerTlsWithoutClientCertificates) {
  const int port = Serve({F("server.pem"), F("server.key"), ""});
  EXPECT_TRUE(Connects(port, {"", "", F("ca.pem")}));
  EXPECT_FALSE(Connects(port, {})) << "plaintext";
  EXPECT_FALSE(Connects(port, {"", "", F("other-ca.pem")})) << "wrong CA";
}

TEST_F(GrpcTls, AnExpiredServerCertificateIsRefused) {
  const int port = Serve({F("server-expired.pem"), F("server.key"), F("ca.pem")});
  EXPECT_FALSE(Connects(port, {F("client.pem"), F("client.key"), F("ca.pem")}));
}

TEST_F(GrpcTls, PlaintextServerStillServesPlaintext) {
  const int port = Serve({});
  EXPECT_TRUE(Connects(port, {}));
  EXPECT_FALSE(Connects(port, {"", "", F("ca.pem")})) << "TLS client to a plaintext server";
}

TEST_F(GrpcTls, BadFilesAreInvalidArgumentsThatQuoteNothing) {
  EXPECT_EQ(ServerCredentials({F("server.pem"), "", ""}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ServerCredentials({"", "", F("ca.pem")}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ChannelCredentials({"", F("client.key"), F("ca.pem")}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ChannelCredentials({"", "", "/no/such/ca.pem"}).status().code(), absl::StatusCode::kInvalidArgument);
  std::ofstream(F("secret.txt")) << "my-private-words";
  const auto s = ServerCredentials({F("secret.txt"), F("server.key"), ""});
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(std::string(s.status().message()).find("my-private-words"), std::string::npos);
  EXPECT_NE(std::string(s.status().message()).find("is not PEM"), std::string::npos);
}

}  // namespace
}  // namespace bertshard::common
