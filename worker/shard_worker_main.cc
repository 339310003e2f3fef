// shard-worker: the worker daemon. Serves the Worker API (LoadShard, Forward, Unload) with
// health and reflection; the coordinator drives it.
//
//   shard-worker --listen=0.0.0.0:50061 --threads=2
//
// SIGTERM or SIGINT: health goes NOT_SERVING, in-flight calls get --drain_timeout, then exit 0.
// A bad flag value exits 2.
#include <cstdio>
#include <memory>
#include <optional>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/time/time.h"
#include "common/grpc_auth.h"
#include "common/grpc_serving.h"
#include "common/grpc_tls.h"
#include "common/metrics.h"
#include "common/metrics_endpoint.h"
#include "common/model_root.h"
#include "model/gemm.h"
#include "worker/collectives_backend.h"
#include "worker/gpu_placement.h"
#include "worker/registration.h"
#include "worker/worker_service.h"

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
ABSL_FLAG(std::string, gemm, "auto",
          "CPU matrix products of loaded shards: blas (at::linear), onednn (MKL-DNN, weights prepacked at "
          "load), or auto (time both for each job's shape and threads at its load, take the faster)");

ABSL_FLAG(std::string, model_root, "",
          "directory tree checkpoints must lie in (relative checkpoint paths are taken under it; "
          "symbolic links leading out are refused); empty: any path this worker can read");

ABSL_FLAG(std::string, auth_token_file, "",
          "the cluster's bearer token (file; else $BERTSHARD_TOKEN): every RPC to this worker needs it, and it "
          "is sent with registrations and heartbeats; unset: none");

ABSL_FLAG(std::string, tls_cert, "",
          "PEM certificate chain: serve TLS (with --tls_key); also the client certificate "
          "presented to a coordinator that requires one");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert");
