// The servers' security flags read into credentials and a token, with certificates made at test
// time (tools/make_test_certs.sh, as grpc_tls_test does) and real gRPC servers on loopback to
// show which credentials speak TLS.
#include "common/server_flags.h"

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>

#include "absl/flags/flag.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "gtest/gtest.h"

namespace bertshard::common {
namespace {

class ServerFlags : public testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string(testing::TempDir() + "/server_flags");
    std::filesystem::remove_all(*dir_);
    std::filesystem::create_directories(*dir_);
    ASSERT_EQ(std::system(("bash tools/make_test_certs.sh " + *dir_).c_str()), 0)
        << "tools/make_test_certs.sh could not make the test certificates; see " << *dir_ << "/make.log";
  }
  void SetUp() override { unsetenv("BERTSHARD_TOKEN"); }
  static std::string F(const std::string& name) { return *dir_ + "/" + name; }

  // Whether a health check with `credentials` reaches a server serving `server`.
  static bool Reaches(const std::shared_ptr<grpc::ServerCredentials>& server,
                      const std::shared_ptr<grpc::ChannelCredentials>& channel) {
    grpc::EnableDefaultHealthCheckService(true);
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", server, &port);
    std::unique_ptr<grpc::Server> serving = builder.BuildAndStart();
    auto stub = grpc::health::v1::Health::NewStub(grpc::CreateChannel("127.0.0.1:" + std::to_string(port), channel));
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    grpc::health::v1::HealthCheckResponse response;
    return stub->Check(&context, grpc::health::v1::HealthCheckRequest(), &response).ok();
  }

  static std::string* dir_;
};
std::string* ServerFlags::dir_ = nullptr;

TEST_F(ServerFlags, TheFlagsAreWhatSecurityFlagsReads) {
  absl::SetFlag(&FLAGS_auth_token_file, "/t");
  absl::SetFlag(&FLAGS_tls_cert, "/c");
  absl::SetFlag(&FLAGS_tls_key, "/k");
  absl::SetFlag(&FLAGS_tls_ca, "/a");
  const SecurityFiles files = SecurityFlags();
  EXPECT_EQ(files.token_file, "/t");
  EXPECT_EQ(files.tls.cert, "/c");
  EXPECT_EQ(files.tls.key, "/k");
  EXPECT_EQ(files.tls.ca, "/a");
}

TEST_F(ServerFlags, NoFilesIsPlaintextWithTheTokenFromTheEnvironmentIfAny) {
  auto security = LoadServerSecurity({});
  ASSERT_TRUE(security.ok()) << security.status();
  EXPECT_EQ(security->token, "");
  EXPECT_TRUE(Reaches(security->server_credentials, security->peer_credentials));
  setenv("BERTSHARD_TOKEN", "from-env", 1);
  security = LoadServerSecurity({});
  ASSERT_TRUE(security.ok()) << security.status();
  EXPECT_EQ(security->token, "from-env");
  // A file wins over the environment.
  const std::string token_file = *dir_ + "/token";
  std::ofstream(token_file) << "  from-file\n";
  security = LoadServerSecurity({.token_file = token_file});
  ASSERT_TRUE(security.ok()) << security.status();
  EXPECT_EQ(security->token, "from-file");
}

// A server identity without a CA serves TLS and dials plaintext; with the CA, its peers are dialled
// over TLS (verified against it) and must present certificates themselves.
TEST_F(ServerFlags, PeersAreDialledOverTlsExactlyWhenACaIsSet) {
  auto without_ca = LoadServerSecurity({.tls = {F("server.pem"), F("server.key"), ""}});
  ASSERT_TRUE(without_ca.ok()) << without_ca.status();
  EXPECT_TRUE(Reaches(grpc::InsecureServerCredentials(), without_ca->peer_credentials));
  auto with_ca = LoadServerSecurity({.tls = {F("server.pem"), F("server.key"), F("ca.pem")}});
  ASSERT_TRUE(with_ca.ok()) << with_ca.status();
  EXPECT_FALSE(Reaches(grpc::InsecureServerCredentials(), with_ca->peer_credentials));
  // Two such servers (a coordinator and its worker, say) reach each other over mutual TLS.
  EXPECT_TRUE(Reaches(with_ca->server_credentials, with_ca->peer_credentials));
  EXPECT_FALSE(Reaches(with_ca->server_credentials, grpc::InsecureChannelCredentials()));
}

TEST_F(ServerFlags, BadFilesAreInvalidArgumentsSayingWhatIsWrong) {
  const auto refused = [](const SecurityFiles& files, const std::string& words) {
    const auto security = LoadServerSecurity(files);
    EXPECT_EQ(security.status().code(), absl::StatusCode::kInvalidArgument) << security.status();
    EXPECT_NE(security.status().message().find(words), std::string::npos) << security.status();
  };
  refused({.token_file = "/nonexistent/token"}, "/nonexistent/token");
  refused({.tls = {F("server.pem"), "", ""}}, "a certificate and its key together");
  refused({.tls = {"", "", F("ca.pem")}}, "not only a CA");
  refused({.tls = {"/nonexistent/cert.pem", F("server.key"), ""}}, "/nonexistent/cert.pem");
}

}  // namespace
}  // namespace bertshard::common
