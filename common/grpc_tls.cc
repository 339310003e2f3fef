#include "common/grpc_tls.h"

#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"

namespace bertshard::common {
namespace {

// The file's text; INVALID_ARGUMENT naming the flag's file when it is unreadable or not PEM
// (its contents are never quoted: a key file is a secret).
absl::StatusOr<std::string> ReadPem(const std::string& path, const char* what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::InvalidArgumentError(absl::StrCat("TLS ", what, " file ", path, " cannot be read"));
  std::ostringstream text;
  text << in.rdbuf();
  if (!absl::StrContains(text.str(), "-----BEGIN ")) {
    return absl::InvalidArgumentError(absl::StrCat("TLS ", what, " file ", path, " is not PEM"));
  }
  return text.str();
}

absl::Status CheckPair(const TlsFiles& f) {
  if (f.cert.empty() != f.key.empty()) {
    return absl::InvalidArgumentError("TLS needs a certificate and its key together (--tls_cert and --tls_key)");
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentials(const TlsFiles& f) {
  if (!f.enabled()) return grpc::InsecureServerCredentials();
  if (absl::Status s = CheckPair(f); !s.ok()) return s;
  if (f.cert.empty()) {
    return absl::InvalidArgumentError("a TLS server needs its certificate and key (--tls_cert, --tls_key), not only a CA");
  }
  grpc::SslServerCredentialsOptions options;
  grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
  auto cert = ReadPem(f.cert, "certificate");
  if (!cert.ok()) return cert.status();
  auto key = ReadPem(f.key, "key");
  if (!key.ok()) return key.status();
  pair.cert_chain = *cert;
  pair.private_key = *key;
  options.pem_key_cert_pairs.push_back(pair);
  if (!f.ca.empty()) {
    auto ca = ReadPem(f.ca, "CA");
    if (!ca.ok()) return ca.status();
    options.pem_root_certs = *ca;
    options.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  return grpc::SslServerCredentials(options);
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentials(const TlsFiles& f) {
  if (!f.enabled()) return grpc::InsecureChannelCredentials();
  if (absl::Status s = CheckPair(f); !s.ok()) return s;
  grpc::SslCredentialsOptions options;
  if (!f.ca.empty()) {
    auto ca = ReadPem(f.ca, "CA");
    if (!ca.ok()) return ca.status();
    options.pem_root_certs = *ca;
  }
  if (!f.cert.empty()) {
    auto cert = ReadPem(f.cert, "certificate");
    if (!cert.ok()) return cert.status();
    auto key = ReadPem(f.key, "key");
    if (!key.ok()) return key.status();
    options.pem_cert_chain = *cert;
    options.pem_private_key = *key;
  }
  return grpc::SslCredentials(options);
}

}  // namespace bertshard::common
