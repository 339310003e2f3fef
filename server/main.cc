// bertshard-coordinator: serves the Coordinator API (plans, jobs, workers' registration and
// heartbeats, Infer and Embed), with health, reflection and optionally Prometheus metrics.
//
//   bertshard-coordinator --listen=0.0.0.0:50051 --drain_timeout=10s [--metrics_listen=0.0.0.0:9090]
//
// A bad flag value exits 2. SIGTERM or SIGINT: health goes NOT_SERVING, new calls are refused,
// in-flight calls get --drain_timeout to finish, then the process exits 0.
#include <malloc.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/grpc_auth.h"
#include "common/grpc_serving.h"
#include "common/metrics.h"
#include "common/metrics_endpoint.h"
#include "common/model_root.h"
#include "common/server_flags.h"
#include "server/coordinator_server.h"

// --auth_token_file and --tls_cert, --tls_key, --tls_ca: common/server_flags.h.
ABSL_FLAG(std::string, listen, "0.0.0.0:50051", "host:port to serve on (port 0: any free port)");
ABSL_FLAG(absl::Duration, drain_timeout, absl::Seconds(10), "how long in-flight calls may run after SIGTERM/SIGINT");
ABSL_FLAG(std::string, data_dir, "bertshard-data", "directory for the coordinator's state");
ABSL_FLAG(std::string, model_root, "",
          "directory tree checkpoints must lie in (relative checkpoint paths are taken under it; symbolic links "
          "leading out and files with more than one hard link are refused); empty: any path the coordinator can read");
ABSL_FLAG(int64_t, max_checkpoint_json_bytes, bertshard::common::kMaxCheckpointJsonBytes,
          "most bytes read of a checkpoint's JSON files (config.json, tokenizer_config.json, the sentence-transformers "
          "files); larger ones are refused");
ABSL_FLAG(int64_t, max_vocab_bytes, bertshard::common::kMaxVocabBytes,
          "most bytes read of a checkpoint's vocab.txt; a larger one is refused");
ABSL_FLAG(std::string, database, "", "job database (SQLite); default <data_dir>/jobs.db");
ABSL_FLAG(absl::Duration, heartbeat_interval, absl::Seconds(1),
          "workers' heartbeat interval; a worker silent for --missed_heartbeats intervals is dead");
ABSL_FLAG(int, missed_heartbeats, 3,
          "a worker silent for this many heartbeat intervals is dead and its job fails (at least 2)");
ABSL_FLAG(int, collective_timeout_s, 60, "rendezvous and collective timeout on the workers, seconds");
ABSL_FLAG(absl::Duration, readopt_grace, absl::Seconds(10),
          "after a restart, how long READY and LOADING jobs wait for all their ranks' workers to register");
ABSL_FLAG(int, max_restarts, 10,
          "times in a row a job whose workers are lost (killed, silent, leaving, a failed forward or load) is "
          "placed and loaded again before it ends FAILED; 0: the first loss ends it");
ABSL_FLAG(absl::Duration, restart_backoff, absl::Seconds(1),
          "wait before the second restart in a row (the first is at once), doubling for each after");
ABSL_FLAG(absl::Duration, restart_backoff_max, absl::Seconds(60), "longest wait between restarts");
ABSL_FLAG(absl::Duration, restart_reset_after, absl::Minutes(10),
          "a job that served this long since its last restart counts its next loss as the first");
ABSL_FLAG(bool, smaller_shapes, false,
          "a replica that lost workers and finds too few idle ones serves in the largest smaller shape they fit (the "
          "same TP over fewer stages, else a smaller TP) until its own fits again; each worker then holds more of "
          "the model");
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
ABSL_FLAG(int64_t, max_client_queued_tokens, 0,
          "most tokens (rows x seq) one connection may have waiting in one job's batch queue, and 4 times that one "
          "client (TLS certificate name, else host); more is refused RESOURCE_EXHAUSTED (0: 4 x --max_batch_tokens; "
          "never below --max_batch_tokens)");
ABSL_FLAG(int64_t, max_request_text_bytes, 32 << 20,
          "most bytes of text (texts and text pairs together) in one Infer/Embed request, refused before tokenising "
          "(0: no cap; the gRPC message limit still holds)");
