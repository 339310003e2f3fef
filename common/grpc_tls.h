// File: common/grpc_tls.h
// -----------------------------------------------------------------------------
// TLS and mutual TLS for bertshard's gRPC servers and channels, from PEM files.
//
// One set of files per process: `cert` + `key` are its identity (what its server presents, and
// what its channels present where the peer asks for a client certificate), `ca` the authority its
// peers' certificates must chain to.
//   - none set: plaintext (a private network; the default).
//   - server: cert + key serve TLS; with ca as well, clients must present a certificate that ca
//     signed (mutual TLS), and others are refused at the handshake.
//   - channel: ca set: TLS, the server's certificate verified against ca (and its name against the
//     address dialled); cert + key, when set, are presented as the client certificate.
// The workers' rendezvous and collectives (Gloo, NCCL) are not gRPC: the rendezvous is
// authenticated per job (worker/auth_store.h) but neither is encrypted on the cluster network:
// keep it private (docs/RELIABILITY.md, README).
//
// Thread safety: thread-safe (pure functions).
#ifndef BERTSHARD_COMMON_GRPC_TLS_H_
#define BERTSHARD_COMMON_GRPC_TLS_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"

namespace bertshard::common {

struct TlsFiles {
  std::string cert;  // PEM certificate chain
  std::string key;   // PEM private key
  std::string ca;    // PEM root(s) peers are verified against
  bool enabled() const { return !cert.empty() || !key.empty() || !ca.empty(); }
};

// INVALID_ARGUMENT when a file cannot be read or is not PEM, or cert and key are not given
// together (and, for a server, when ca comes without them).
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentials(const TlsFiles& files);
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentials(const TlsFiles& files);

}  // namespace bertshard::common

#endif  // BERTSHARD_COMMON_GRPC_TLS_H_
