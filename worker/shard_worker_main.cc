// shard-worker: the worker daemon. Serves the Worker API (LoadShard, Forward, Unload) with
// health and reflection; the coordinator drives it.
//
//   shard-worker --listen=0.0.0.0:50061 --threads=2
//
// SIGTERM or SIGINT: health goes NOT_SERVING, in-flight calls get --drain_timeout, then exit 0.
#include <cstdio>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/time/time.h"
#include "common/grpc_serving.h"
#include "worker/registration.h"
#include "worker/worker_service.h"

ABSL_FLAG(std::string, listen, "0.0.0.0:50061", "host:port to serve on (port 0: any free port)");
ABSL_FLAG(int, threads, 1, "LibTorch threads per loaded job, unless the load request says");
ABSL_FLAG(absl::Duration, drain_timeout, absl::Seconds(10), "how long in-flight calls may run after SIGTERM/SIGINT");
ABSL_FLAG(std::string, coordinator, "", "coordinator host:port to register with (none: serve unregistered)");
ABSL_FLAG(std::string, advertise, "", "host:port the coordinator reaches this worker at; default 127.0.0.1:<port>");

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  bertshard::common::InstallShutdownHandlers();
  bertshard::worker::WorkerService service({.default_threads = absl::GetFlag(FLAGS_threads)});
  // Shard loads and forward outputs can be large.
  auto started = bertshard::common::StartServer(absl::GetFlag(FLAGS_listen), {&service}, 1 << 30);
  if (!started.ok()) {
    std::fprintf(stderr, "shard-worker: %s\n", started.status().ToString().c_str());
    return 1;
  }
  std::printf("shard-worker listening on port %d\n", started->port);
  std::fflush(stdout);
  const absl::Duration drain = absl::GetFlag(FLAGS_drain_timeout);
  std::unique_ptr<bertshard::worker::Registration> registration;
  if (!absl::GetFlag(FLAGS_coordinator).empty()) {
    std::string advertise = absl::GetFlag(FLAGS_advertise);
    if (advertise.empty()) advertise = "127.0.0.1:" + std::to_string(started->port);
    registration = std::make_unique<bertshard::worker::Registration>(absl::GetFlag(FLAGS_coordinator), advertise);
  }
  std::thread waiter([&started, &registration, drain]() {
    bertshard::common::WaitForShutdownSignal("shard-worker");
    registration.reset();  // stop heartbeating first: the coordinator then fails our jobs
    bertshard::common::DrainAndShutdown(started->server.get(), drain);
  });
  started->server->Wait();
  waiter.join();
  return 0;
}
