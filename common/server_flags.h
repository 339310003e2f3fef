// File: common/server_flags.h
// -----------------------------------------------------------------------------
// The security flags both bertshard servers (bertshard-coordinator, shard-worker) take, defined
// once, and what they turn into:
//   --auth_token_file   the cluster's bearer token (file; else $BERTSHARD_TOKEN; common/grpc_auth.h)
//   --tls_cert, --tls_key, --tls_ca   the server's TLS identity and the CA its peers must chain to
//                                     (common/grpc_tls.h)
// Each server serves with `server_credentials` and dials its peers (the coordinator its workers,
// a worker its coordinator) with `peer_credentials`: TLS exactly when a CA says how to verify
// them, presenting the server's own certificate where the peer asks for one.
//
// Example (in main, after absl::ParseCommandLine):
//   absl::StatusOr<ServerSecurity> security = LoadServerSecurity(SecurityFlags());
//   if (!security.ok()) { print security.status(); return 2; }
//
// Errors: INVALID_ARGUMENT naming what is wrong when a file cannot be read, is not PEM or holds no
// token, or the TLS files do not go together; never a token's text.
//
// Thread safety: SecurityFlags reads the flags (after parsing); LoadServerSecurity is a pure
// function of the files.
#ifndef BERTSHARD_COMMON_SERVER_FLAGS_H_
#define BERTSHARD_COMMON_SERVER_FLAGS_H_

#include <memory>
#include <string>

#include "absl/flags/declare.h"
#include "absl/status/statusor.h"
#include "common/grpc_tls.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"

ABSL_DECLARE_FLAG(std::string, auth_token_file);
ABSL_DECLARE_FLAG(std::string, tls_cert);
ABSL_DECLARE_FLAG(std::string, tls_key);
ABSL_DECLARE_FLAG(std::string, tls_ca);

namespace bertshard::common {

// Where a server's secrets are (the flags above).
struct SecurityFiles {
  std::string token_file;  // empty: $BERTSHARD_TOKEN, else no token
  TlsFiles tls;
};

struct ServerSecurity {
  std::string token;                                            // the cluster's bearer token; empty: none
  std::shared_ptr<grpc::ServerCredentials> server_credentials;  // plaintext without TLS files
  std::shared_ptr<grpc::ChannelCredentials> peer_credentials;   // plaintext without --tls_ca
};

// The flags' values.
SecurityFiles SecurityFlags();

absl::StatusOr<ServerSecurity> LoadServerSecurity(const SecurityFiles& files);

}  // namespace bertshard::common

#endif  // BERTSHARD_COMMON_SERVER_FLAGS_H_
