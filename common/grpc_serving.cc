#include "common/grpc_serving.h"

#include <signal.h>
#include <unistd.h>

#include <cerrno>

#include <cstdio>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"

namespace bertshard::common {

absl::StatusOr<StartedServer> StartServer(const std::string& address, const std::vector<grpc::Service*>& services,
                                          int max_message_bytes) {
  if (address.empty() || !absl::StrContains(address, ':')) {
    return absl::InvalidArgumentError(absl::StrCat("listen address '", address, "' is not host:port (e.g. 0.0.0.0:50051)"));
  }
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  StartedServer started;
  builder.AddListeningPort(address, grpc::InsecureServerCredentials(), &started.port);
  // gRPC sets SO_REUSEPORT by default: a second server would silently share the port.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.SetMaxReceiveMessageSize(max_message_bytes);
  builder.SetMaxSendMessageSize(max_message_bytes);
  for (grpc::Service* service : services) builder.RegisterService(service);
  started.server = builder.BuildAndStart();
  if (started.server == nullptr || started.port == 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", address, " (address in use, or not an address of this machine)"));
  }
  started.server->GetHealthCheckService()->SetServingStatus(true);
  return started;
}

void DrainAndShutdown(grpc::Server* server, absl::Duration drain) {
  server->GetHealthCheckService()->SetServingStatus(false);
  server->Shutdown(absl::ToChronoTime(absl::Now() + drain));
}

namespace {

// The handler only writes to this pipe (async-signal-safe); WaitForShutdownSignal reads it.
int signal_pipe[2] = {-1, -1};

void OnShutdownSignal(int signal) {
  const char byte = static_cast<char>(signal);
  const ssize_t ignored = write(signal_pipe[1], &byte, 1);
  (void)ignored;
}

}  // namespace

void InstallShutdownHandlers() {
  if (signal_pipe[0] < 0 && pipe(signal_pipe) != 0) return;
  struct sigaction action {};
  action.sa_handler = OnShutdownSignal;
  sigemptyset(&action.sa_mask);
  sigaction(SIGTERM, &action, nullptr);
  sigaction(SIGINT, &action, nullptr);
}

void WaitForShutdownSignal(const char* program) {
  char byte = 0;
  while (read(signal_pipe[0], &byte, 1) < 0 && errno == EINTR) {
  }
  std::fprintf(stderr, "%s: signal %d, draining\n", program, static_cast<int>(byte));
}

}  // namespace bertshard::common
