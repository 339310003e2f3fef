#include "common/server_flags.h"

#include "absl/flags/flag.h"
#include "common/grpc_auth.h"

ABSL_FLAG(std::string, auth_token_file, "",
          "the cluster's bearer token (file; else $BERTSHARD_TOKEN). The coordinator asks it of every RPC that "
          "changes state (submit, cancel, worker registration) and sends it to the workers; a worker asks it of "
          "every RPC and sends it with its registrations and heartbeats. Unset: none");
ABSL_FLAG(std::string, tls_cert, "",
          "PEM certificate chain: serve TLS (with --tls_key); also the client certificate presented to the "
          "peers that require one (the coordinator's workers, a worker's coordinator)");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert");
ABSL_FLAG(std::string, tls_ca, "",
          "PEM CA: callers must present a certificate it signed (mutual TLS), and the peers (workers, or the "
          "coordinator) are reached over TLS and verified against it");

namespace bertshard::common {

SecurityFiles SecurityFlags() {
  return {absl::GetFlag(FLAGS_auth_token_file),
          {absl::GetFlag(FLAGS_tls_cert), absl::GetFlag(FLAGS_tls_key), absl::GetFlag(FLAGS_tls_ca)}};
}

absl::StatusOr<ServerSecurity> LoadServerSecurity(const SecurityFiles& files) {
  ServerSecurity security;
  absl::StatusOr<std::string> token = LoadToken(files.token_file, "BERTSHARD_TOKEN");
  if (!token.ok()) return token.status();
  security.token = *std::move(token);
  auto server_credentials = ServerCredentials(files.tls);
  if (!server_credentials.ok()) return server_credentials.status();
  security.server_credentials = *std::move(server_credentials);
  // Peers are dialled over TLS exactly when a CA says how to verify them.
  auto peer_credentials = ChannelCredentials(files.tls.ca.empty() ? TlsFiles{} : files.tls);
  if (!peer_credentials.ok()) return peer_credentials.status();
  security.peer_credentials = *std::move(peer_credentials);
  return security;
}

}  // namespace bertshard::common
