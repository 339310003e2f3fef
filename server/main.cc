// bertshard-coordinator: serves the Coordinator API (Plan), health and reflection.
//
//   bertshard-coordinator --listen=0.0.0.0:50051 --drain_timeout=10s [--metrics_listen=0.0.0.0:9090]
//
// SIGTERM or SIGINT: health goes NOT_SERVING, new calls are refused, in-flight calls get
// --drain_timeout to finish, then the process exits 0.
#include <signal.h>

#include <cstdio>
#include <filesystem>
#include <memory>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/time/time.h"
#include "common/grpc_auth.h"
#include "common/grpc_serving.h"
#include "common/grpc_tls.h"
#include "common/metrics.h"
#include "common/metrics_endpoint.h"
#include "common/model_root.h"
#include "server/coordinator_server.h"

ABSL_FLAG(std::string, listen, "0.0.0.0:50051", "host:port to serve on (port 0: any free port)");
ABSL_FLAG(absl::Duration, drain_timeout, absl::Seconds(10), "how long in-flight calls may run after SIGTERM/SIGINT");
ABSL_FLAG(std::string, data_dir, "bertshard-data", "directory for the coordinator's state");
ABSL_FLAG(std::string, model_root, "",
          "directory tree checkpoints must lie in (relative checkpoint paths are taken under it; "
          "symbolic links leading out are refused); empty: any path the coordinator can read");
ABSL_FLAG(std::string, database, "", "job database (SQLite); default <data_dir>/jobs.db");
ABSL_FLAG(absl::Duration, heartbeat_interval, absl::Seconds(1),
          "workers' heartbeat interval; a worker silent for --missed_heartbeats intervals is dead");
ABSL_FLAG(int, missed_heartbeats, 3,
          "a worker silent for this many heartbeat intervals is dead and its job fails (at least 2)");
ABSL_FLAG(int, collective_timeout_s, 60, "rendezvous and collective timeout on the workers, seconds");
ABSL_FLAG(absl::Duration, readopt_grace, absl::Seconds(10),
          "after a restart, how long READY and LOADING jobs wait for all their ranks' workers to register");
ABSL_FLAG(std::string, metrics_listen, "",
          "host:port for the Prometheus endpoint GET /metrics (port 0: any free port; empty: none)");
// Dynamic batching of each job's Infer/Embed calls (TEI's defaults for the token budget).
ABSL_FLAG(int64_t, max_batch_tokens, 16384,
          "most padded tokens (rows x padded length) in one merged forward; a request larger on its own is refused");
ABSL_FLAG(int, max_batch_requests, 32, "most Infer/Embed requests merged into one forward");
ABSL_FLAG(int, max_batch_delay_ms, 0,
          "how long the first request of a batch may wait for others (0: none; requests arriving while a forward "
          "runs are merged anyway)");
ABSL_FLAG(int, max_batch_regroup_ms, 5,
          "after a forward that answered k requests, how long the next batch may wait for k requests to come in "
          "(its callers sending again), so closed-loop clients merge instead of alternating between two batches; "
          "ends early once k came in or the batch is full (0: no regrouping)");

ABSL_FLAG(std::string, auth_token_file, "",
          "the cluster's bearer token (file; else $BERTSHARD_TOKEN): RPCs that change state (submit, cancel, "
          "worker registration) need it, and it is sent to the workers; unset: none");
ABSL_FLAG(std::string, read_token_file, "",
          "a read-only bearer token (file; else $BERTSHARD_READ_TOKEN; needs --auth_token_file): when set, every "
          "other RPC (plans, listings, watches, inference) needs it or the cluster token");

ABSL_FLAG(std::string, tls_cert, "",
          "PEM certificate chain: serve TLS (with --tls_key); also the client certificate "
          "presented to workers that require one");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert");
ABSL_FLAG(std::string, tls_ca, "",
          "PEM CA: clients must present a certificate it signed (mutual TLS), and workers are reached over "
          "TLS and verified against it");

ABSL_FLAG(int, max_jobs_per_client, 16,
          "jobs one client (TLS certificate name, else host) may have that have not ended; 0: no limit");