ABSL_FLAG(std::string, tls_ca, "",
          "PEM CA: callers (the coordinator) must present a certificate it signed (mutual TLS), and the "
          "coordinator is reached over TLS and verified against it");

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const auto model_root = bertshard::common::ModelRoot::Open(absl::GetFlag(FLAGS_model_root));
  if (!model_root.ok()) {
    std::fprintf(stderr, "shard-worker: --model_root: %s\n", std::string(model_root.status().message()).c_str());
    return 2;
  }
  const auto token = bertshard::common::LoadToken(absl::GetFlag(FLAGS_auth_token_file), "BERTSHARD_TOKEN");
  if (!token.ok()) {
    std::fprintf(stderr, "shard-worker: %s\n", std::string(token.status().message()).c_str());
    return 2;
  }
  const bertshard::common::TlsFiles tls{absl::GetFlag(FLAGS_tls_cert), absl::GetFlag(FLAGS_tls_key),
                                        absl::GetFlag(FLAGS_tls_ca)};
  const auto server_credentials = bertshard::common::ServerCredentials(tls);
  // The coordinator is dialled over TLS exactly when a CA says how to verify it.
  const auto coordinator_credentials =
      bertshard::common::ChannelCredentials(tls.ca.empty() ? bertshard::common::TlsFiles{} : tls);
  if (!server_credentials.ok() || !coordinator_credentials.ok()) {
    const absl::Status bad = !server_credentials.ok() ? server_credentials.status() : coordinator_credentials.status();
    std::fprintf(stderr, "shard-worker: %s\n", std::string(bad.message()).c_str());
    return 2;
  }
  const auto gemm = bertshard::model::ParseGemmFlag(absl::GetFlag(FLAGS_gemm));
  // Refused here rather than by every load: this LibTorch will not grow MKL-DNN.
  const absl::Status gemm_usable =
      !gemm.ok() ? gemm.status()
                 : bertshard::model::GemmPathAvailable(gemm->value_or(bertshard::model::GemmPath::kBlas));
  if (!gemm_usable.ok()) {
    std::fprintf(stderr, "shard-worker: %s\n", std::string(gemm_usable.message()).c_str());
    return 2;
  }
  const auto gpu = bertshard::worker::ParseWorkerDevice(absl::GetFlag(FLAGS_device));
  if (!gpu.ok()) {
    std::fprintf(stderr, "shard-worker: %s\n", std::string(gpu.status().message()).c_str());
    return 2;
  }
  std::string gpu_bus_id;  // reported to the coordinator, which places one rank per GPU by it
  if (*gpu >= 0) {
    // Refused at start, not at a job's load: a GPU worker this build or host cannot serve.
    const auto bus_id = bertshard::worker::WorkerGpuBusId(absl::GetFlag(FLAGS_device), *gpu);
    if (!bus_id.ok()) {
      std::fprintf(stderr, "shard-worker: %s\n", std::string(bus_id.status().message()).c_str());
      return 2;
    }
    gpu_bus_id = *bus_id;
  }
  bertshard::common::InstallShutdownHandlers();
  // Declared before the service, so they outlive it; the endpoint is stopped before the service goes.
  bertshard::common::MetricsRegistry metrics;
  std::optional<bertshard::worker::WorkerMetrics> worker_metrics;
  std::unique_ptr<bertshard::common::MetricsEndpoint> metrics_endpoint;
  if (const std::string address = absl::GetFlag(FLAGS_metrics_listen); !address.empty()) {
    auto registered = bertshard::worker::WorkerMetrics::Register(&metrics);
    auto endpoint = bertshard::common::MetricsEndpoint::Start(address, &metrics);
    if (!registered.ok() || !endpoint.ok()) {
      const absl::Status error = !registered.ok() ? registered.status() : endpoint.status();
      std::fprintf(stderr, "shard-worker: --metrics_listen: %s\n", error.ToString().c_str());
      return 1;
    }
    worker_metrics = *registered;
    metrics_endpoint = *std::move(endpoint);
  }
  // Ranks on other hosts reach this one at its advertised host: bind the collectives' transport there.
  std::string bind_host = absl::GetFlag(FLAGS_advertise);
  bind_host = bind_host.substr(0, bind_host.rfind(':'));
  if (bind_host.size() > 2 && bind_host.front() == '[' && bind_host.back() == ']') {
    bind_host = bind_host.substr(1, bind_host.size() - 2);
  }
  bertshard::worker::WorkerService service({.default_threads = absl::GetFlag(FLAGS_threads),
                                            .bind_host = bind_host,
                                            .metrics = worker_metrics ? &*worker_metrics : nullptr,
                                            .gemm = *gemm,
                                            .model_root = *model_root,
                                            .token = *token,
                                            .gpu = *gpu});
  bertshard::common::MetricsRegistry::CollectorHandle shards_loaded;
  if (metrics_endpoint != nullptr) {
    auto handle = service.ExportLoadedShards(&metrics);
    if (!handle.ok()) {
      std::fprintf(stderr, "shard-worker: --metrics_listen: %s\n", handle.status().ToString().c_str());
      return 1;
    }
    shards_loaded = *std::move(handle);
  }
  // Shard loads and forward outputs can be large.
  auto started = bertshard::common::StartServer(absl::GetFlag(FLAGS_listen), {&service}, 1 << 30,
                                                metrics_endpoint != nullptr ? &metrics : nullptr, *server_credentials);
  if (!started.ok()) {
    std::fprintf(stderr, "shard-worker: %s\n", started.status().ToString().c_str());
    return 1;
  }
  std::printf("shard-worker listening on port %d\n", started->port);
  if (metrics_endpoint != nullptr) std::printf("metrics listening on port %d\n", metrics_endpoint->port());
  std::fflush(stdout);
  const absl::Duration drain = absl::GetFlag(FLAGS_drain_timeout);
  std::unique_ptr<bertshard::worker::Registration> registration;
  if (!absl::GetFlag(FLAGS_coordinator).empty()) {
    std::string advertise = absl::GetFlag(FLAGS_advertise);
    if (advertise.empty()) advertise = "127.0.0.1:" + std::to_string(started->port);
    registration = std::make_unique<bertshard::worker::Registration>(bertshard::worker::RegistrationOptions{
        .coordinator = absl::GetFlag(FLAGS_coordinator),
        .advertise = advertise,
        .device = absl::GetFlag(FLAGS_device),
        .gpu_bus_id = gpu_bus_id,
        .held_shards = [&service] { return service.HeldShards(); },
        .unload = [&service](const std::string& job_id) { service.UnloadJob(job_id); },
        .token = *token,
        .credentials = *coordinator_credentials});
  }
  std::thread waiter([&started, &registration, drain]() {
    bertshard::common::WaitForShutdownSignal("shard-worker");
    registration.reset();  // leave the pool first (the coordinator fails our jobs), then drain
    bertshard::common::DrainAndShutdown(started->server.get(), drain);
  });
  started->server->Wait();
  waiter.join();
  metrics_endpoint.reset();  // stop serving scrapes before the service goes
  return 0;
}