ABSL_FLAG(std::string, read_token_file, "",
          "a read-only bearer token (file; else $BERTSHARD_READ_TOKEN; needs --auth_token_file): when set, every "
          "other RPC (plans, listings, watches, inference) needs it or the cluster token");
ABSL_FLAG(int, max_jobs_per_client, 16,
          "jobs one client may have that have not ended; 0: no limit. A client is its verified TLS certificate's "
          "common name, else its host: every client of one host shares it (tokens name no client)");
ABSL_FLAG(int, max_replicas, 16,
          "the most replicas (independent TP x PP groups of workers) one job may run (SubmitJob, ScaleJob)");
ABSL_FLAG(double, autoscale_target, 0.7,
          "jobs with replica bounds (submit --min-replicas/--max-replicas): the busy fraction of their replicas aimed "
          "at; above it for --autoscale_up_after a replica is added (idle workers permitting), and one is removed "
          "once the others would have stayed below it for --autoscale_down_after");
ABSL_FLAG(absl::Duration, autoscale_up_after, absl::Seconds(3), "see --autoscale_target");
ABSL_FLAG(absl::Duration, autoscale_down_after, absl::Seconds(60), "see --autoscale_target");
ABSL_FLAG(absl::Duration, job_retention, absl::Hours(24 * 7),
          "how long ended (FAILED, CANCELLED) jobs stay in the job database, listed and readable, before they are "
          "deleted (e.g. 168h, 30m; inf: kept for good). Jobs that have not ended are never deleted");
ABSL_FLAG(int, max_message_bytes, 256 << 20,
          "largest message sent (answers), bytes; also the largest received unless --max_request_bytes is less");
ABSL_FLAG(int, max_request_bytes, 0,
          "largest request message received, bytes, refused RESOURCE_EXHAUSTED before it is parsed (0: what the "
          "serving limits admit: --max_request_text_bytes + 40 x --max_batch_tokens + 1 MiB, at least 4 MiB; "
          "--max_message_bytes when --max_request_text_bytes is 0)");
ABSL_FLAG(int64_t, max_transport_memory_bytes, 0,
          "gRPC's memory quota for reading requests, bytes: gRPC reads a message whole before it refuses it as too "
          "large, so this bounds what the connections' read buffers hold together (past it gRPC resets a stream, "
          "RESOURCE_EXHAUSTED, which may be another connection's than the largest sender's); at least twice the "
          "request limit (0: 4 x the request limit, at least 64 MiB; -1: none)");
ABSL_FLAG(absl::Duration, keepalive_time, absl::Seconds(30),
          "how often the coordinator pings each client connection that has calls in flight (0: never); one whose "
          "ping is not answered within --keepalive_timeout is closed and its calls end, so a client that stopped "
          "reading holds no thread or answer for longer");
ABSL_FLAG(absl::Duration, keepalive_timeout, absl::Seconds(20),
          "how long a keepalive ping may go unanswered before the connection is closed (the ping waits behind the "
          "answer bytes already sent: too short cuts off slow, healthy clients downloading large answers)");
// HTTP/JSON: TEI's routes and OpenAI's embeddings (docs/http.md), with TEI's flags and defaults.
ABSL_FLAG(std::string, http_listen, "",
          "host:port for HTTP/JSON: TEI's routes (/embed, /predict, ...) and OpenAI's /v1/embeddings, with the "
          "same TLS files and tokens as gRPC (port 0: any free port; empty: none)");
ABSL_FLAG(std::string, default_job, "",
          "the job (id or name) HTTP requests that name none are served by; empty: the only serving job");
ABSL_FLAG(int, max_concurrent_requests, 512,
          "most HTTP inference requests at once; more are answered 429 at once (TEI's --max-concurrent-requests)");
ABSL_FLAG(int, max_client_batch_size, 32,
          "most inputs in one HTTP request; more are refused 413 (TEI's --max-client-batch-size)");
ABSL_FLAG(int64_t, payload_limit, 2000000,
          "most bytes of an HTTP request body; larger ones are refused 413 (TEI's --payload-limit)");

