// File: client/coordinator_connection.h
// -----------------------------------------------------------------------------
// How shardctl reaches a coordinator: the flags every coordinator command takes (--server,
// --timeout, the bearer token and TLS files), the channel they make, each call's deadline and
// token, and the errors of a coordinator that could not be reached, which name the address tried,
// where it came from and how to give another (gRPC alone says "failed to connect to all
// addresses").
//
// Example:
//   ASSIGN_OR_RETURN(CoordinatorConnection c, CoordinatorConnection::Open(cl, ResolveServerAddress(cl)));
//   v1::ListJobsResponse jobs;
//   RETURN_IF_ERROR(c.Check(c.stub()->ListJobs(c.Context(30).get(), {}, &jobs)));
//
// Failure model: Open is INVALID_ARGUMENT for token or TLS files that cannot be used, before any
// call; Check turns a failed call into a status (an unreachable coordinator keeps its code,
// UNAVAILABLE or DEADLINE_EXCEEDED, with the address in the message).
// Thread safety: thread-compatible (a connection's stub is thread-safe, as gRPC's are).
#ifndef BERTSHARD_CLIENT_COORDINATOR_CONNECTION_H_
#define BERTSHARD_CLIENT_COORDINATOR_CONNECTION_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "bertshard/v1/coordinator.grpc.pb.h"
#include "client/command_line.h"
#include "grpcpp/channel.h"
#include "grpcpp/security/credentials.h"

namespace bertshard::client {

// --server, --timeout, --token-file and the TLS files (with the servers' spellings as aliases).
// `plan` reads --server as "ask a coordinator" (it plans locally without); the others always do.
const std::vector<Flag>& ConnectionFlags();

// The address to call, where it came from ("--server", "$BERTSHARD_SERVER" or "the default"), and
// how a user gives another, for the message when nothing answers there.
struct ServerAddress {
  std::string address;
  std::string source;
  std::string how_to_set = "--server HOST:PORT or $BERTSHARD_SERVER";
};
// --server, else $BERTSHARD_SERVER, else 127.0.0.1:50051.
ServerAddress ResolveServerAddress(const CommandLine& cl);

// The bearer token the coordinator calls carry (common/grpc_auth.h): --token-file, else
// $BERTSHARD_TOKEN, else none. INVALID_ARGUMENT when the file cannot be read or is empty.
absl::StatusOr<std::string> ClientToken(const CommandLine& cl);

// The channel credentials of coordinator calls (common/grpc_tls.h): --tls-ca, --tls-cert and
// --tls-key, else $BERTSHARD_TLS_CA, $BERTSHARD_TLS_CERT and $BERTSHARD_TLS_KEY; plaintext when
// none is set. INVALID_ARGUMENT for unreadable or non-PEM files, or a certificate without its key.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ClientCredentials(const CommandLine& cl);

// `status` of a call to `server` as shardctl reports it: an UNAVAILABLE or DEADLINE_EXCEEDED call
// on a channel that is not connected says that the coordinator at that address could not be
// reached and how to give its address; any other status is kept as it is.
absl::Status DescribeCallError(const absl::Status& status, const ServerAddress& server, bool connected);

class CoordinatorConnection {
 public:
  // A channel to `server` with ClientCredentials(cl) and ClientToken(cl); `max_receive_bytes`
  // bounds one response.
  static absl::StatusOr<CoordinatorConnection> Open(const CommandLine& cl, ServerAddress server,
                                                    int max_receive_bytes = 1 << 30);

  v1::Coordinator::Stub* stub() const { return stub_.get(); }
  const ServerAddress& server() const { return server_; }

  // A context for one call: the token, and a deadline of --timeout seconds (at least 1), else
  // `default_seconds`.
  std::unique_ptr<grpc::ClientContext> Context(int default_seconds) const;

  // The call's status, with DescribeCallError's wording when the coordinator was not reached.
  absl::Status Check(const grpc::Status& status) const;

 private:
  CoordinatorConnection() = default;

  ServerAddress server_;
  std::string token_;
  int64_t timeout_seconds_ = 0;  // 0: the call's default
  std::shared_ptr<grpc::Channel> channel_;
  std::shared_ptr<v1::Coordinator::Stub> stub_;
};

}  // namespace bertshard::client

#endif  // BERTSHARD_CLIENT_COORDINATOR_CONNECTION_H_
