// File: common/grpc_auth.h
// -----------------------------------------------------------------------------
// Optional bearer tokens on bertshard's RPCs ("authorization: Bearer <token>" metadata).
//
// Two tokens, each off when empty:
//   - the admin token: the cluster's own. It is needed for every RPC that changes state (submit,
//     cancel, worker registration and heartbeats, and every call to a worker), and is what the
//     coordinator and the workers present to each other.
//   - the read token: when set, every other RPC (plans, job and worker listings, watches,
//     inference) needs it or the admin token.
// A missing or unknown token is UNAUTHENTICATED ("no valid credentials"); the read token on an RPC
// that needs the admin token is PERMISSION_DENIED ("authenticated, not allowed"), as gRPC defines
// the two codes. Health and reflection stay open (probes and grpcurl's listing need no secret).
//
// Tokens never appear in a message, log line, job record or metric: refusals say which token was
// missing or wrong, never what was sent.
//
// Thread safety: thread-safe (pure functions; AuthConfig is a value).
#ifndef BERTSHARD_COMMON_GRPC_AUTH_H_
#define BERTSHARD_COMMON_GRPC_AUTH_H_

#include <string>

#include "absl/status/statusor.h"
#include "grpcpp/client_context.h"
#include "grpcpp/server_context.h"
#include "grpcpp/support/status.h"

namespace bertshard::common {

struct AuthConfig {
  std::string admin_token;  // empty: no RPC needs a token
  std::string read_token;   // empty: RPCs that change nothing are open
};

enum class Access { kRead, kAdmin };

// The token in `file` (surrounding whitespace trimmed), else in environment variable `env` (when
// non-null and set), else "". INVALID_ARGUMENT when the file cannot be read or holds no token,
// or the token has characters an HTTP/2 header value cannot carry.
absl::StatusOr<std::string> LoadToken(const std::string& file, const char* env);

// OK when the call may proceed with `needed` access under `auth`.
grpc::Status CheckAccess(const grpc::ServerContext& context, const AuthConfig& auth, Access needed);

// Sends `token` with the call (nothing when empty).
void AttachToken(grpc::ClientContext* context, const std::string& token);

}  // namespace bertshard::common

#endif  // BERTSHARD_COMMON_GRPC_AUTH_H_