namespace bertshard::server {
namespace {

// What the flags ask the coordinator to serve.
struct ServeOptions {
  CoordinatorOptions coordinator;
  std::string data_dir;  // created at start when the database lies in it; empty: none to create
  std::string metrics_listen;
  std::vector<std::string> metrics_tokens;  // what a scrape must present; empty: open
  absl::Duration drain;
};

// The flags' values, checked: INVALID_ARGUMENT naming the bad one.
absl::StatusOr<ServeOptions> ServeOptionsFromFlags() {
  ServeOptions serve;
  CoordinatorOptions& options = serve.coordinator;
  options.listen_address = absl::GetFlag(FLAGS_listen);
  options.cluster.database_path = absl::GetFlag(FLAGS_database);
  if (options.cluster.database_path.empty()) {
    serve.data_dir = absl::GetFlag(FLAGS_data_dir);
    options.cluster.database_path = serve.data_dir + "/jobs.db";
  }
  absl::StatusOr<common::ModelRoot> root = common::ModelRoot::Open(
      absl::GetFlag(FLAGS_model_root), {.max_json_bytes = absl::GetFlag(FLAGS_max_checkpoint_json_bytes),
                                        .max_vocab_bytes = absl::GetFlag(FLAGS_max_vocab_bytes)});
  if (!root.ok()) return absl::InvalidArgumentError(absl::StrCat("--model_root: ", root.status().message()));
  options.cluster.model_root = *root;
  absl::StatusOr<common::ServerSecurity> security = common::LoadServerSecurity(common::SecurityFlags());
  const absl::StatusOr<std::string> read =
      common::LoadToken(absl::GetFlag(FLAGS_read_token_file), "BERTSHARD_READ_TOKEN");
  if (!security.ok()) return absl::InvalidArgumentError(security.status().message());
  if (!read.ok()) return absl::InvalidArgumentError(read.status().message());
  const std::string& admin = security->token;
  if (admin.empty() && !read->empty()) {
    return absl::InvalidArgumentError("a read token needs the cluster token (--auth_token_file)");
  }
  if (!admin.empty() && admin == *read) {
    return absl::InvalidArgumentError("the read token must differ from the cluster token");
  }
  options.auth = {admin, *read};
  options.cluster.worker_token = admin;
  options.server_credentials = security->server_credentials;
  options.cluster.worker_credentials = security->peer_credentials;
  options.cluster.max_jobs_per_client = absl::GetFlag(FLAGS_max_jobs_per_client);
  options.cluster.max_replicas = absl::GetFlag(FLAGS_max_replicas);
  if (options.cluster.max_replicas < 1) return absl::InvalidArgumentError("--max_replicas must be >= 1");
  options.cluster.autoscale.target = absl::GetFlag(FLAGS_autoscale_target);
  options.cluster.autoscale.up_after = absl::GetFlag(FLAGS_autoscale_up_after);
  options.cluster.autoscale.down_after = absl::GetFlag(FLAGS_autoscale_down_after);
  if (!(options.cluster.autoscale.target > 0 && options.cluster.autoscale.target < 1)) {
    return absl::InvalidArgumentError("--autoscale_target must be between 0 and 1 (a busy fraction), e.g. 0.7");
  }
  if (options.cluster.autoscale.up_after <= absl::ZeroDuration() ||
      options.cluster.autoscale.down_after <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--autoscale_up_after and --autoscale_down_after must be positive");
  }
  options.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  options.max_request_bytes = absl::GetFlag(FLAGS_max_request_bytes);
  if (options.cluster.max_jobs_per_client < 0 || options.max_message_bytes < 4096 ||
      (options.max_request_bytes != 0 && options.max_request_bytes < 4096)) {
    return absl::InvalidArgumentError(
        "--max_jobs_per_client must be >= 0, --max_message_bytes >= 4096 and --max_request_bytes 0 or >= 4096");
  }
  options.max_transport_memory_bytes = absl::GetFlag(FLAGS_max_transport_memory_bytes);
  if (options.max_transport_memory_bytes < -1 ||
      (options.max_transport_memory_bytes > 0 && options.max_transport_memory_bytes < (1 << 20))) {
    return absl::InvalidArgumentError("--max_transport_memory_bytes must be 0, -1 or at least 1 MiB");
  }
  options.keepalive_time = absl::GetFlag(FLAGS_keepalive_time);
  options.keepalive_timeout = absl::GetFlag(FLAGS_keepalive_timeout);
  if (options.keepalive_time < absl::ZeroDuration() || options.keepalive_timeout <= absl::ZeroDuration() ||
      options.keepalive_time > absl::Hours(24 * 24) || options.keepalive_timeout > absl::Hours(24 * 24)) {
    return absl::InvalidArgumentError(
        "--keepalive_time must be >= 0 (0: no pings) and --keepalive_timeout positive, both under 24 days");
  }
  options.cluster.heartbeat_interval = absl::GetFlag(FLAGS_heartbeat_interval);
  options.cluster.missed_heartbeats = absl::GetFlag(FLAGS_missed_heartbeats);
  if (options.cluster.missed_heartbeats < 2 || options.cluster.heartbeat_interval <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--missed_heartbeats must be at least 2 and --heartbeat_interval positive");
  }
  options.cluster.collective_timeout_seconds = absl::GetFlag(FLAGS_collective_timeout_s);
  options.cluster.readopt_grace = absl::GetFlag(FLAGS_readopt_grace);
  auto& restarts = options.cluster.restarts;
  restarts.max_restarts = absl::GetFlag(FLAGS_max_restarts);
  restarts.backoff_initial = absl::GetFlag(FLAGS_restart_backoff);
  restarts.backoff_max = absl::GetFlag(FLAGS_restart_backoff_max);
  restarts.reset_after = absl::GetFlag(FLAGS_restart_reset_after);
  options.cluster.smaller_shapes = absl::GetFlag(FLAGS_smaller_shapes);
  if (restarts.max_restarts < 0 || restarts.backoff_initial < absl::ZeroDuration() ||
      restarts.backoff_max < restarts.backoff_initial || restarts.reset_after < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        "--max_restarts, --restart_backoff and --restart_reset_after must be >= 0, and --restart_backoff_max >= "
        "--restart_backoff");
  }
  options.cluster.job_retention = absl::GetFlag(FLAGS_job_retention);
  if (options.cluster.job_retention < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--job_retention must be >= 0 (inf: keep ended jobs for good)");
  }
  auto& batching = options.cluster.batching;
  batching.max_batch_tokens = absl::GetFlag(FLAGS_max_batch_tokens);
  batching.max_batch_requests = absl::GetFlag(FLAGS_max_batch_requests);
  const int delay_ms = absl::GetFlag(FLAGS_max_batch_delay_ms), regroup_ms = absl::GetFlag(FLAGS_max_batch_regroup_ms);
  batching.max_batch_delay = absl::Milliseconds(delay_ms);
  batching.regroup_delay = absl::Milliseconds(regroup_ms);
  batching.max_client_queued_tokens = absl::GetFlag(FLAGS_max_client_queued_tokens);
  batching.max_request_text_bytes = absl::GetFlag(FLAGS_max_request_text_bytes);
  if (batching.max_client_queued_tokens < 0 || batching.max_request_text_bytes < 0) {
    return absl::InvalidArgumentError("--max_client_queued_tokens and --max_request_text_bytes must be >= 0");
  }
  if (batching.max_batch_tokens < 1 || batching.max_batch_requests < 1 || delay_ms < 0 || regroup_ms < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--max_batch_tokens and --max_batch_requests must be >= 1 and --max_batch_delay_ms and "
        "--max_batch_regroup_ms >= 0 (got ",
        batching.max_batch_tokens, ", ", batching.max_batch_requests, ", ", delay_ms, ", ", regroup_ms, ")"));
  }
  options.http.listen = absl::GetFlag(FLAGS_http_listen);
  if (const common::TlsFiles tls = common::SecurityFlags().tls;
      !options.http.listen.empty() && (!tls.cert.empty() || !tls.ca.empty())) {
    // The HTTP port has no TLS of its own (http/http_server.h): serving it beside a TLS gRPC port
    // would take the same tokens in the clear.
    return absl::InvalidArgumentError(
        "--http_listen serves plain HTTP only, and this coordinator's gRPC port uses TLS (--tls_cert/--tls_ca): "
        "terminate TLS in front of the HTTP port (an Ingress or proxy) and run it without the TLS flags, or "
        "leave --http_listen unset");
  }
  options.http.max_body_bytes = absl::GetFlag(FLAGS_payload_limit);
  options.http_api.default_job = absl::GetFlag(FLAGS_default_job);
  options.http_api.max_concurrent_requests = absl::GetFlag(FLAGS_max_concurrent_requests);
  options.http_api.max_client_batch_size = absl::GetFlag(FLAGS_max_client_batch_size);
  options.http_api.max_batch_tokens = batching.max_batch_tokens;
  options.http_api.max_batch_requests = batching.max_batch_requests;
  options.http_api.version = "bertshard-coordinator";  // no release number of its own yet
  if (options.http_api.max_concurrent_requests < 1 || options.http_api.max_client_batch_size < 1 ||
      options.http.max_body_bytes < 1) {
    return absl::InvalidArgumentError(
        "--max_concurrent_requests, --max_client_batch_size and --payload_limit must be >= 1");
  }
  // Each HTTP thread holds one request; a few beyond the limit answer the 429s and the probes.
  options.http.threads = std::min(options.http_api.max_concurrent_requests, 1024) + 8;
  serve.metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  // /metrics names jobs (the queue depth per job), which the RPCs show only to holders of the read
  // token when one is set: so does the endpoint (Prometheus' bearer_token_file).
  if (!read->empty()) serve.metrics_tokens = {*read, admin};
  serve.drain = absl::GetFlag(FLAGS_drain_timeout);
  return serve;
}