ABSL_FLAG(int, max_message_bytes, 256 << 20, "largest request or response message, bytes");

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("bertshard coordinator: --listen=HOST:PORT [--drain_timeout=10s]");
  absl::ParseCommandLine(argc, argv);
  bertshard::server::CoordinatorOptions options;
  options.listen_address = absl::GetFlag(FLAGS_listen);
  options.cluster.database_path = absl::GetFlag(FLAGS_database);
  if (options.cluster.database_path.empty()) {
    const std::string dir = absl::GetFlag(FLAGS_data_dir);
    std::error_code error;
    std::filesystem::create_directories(dir, error);
    if (error) {
      std::fprintf(stderr, "bertshard-coordinator: cannot create %s: %s\n", dir.c_str(), error.message().c_str());
      return 1;
    }
    options.cluster.database_path = dir + "/jobs.db";
  }
  if (auto root = bertshard::common::ModelRoot::Open(absl::GetFlag(FLAGS_model_root)); root.ok()) {
    options.cluster.model_root = *root;
  } else {
    std::fprintf(stderr, "bertshard-coordinator: --model_root: %s\n", std::string(root.status().message()).c_str());
    return 2;
  }
  {
    const auto admin = bertshard::common::LoadToken(absl::GetFlag(FLAGS_auth_token_file), "BERTSHARD_TOKEN");
    const auto read = bertshard::common::LoadToken(absl::GetFlag(FLAGS_read_token_file), "BERTSHARD_READ_TOKEN");
    const absl::Status bad = !admin.ok() ? admin.status() : read.status();
    if (!bad.ok()) {
      std::fprintf(stderr, "bertshard-coordinator: %s\n", std::string(bad.message()).c_str());
      return 2;
    }
    if (admin->empty() && !read->empty()) {
      std::fprintf(stderr, "bertshard-coordinator: a read token needs the cluster token (--auth_token_file)\n");
      return 2;
    }
    if (!admin->empty() && *admin == *read) {
      std::fprintf(stderr, "bertshard-coordinator: the read token must differ from the cluster token\n");
      return 2;
    }
    options.auth = {*admin, *read};
    options.cluster.worker_token = *admin;
  }
  {
    const bertshard::common::TlsFiles tls{absl::GetFlag(FLAGS_tls_cert), absl::GetFlag(FLAGS_tls_key),
                                          absl::GetFlag(FLAGS_tls_ca)};
    auto server_credentials = bertshard::common::ServerCredentials(tls);
    // Workers are dialled over TLS exactly when a CA says how to verify them.
    auto worker_credentials =
        bertshard::common::ChannelCredentials(tls.ca.empty() ? bertshard::common::TlsFiles{} : tls);
    const absl::Status bad = !server_credentials.ok() ? server_credentials.status() : worker_credentials.status();
    if (!bad.ok()) {
      std::fprintf(stderr, "bertshard-coordinator: %s\n", std::string(bad.message()).c_str());
      return 2;
    }
    options.server_credentials = *server_credentials;
    options.cluster.worker_credentials = *worker_credentials;
  }
  options.cluster.max_jobs_per_client = absl::GetFlag(FLAGS_max_jobs_per_client);
  options.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  if (options.cluster.max_jobs_per_client < 0 || options.max_message_bytes < 4096) {
    std::fprintf(stderr, "bertshard-coordinator: --max_jobs_per_client must be >= 0 and --max_message_bytes >= 4096\n");
    return 2;
  }
  options.cluster.heartbeat_interval = absl::GetFlag(FLAGS_heartbeat_interval);
  options.cluster.missed_heartbeats = absl::GetFlag(FLAGS_missed_heartbeats);
  if (options.cluster.missed_heartbeats < 2 || options.cluster.heartbeat_interval <= absl::ZeroDuration()) {
    std::fprintf(stderr,
                 "bertshard-coordinator: --missed_heartbeats must be at least 2 and --heartbeat_interval positive\n");
    return 2;
  }
  options.cluster.collective_timeout_seconds = absl::GetFlag(FLAGS_collective_timeout_s);
  options.cluster.readopt_grace = absl::GetFlag(FLAGS_readopt_grace);
  const absl::Duration drain = absl::GetFlag(FLAGS_drain_timeout);
  options.cluster.batching.max_batch_tokens = absl::GetFlag(FLAGS_max_batch_tokens);
  options.cluster.batching.max_batch_requests = absl::GetFlag(FLAGS_max_batch_requests);
  options.cluster.batching.max_batch_delay = absl::Milliseconds(absl::GetFlag(FLAGS_max_batch_delay_ms));
  options.cluster.batching.regroup_delay = absl::Milliseconds(absl::GetFlag(FLAGS_max_batch_regroup_ms));
  if (options.cluster.batching.max_batch_tokens < 1 || options.cluster.batching.max_batch_requests < 1 ||
      absl::GetFlag(FLAGS_max_batch_delay_ms) < 0 || absl::GetFlag(FLAGS_max_batch_regroup_ms) < 0) {
    std::fprintf(stderr,
                 "bertshard-coordinator: --max_batch_tokens and --max_batch_requests must be >= 1 and "
                 "--max_batch_delay_ms and --max_batch_regroup_ms >= 0 (got %lld, %d, %d, %d)\n",
                 static_cast<long long>(options.cluster.batching.max_batch_tokens),
                 options.cluster.batching.max_batch_requests, absl::GetFlag(FLAGS_max_batch_delay_ms),
                 absl::GetFlag(FLAGS_max_batch_regroup_ms));
    return 2;
  }

  bertshard::common::InstallShutdownHandlers();

  // Declared before the server, so it outlives it; the endpoint is stopped before the server goes.
  bertshard::common::MetricsRegistry metrics;
  std::unique_ptr<bertshard::common::MetricsEndpoint> metrics_endpoint;
  if (const std::string address = absl::GetFlag(FLAGS_metrics_listen); !address.empty()) {
    auto endpoint = bertshard::common::MetricsEndpoint::Start(address, &metrics);
    if (!endpoint.ok()) {
      std::fprintf(stderr, "bertshard-coordinator: --metrics_listen: %s\n", endpoint.status().ToString().c_str());
      return 1;
    }
    metrics_endpoint = *std::move(endpoint);
    options.metrics = &metrics;
  }

  auto server = bertshard::server::CoordinatorServer::Start(options);
  if (!server.ok()) {
    std::fprintf(stderr, "bertshard-coordinator: %s\n", server.status().ToString().c_str());
    return 1;
  }
  std::printf("bertshard-coordinator listening on port %d\n", (*server)->port());
  if (metrics_endpoint != nullptr) std::printf("metrics listening on port %d\n", metrics_endpoint->port());
  std::fflush(stdout);
  std::thread waiter([&server, drain]() {
    bertshard::common::WaitForShutdownSignal("bertshard-coordinator");
    (*server)->Shutdown(drain);
  });
  (*server)->Wait();
  waiter.join();
  metrics_endpoint.reset();  // no scrape may read the cluster once it goes
  std::fprintf(stderr, "bertshard-coordinator: stopped\n");
  return 0;
}
