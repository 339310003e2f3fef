#include "common/grpc_tls.h"

#include <fstream>
#include <sstream>
#include <tuple>

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

// The PEM texts of the files: cert and key always, ca when set ("" when not).
struct Pem {
  std::string cert, key, ca;
};
absl::StatusOr<Pem> ReadAll(const TlsFiles& f) {
  Pem pem;
  for (auto [path, what, out] :
       {std::tuple<const std::string&, const char*, std::string*>{f.cert, "certificate", &pem.cert},
        {f.key, "key", &pem.key},
        {f.ca, "CA", &pem.ca}}) {
    if (path.empty()) continue;
    absl::StatusOr<std::string> text = ReadPem(path, what);
    if (!text.ok()) return text.status();
    *out = *std::move(text);
  }
  return pem;
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
    return absl::InvalidArgumentError(
        "a TLS server needs its certificate and key (--tls_cert, --tls_key), not only a CA");
  }
  absl::StatusOr<Pem> pem = ReadAll(f);
  if (!pem.ok()) return pem.status();
  grpc::SslServerCredentialsOptions options;
  options.pem_key_cert_pairs.push_back({pem->key, pem->cert});
  if (!pem->ca.empty()) {
    options.pem_root_certs = pem->ca;
    options.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  return grpc::SslServerCredentials(options);
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentials(const TlsFiles& f) {
  if (!f.enabled()) return grpc::InsecureChannelCredentials();
  if (absl::Status s = CheckPair(f); !s.ok()) return s;
  absl::StatusOr<Pem> pem = ReadAll(f);
  if (!pem.ok()) return pem.status();
  grpc::SslCredentialsOptions options;
  options.pem_root_certs = pem->ca;  // "": the system's roots
  options.pem_cert_chain = pem->cert;
  options.pem_private_key = pem->key;
  return grpc::SslCredentials(options);
}

}  // namespace bertshard::common
