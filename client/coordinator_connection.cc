#include "client/coordinator_connection.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "common/grpc_auth.h"
#include "common/grpc_status.h"
#include "common/grpc_tls.h"
#include "grpcpp/create_channel.h"

namespace bertshard::client {

const std::vector<Flag>& ConnectionFlags() {
  static const auto* flags = new std::vector<Flag>{
      {"server", "HOST:PORT", "the coordinator (default $BERTSHARD_SERVER, else 127.0.0.1:50051)"},
      {"timeout", "SECONDS", "deadline of each call to the coordinator (default 30; longer for watch,\ninfer, embed)"},
      // Not the servers' --auth_token_file (the tokens they accept): the one token this client sends,
      // so no alias of that name. The TLS flags are the servers' own, spelled their way too.
      {"token-file",
       "FILE",
       "the bearer token a coordinator with tokens needs (default $BERTSHARD_TOKEN)",
       {"token_file"}},
      {"tls-ca",
       "FILE",
       "TLS: the CA that signed the coordinator's certificate (default $BERTSHARD_TLS_CA)",
       {"tls_ca"}},
      {"tls-cert", "FILE", "mutual TLS: this client's certificate (default $BERTSHARD_TLS_CERT)", {"tls_cert"}},
      {"tls-key", "FILE", "mutual TLS: its private key (default $BERTSHARD_TLS_KEY)", {"tls_key"}},
  };
  return *flags;
}

ServerAddress ResolveServerAddress(const CommandLine& cl) {
  if (auto it = cl.values.find("server"); it != cl.values.end()) return {it->second, "--server"};
  if (const char* env = std::getenv("BERTSHARD_SERVER")) return {env, "$BERTSHARD_SERVER"};
  return {"127.0.0.1:50051", "the default"};
}

absl::StatusOr<std::string> ClientToken(const CommandLine& cl) {
  const auto it = cl.values.find("token-file");
  return common::LoadToken(it == cl.values.end() ? "" : it->second, "BERTSHARD_TOKEN");
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ClientCredentials(const CommandLine& cl) {
  const auto flag = [&](const char* name, const char* env) {
    if (auto it = cl.values.find(name); it != cl.values.end()) return it->second;
    const char* value = std::getenv(env);
    return std::string(value == nullptr ? "" : value);
  };
  return common::ChannelCredentials({flag("tls-cert", "BERTSHARD_TLS_CERT"), flag("tls-key", "BERTSHARD_TLS_KEY"),
                                     flag("tls-ca", "BERTSHARD_TLS_CA")});
}

absl::Status DescribeCallError(const absl::Status& status, const ServerAddress& server, bool connected) {
  const bool unreachable = !connected && (status.code() == absl::StatusCode::kUnavailable ||
                                          status.code() == absl::StatusCode::kDeadlineExceeded);
  if (!unreachable) return status;
  return absl::Status(status.code(), absl::StrCat("coordinator at ", server.address, " (", server.source,
                                                  ") could not be reached: ", status.message(),
                                                  "; is it running there? Give its address with ", server.how_to_set));
}

absl::StatusOr<CoordinatorConnection> CoordinatorConnection::Open(const CommandLine& cl, ServerAddress server,
                                                                  int max_receive_bytes) {
  CoordinatorConnection c;
  c.server_ = std::move(server);
  // A token file or TLS files that cannot be used are the caller's mistake, said before any call.
  auto token = ClientToken(cl);
  if (!token.ok()) return token.status();
  c.token_ = *std::move(token);
  auto credentials = ClientCredentials(cl);
  if (!credentials.ok()) return credentials.status();
  if (auto it = cl.values.find("timeout"); it != cl.values.end()) {
    c.timeout_seconds_ = std::max<int64_t>(1, std::atoll(it->second.c_str()));
  }
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(max_receive_bytes);
  c.channel_ = grpc::CreateCustomChannel(c.server_.address, *credentials, args);
  c.stub_ = v1::Coordinator::NewStub(c.channel_);
  return c;
}

std::unique_ptr<grpc::ClientContext> CoordinatorConnection::Context(int default_seconds) const {
  const int64_t seconds = timeout_seconds_ > 0 ? timeout_seconds_ : default_seconds;
  auto context = std::make_unique<grpc::ClientContext>();
  context->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(seconds));
  common::AttachToken(context.get(), token_);
  return context;
}

absl::Status CoordinatorConnection::Check(const grpc::Status& status) const {
  if (status.ok()) return absl::OkStatus();
  // A coordinator that answered (UNAVAILABLE while a job recovers, say) leaves the channel READY.
  return DescribeCallError(common::FromGrpcStatus(status), server_,
                           channel_->GetState(/*try_to_connect=*/false) == GRPC_CHANNEL_READY);
}

}  // namespace bertshard::client
