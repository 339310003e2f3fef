// bertshard-coordinator: serves the Coordinator API (Plan), health and reflection.
//
//   bertshard-coordinator --listen=0.0.0.0:50051 --drain_timeout=10s
//
// SIGTERM or SIGINT: health goes NOT_SERVING, new calls are refused, in-flight calls get
// --drain_timeout to finish, then the process exits 0.
#include <signal.h>

#include <cstdio>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/time/time.h"
#include "common/grpc_serving.h"
#include "server/coordinator_server.h"

ABSL_FLAG(std::string, listen, "0.0.0.0:50051", "host:port to serve on (port 0: any free port)");
ABSL_FLAG(absl::Duration, drain_timeout, absl::Seconds(10),
          "how long in-flight calls may run after SIGTERM/SIGINT");

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("bertshard coordinator: --listen=HOST:PORT [--drain_timeout=10s]");
  absl::ParseCommandLine(argc, argv);
  bertshard::server::CoordinatorOptions options;
  options.listen_address = absl::GetFlag(FLAGS_listen);
  const absl::Duration drain = absl::GetFlag(FLAGS_drain_timeout);

  bertshard::common::InstallShutdownHandlers();

  auto server = bertshard::server::CoordinatorServer::Start(options);
  if (!server.ok()) {
    std::fprintf(stderr, "bertshard-coordinator: %s\n", server.status().ToString().c_str());
    return 1;
  }
  std::printf("bertshard-coordinator listening on port %d\n", (*server)->port());
  std::fflush(stdout);
  std::thread waiter([&server, drain]() {
    bertshard::common::WaitForShutdownSignal("bertshard-coordinator");
    (*server)->Shutdown(drain);
  });
  (*server)->Wait();
  waiter.join();
  std::fprintf(stderr, "bertshard-coordinator: stopped\n");
  return 0;
}