// Serves until SIGTERM/SIGINT, then drains. The exit code: 0, or 1 when it cannot start.
int RunServer(ServeOptions serve) {
  if (!serve.data_dir.empty()) {
    std::error_code error;
    std::filesystem::create_directories(serve.data_dir, error);
    if (error) {
      std::fprintf(stderr, "bertshard-coordinator: cannot create %s: %s\n", serve.data_dir.c_str(),
                   error.message().c_str());
      return 1;
    }
  }
  common::InstallShutdownHandlers();
  // Declared before the server, so it outlives it; the endpoint is stopped before the server goes.
  common::MetricsRegistry metrics;
  std::unique_ptr<common::MetricsEndpoint> metrics_endpoint;
  if (!serve.metrics_listen.empty()) {
    auto endpoint = common::MetricsEndpoint::Start(serve.metrics_listen, &metrics, serve.metrics_tokens);
    if (!endpoint.ok()) {
      std::fprintf(stderr, "bertshard-coordinator: --metrics_listen: %s\n", endpoint.status().ToString().c_str());
      return 1;
    }
    metrics_endpoint = *std::move(endpoint);
    serve.coordinator.metrics = &metrics;
  }
  // TEI's GET /metrics on the HTTP port reads the same registry.
  if (!serve.coordinator.http.listen.empty()) serve.coordinator.metrics = &metrics;
  auto server = CoordinatorServer::Start(serve.coordinator);
  if (!server.ok()) {
    std::fprintf(stderr, "bertshard-coordinator: %s\n", server.status().ToString().c_str());
    return 1;
  }
  std::printf("bertshard-coordinator listening on port %d\n", (*server)->port());
  if ((*server)->http_port() != 0) std::printf("http listening on port %d\n", (*server)->http_port());
  if (metrics_endpoint != nullptr) std::printf("metrics listening on port %d\n", metrics_endpoint->port());
  std::fflush(stdout);
  std::thread waiter([&server, drain = serve.drain]() {
    common::WaitForShutdownSignal("bertshard-coordinator");
    (*server)->Shutdown(drain);
  });
  (*server)->Wait();
  waiter.join();
  metrics_endpoint.reset();  // no scrape may read the cluster once it goes
  std::fprintf(stderr, "bertshard-coordinator: stopped\n");
  return 0;
}

}  // namespace
}  // namespace bertshard::server

int main(int argc, char** argv) {
  // Buffers of 256 KiB and more (requests and answers being read, parsed and sent) are mapped on
  // their own and go back to the system when freed. glibc's default raises this threshold to the
  // largest block freed so far, after which such buffers come from the heaps and stay there: a
  // client that sent big requests or left big answers unread kept the coordinator at its peak
  // after it went (issue 21, item 6).
  mallopt(M_MMAP_THRESHOLD, 256 << 10);
  absl::SetProgramUsageMessage("bertshard coordinator: --listen=HOST:PORT [--drain_timeout=10s]");
  absl::ParseCommandLine(argc, argv);
  absl::StatusOr<bertshard::server::ServeOptions> serve = bertshard::server::ServeOptionsFromFlags();
  if (!serve.ok()) {
    std::fprintf(stderr, "bertshard-coordinator: %s\n", std::string(serve.status().message()).c_str());
    return 2;
  }
  return bertshard::server::RunServer(*std::move(serve));
}
