// shard-worker: the worker daemon. Serves the Worker API (ReservePort, LoadShard, Forward,
// Unload) with health and reflection, and optionally Prometheus metrics; registers with the
// coordinator, which drives it, and heartbeats to it.
//
//   shard-worker --listen=0.0.0.0:50061 --coordinator=coord:50051 --threads=2
//
// SIGTERM or SIGINT: it leaves the coordinator's pool, health goes NOT_SERVING, in-flight calls get
// --drain_timeout, then exit 0. A bad flag value exits 2.
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/grpc_auth.h"
#include "common/grpc_serving.h"
#include "common/metrics.h"
#include "common/metrics_endpoint.h"
#include "common/model_root.h"
#include "common/server_flags.h"
#include "model/gemm.h"
#include "model/gemm_flag.h"
#include "worker/collectives_backend.h"
#include "worker/gpu_placement.h"
#include "worker/registration.h"
#include "worker/shm_group.h"
#include "worker/worker_service.h"

// --auth_token_file and --tls_cert, --tls_key, --tls_ca: common/server_flags.h.
ABSL_FLAG(std::string, listen, "0.0.0.0:50061", "host:port to serve on (port 0: any free port)");
ABSL_FLAG(std::string, device, "cpu",
          "what this worker's jobs run on: cpu (Gloo) or cuda:N (NCCL on GPU N; a --config=cuda build). Reported "
          "to the coordinator, which places one rank per GPU of a host");
ABSL_FLAG(int, threads, 1, "LibTorch threads per loaded job, unless the load request says");
ABSL_FLAG(absl::Duration, drain_timeout, absl::Seconds(10), "how long in-flight calls may run after SIGTERM/SIGINT");
ABSL_FLAG(std::string, coordinator, "", "coordinator host:port to register with (none: serve unregistered)");
ABSL_FLAG(std::string, advertise, "", "host:port the coordinator reaches this worker at; default 127.0.0.1:<port>");
ABSL_FLAG(std::string, metrics_listen, "",
          "host:port for the Prometheus endpoint GET /metrics (port 0: any free port; empty: none)");
ABSL_FLAG(std::string, read_token_file, "",
          "the cluster's read token (file; else $BERTSHARD_READ_TOKEN; needs --auth_token_file): when set, GET "
          "/metrics (which names jobs) needs it or the cluster token as a bearer token");
ABSL_FLAG(std::string, gemm, "auto",
          "CPU matrix products of loaded shards: blas (at::linear), onednn (MKL-DNN, weights prepacked at "
          "load), or auto (time both for each job's shape and threads at its load, take the faster)");
ABSL_FLAG(std::string, model_root, "",
          "directory tree checkpoints must lie in (relative checkpoint paths are taken under it; symbolic links "
          "leading out and files with more than one hard link are refused); empty: any path this worker can read");
ABSL_FLAG(int64_t, max_checkpoint_json_bytes, bertshard::common::kMaxCheckpointJsonBytes,
          "most bytes read of a checkpoint's model.safetensors.index.json; a larger one is refused");

namespace bertshard::worker {
namespace {

// What the flags ask the worker to serve.
struct ServeOptions {
  WorkerServiceOptions service;  // its metrics are set at start
  std::string listen;
  std::string metrics_listen;
  std::vector<std::string> metrics_tokens;  // what a scrape must present; empty: open
  std::string coordinator;                  // empty: serve unregistered
  std::string advertise;                    // empty: 127.0.0.1:<the port served>
  std::string device;
  std::string gpu_bus_id;
  std::shared_ptr<grpc::ServerCredentials> server_credentials;
  std::shared_ptr<grpc::ChannelCredentials> coordinator_credentials;
  absl::Duration drain;
};

// The flags' values, checked: INVALID_ARGUMENT (or FAILED_PRECONDITION for a device this build or
// host cannot serve) naming the bad one.
absl::StatusOr<ServeOptions> ServeOptionsFromFlags() {
  ServeOptions serve;
  const auto model_root = common::ModelRoot::Open(absl::GetFlag(FLAGS_model_root),
                                                  {.max_json_bytes = absl::GetFlag(FLAGS_max_checkpoint_json_bytes)});
  if (!model_root.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--model_root: ", model_root.status().message()));
  }
  absl::StatusOr<common::ServerSecurity> security = common::LoadServerSecurity(common::SecurityFlags());
  if (!security.ok()) return security.status();
  const auto gemm = model::ParseGemmFlag(absl::GetFlag(FLAGS_gemm));
  if (!gemm.ok()) return gemm.status();
  // Refused here rather than by every load: this LibTorch will not grow MKL-DNN.
  if (absl::Status usable = model::GemmPathAvailable(gemm->value_or(model::GemmPath::kBlas)); !usable.ok()) {
    return usable;
  }
  serve.device = absl::GetFlag(FLAGS_device);
  const auto gpu = ParseWorkerDevice(serve.device);
  if (!gpu.ok()) return gpu.status();
  if (*gpu >= 0) {
    // Refused at start, not at a job's load: a GPU worker this build or host cannot serve. The bus
    // id is reported to the coordinator, which places one rank per GPU by it.
    absl::StatusOr<std::string> bus_id = WorkerGpuBusId(serve.device, *gpu);
    if (!bus_id.ok()) return bus_id.status();
    serve.gpu_bus_id = *bus_id;
  }
  serve.advertise = absl::GetFlag(FLAGS_advertise);
  // Ranks on other hosts reach this one at its advertised host: bind the collectives' transport and
  // the rendezvous stores there (and only there).
  const absl::StatusOr<std::string> bind_host = AdvertisedHost(serve.advertise);
  if (!bind_host.ok()) return bind_host.status();
  serve.service = {.default_threads = absl::GetFlag(FLAGS_threads),
                   .bind_host = *bind_host,
                   .gemm = *gemm,
                   .model_root = *model_root,
                   .token = security->token,
                   .gpu = *gpu};
  serve.listen = absl::GetFlag(FLAGS_listen);
  serve.metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  const absl::StatusOr<std::string> read =
      common::LoadToken(absl::GetFlag(FLAGS_read_token_file), "BERTSHARD_READ_TOKEN");
  if (!read.ok()) return absl::InvalidArgumentError(read.status().message());
  if (!read->empty() && security->token.empty()) {
    return absl::InvalidArgumentError("a read token needs the cluster token (--auth_token_file)");
  }
  if (!read->empty()) serve.metrics_tokens = {*read, security->token};
  serve.coordinator = absl::GetFlag(FLAGS_coordinator);
  serve.server_credentials = security->server_credentials;
  serve.coordinator_credentials = security->peer_credentials;
  serve.drain = absl::GetFlag(FLAGS_drain_timeout);
  return serve;
}

// Serves until SIGTERM/SIGINT, then leaves the pool and drains. The exit code: 0, or 1 when it
// cannot start.
int RunServer(ServeOptions serve) {
  common::InstallShutdownHandlers();
  // Shared-memory segments left by ranks that were killed before they could unlink them (their
  // pages stay in RAM until removed): only this user's, only those whose creator is gone.
  if (absl::StatusOr<int> swept = SweepStaleSegments(); !swept.ok()) {
    std::fprintf(stderr, "shard-worker: %s\n", swept.status().ToString().c_str());
  } else if (*swept > 0) {
    std::fprintf(stderr, "shard-worker: removed %d stale shared-memory segment(s) from /dev/shm\n", *swept);
  }
  // Declared before the service, so they outlive it; the endpoint is stopped before the service goes.
  common::MetricsRegistry metrics;
  std::optional<WorkerMetrics> worker_metrics;
  std::unique_ptr<common::MetricsEndpoint> metrics_endpoint;
  if (!serve.metrics_listen.empty()) {
    auto registered = WorkerMetrics::Register(&metrics);
    auto endpoint = common::MetricsEndpoint::Start(serve.metrics_listen, &metrics, serve.metrics_tokens);
    if (!registered.ok() || !endpoint.ok()) {
      const absl::Status error = !registered.ok() ? registered.status() : endpoint.status();
      std::fprintf(stderr, "shard-worker: --metrics_listen: %s\n", error.ToString().c_str());
      return 1;
    }
    worker_metrics = *registered;
    metrics_endpoint = *std::move(endpoint);
    serve.service.metrics = &*worker_metrics;
  }
  WorkerService service(serve.service);
  common::MetricsRegistry::CollectorHandle shards_loaded;
  if (metrics_endpoint != nullptr) {
    auto handle = service.ExportLoadedShards(&metrics);
    if (!handle.ok()) {
      std::fprintf(stderr, "shard-worker: --metrics_listen: %s\n", handle.status().ToString().c_str());
      return 1;
    }
    shards_loaded = *std::move(handle);
  }
  // Shard loads and forward outputs can be large.
  auto started = common::StartServer(serve.listen, {&service}, 1 << 30,
                                     metrics_endpoint != nullptr ? &metrics : nullptr, serve.server_credentials);
  if (!started.ok()) {
    std::fprintf(stderr, "shard-worker: %s\n", started.status().ToString().c_str());
    return 1;
  }
  std::printf("shard-worker listening on port %d\n", started->port);
  if (metrics_endpoint != nullptr) std::printf("metrics listening on port %d\n", metrics_endpoint->port());
  std::fflush(stdout);
  std::unique_ptr<Registration> registration;
  if (!serve.coordinator.empty()) {
    const std::string advertise =
        serve.advertise.empty() ? "127.0.0.1:" + std::to_string(started->port) : serve.advertise;
    registration = std::make_unique<Registration>(
        RegistrationOptions{.coordinator = serve.coordinator,
                            .advertise = advertise,
                            .device = serve.device,
                            .gpu_bus_id = serve.gpu_bus_id,
                            .held_shards = [&service] { return service.HeldShards(); },
                            .unload = [&service](const std::string& job_id) { service.UnloadJob(job_id); },
                            .token = serve.service.token,
                            .credentials = serve.coordinator_credentials});
  }
  std::thread waiter([&started, &registration, drain = serve.drain]() {
    common::WaitForShutdownSignal("shard-worker");
    registration.reset();  // leave the pool first (the coordinator fails our jobs), then drain
    common::DrainAndShutdown(started->server.get(), drain);
  });
  started->server->Wait();
  waiter.join();
  metrics_endpoint.reset();  // stop serving scrapes before the service goes
  return 0;
}

}  // namespace
}  // namespace bertshard::worker

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  absl::StatusOr<bertshard::worker::ServeOptions> serve = bertshard::worker::ServeOptionsFromFlags();
  if (!serve.ok()) {
    std::fprintf(stderr, "shard-worker: %s\n", std::string(serve.status().message()).c_str());
    return 2;
  }
  return bertshard::worker::RunServer(*std::move(serve));
}
