#include "server/coordinator_server.h"

#include <algorithm>
#include <limits>
#include <map>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "bertshard/v1/coordinator.grpc.pb.h"
#include "common/grpc_auth.h"
#include "common/grpc_serving.h"
#include "common/grpc_status.h"
#include "common/status_macros.h"
#include "grpcpp/grpcpp.h"
#include "planner/planner.h"
#include "server/placement.h"
#include "server/recovery_metrics.h"

namespace bertshard::server {
namespace {

// The caller's deadline, capped: calls that wait (Infer, WatchJob) never wait forever.
absl::Time Deadline(const grpc::ServerContext* context, absl::Duration cap) {
  const absl::Time requested = absl::FromChrono(context->deadline());
  return std::min(requested, absl::Now() + cap);
}

template <typename T>
grpc::Status Reply(absl::StatusOr<T> result, T* response) {
  if (!result.ok()) return common::ToGrpcStatus(result.status());
  *response = *std::move(result);
  return grpc::Status::OK;
}

// ListJobs' page sizes: when the request leaves it 0, and the most one page holds.
constexpr int kDefaultJobsPage = 1000;
constexpr int kMaxJobsPage = 1000;

// Jobs by state and workers by health, read from the cluster when scraped (cheaper than keeping
// gauges in step with every transition). Every state and both health values are always present, so
// a state that empties reads 0 rather than vanishing.
absl::StatusOr<std::vector<common::MetricsRegistry::CollectorHandle>> RegisterCoordinatorMetrics(
    common::MetricsRegistry* registry, Cluster* cluster) {
  auto jobs_by_state = [cluster]() -> absl::StatusOr<std::vector<common::Sample>> {
    // Counted by the database (one query), not by reading every job at every scrape.
    using Counts = std::map<v1::JobState, int64_t>;
    ASSIGN_OR_RETURN(Counts count, cluster->CountJobsByState());
    std::vector<common::Sample> samples;
    for (int state = v1::JobState_MIN; state <= v1::JobState_MAX; ++state) {
      if (!v1::JobState_IsValid(state) || state == v1::JOB_STATE_UNSPECIFIED) continue;
      const auto s = static_cast<v1::JobState>(state);
      samples.push_back({{v1::JobState_Name(s)}, static_cast<double>(count[s])});
    }
    return samples;
  };
  auto workers_by_health = [cluster]() -> absl::StatusOr<std::vector<common::Sample>> {
    double healthy = 0;
    double unhealthy = 0;
    const v1::ListWorkersResponse listed = cluster->ListWorkers();
    for (const v1::WorkerInfo& worker : listed.workers()) {
      if (worker.healthy()) {
        ++healthy;
      } else {
        ++unhealthy;
      }
    }
    return std::vector<common::Sample>{{{"healthy"}, healthy}, {{"unhealthy"}, unhealthy}};
  };
  auto queue_depths = [cluster]() -> absl::StatusOr<std::vector<common::Sample>> {
    std::vector<common::Sample> samples;
    for (const auto& [job, depth] : cluster->InferQueueDepths()) {
      samples.push_back({{job}, static_cast<double>(depth)});
    }
    return samples;
  };
  std::vector<common::MetricsRegistry::CollectorHandle> handles;
  ASSIGN_OR_RETURN(auto queue,
                   registry->AddCollector(common::MetricType::kGauge, "bertshard_coordinator_infer_queue_depth",
                                          "Infer calls queued or running, per job.", {"job"}, queue_depths));
  handles.push_back(std::move(queue));
  ASSIGN_OR_RETURN(auto jobs,
                   registry->AddCollector(common::MetricType::kGauge, "bertshard_coordinator_jobs",
                                          "Jobs the coordinator knows, by state.", {"state"}, jobs_by_state));
  handles.push_back(std::move(jobs));
  ASSIGN_OR_RETURN(auto workers,
                   registry->AddCollector(common::MetricType::kGauge, "bertshard_coordinator_workers",
                                          "Registered workers, by health (healthy: heartbeating in time).", {"health"},
                                          workers_by_health));
  handles.push_back(std::move(workers));
  ASSIGN_OR_RETURN(auto recovery, RegisterRecoveryMetrics(registry, [cluster] { return cluster->Recovery(); }));
  for (auto& handle : recovery) handles.push_back(std::move(handle));
  return handles;
}

// The dynamic batcher's merged forwards: how many requests, rows and padded tokens each held.
absl::StatusOr<BatchObserver> BatchMetrics(common::MetricsRegistry* registry) {
  ASSIGN_OR_RETURN(common::HistogramFamily * requests,
                   registry->AddHistogram("bertshard_coordinator_batch_requests",
                                          "Infer/Embed requests merged into one sharded forward.", {},
                                          {1, 2, 4, 8, 16, 32, 64, 128}));
  ASSIGN_OR_RETURN(common::HistogramFamily * rows, registry->AddHistogram("bertshard_coordinator_batch_rows",
                                                                          "Rows (sequences) of one sharded forward.",
                                                                          {}, {1, 2, 4, 8, 16, 32, 64, 128, 256}));
  ASSIGN_OR_RETURN(common::HistogramFamily * tokens,
                   registry->AddHistogram("bertshard_coordinator_batch_tokens",
                                          "Padded tokens (rows x padded length) of one sharded forward.", {},
                                          {64, 256, 1024, 4096, 16384, 65536}));
  ASSIGN_OR_RETURN(common::Histogram * r, requests->WithLabels({}));
  ASSIGN_OR_RETURN(common::Histogram * w, rows->WithLabels({}));
  ASSIGN_OR_RETURN(common::Histogram * t, tokens->WithLabels({}));
  return BatchObserver([r, w, t](const BatchStats& stats) {
    r->Observe(stats.requests);
    w->Observe(static_cast<double>(stats.rows));
    t->Observe(static_cast<double>(stats.tokens));
  });
}

}  // namespace

// The synchronous API on purpose: Infer and WatchJob block until workers answer, which a
// callback reactor must not do. Each handler validates, calls the core, and maps the Status.
// Every handler first checks the caller's token (common/grpc_auth.h): kAdmin for what changes
// state, kRead for the rest.
#define RETURN_IF_DENIED(context, access)                                                     \
  if (grpc::Status denied = common::CheckAccess(*(context), auth_, (access)); !denied.ok()) { \
    return denied;                                                                            \
  }

// Who is calling, for per-client limits (the jobs quota, the batcher's round-robin and queued
// tokens): the common name of a verified TLS client certificate, else the peer's host (its port
// changes per connection, and a client could open many). So without TLS client certificates every
// client of one host is one client; bearer tokens are shared secrets, not identities.
static std::string ClientOf(const grpc::ServerContext& context) {
  const std::shared_ptr<const grpc::AuthContext> auth = context.auth_context();
  if (auth != nullptr && auth->IsPeerAuthenticated()) {
    for (const grpc::string_ref& cn : auth->FindPropertyValues("x509_common_name")) {
      return "cn:" + std::string(cn.data(), cn.size());
    }
  }
  std::string peer = context.peer();  // "ipv4:127.0.0.1:5123", "ipv6:[::1]:5123", "unix:..."
  const size_t colon = peer.rfind(':');
  if (colon != std::string::npos && peer.rfind("unix:", 0) != 0) peer.resize(colon);
  return "host:" + peer.substr(peer.find(':') + 1);
}

// The batcher's caller: the client as above, and its connection (the peer with its port).
static Caller CallerOf(const grpc::ServerContext& context) { return {ClientOf(context), context.peer()}; }

class CoordinatorServer::Service final : public v1::Coordinator::Service {
 public:
  Service(Cluster* cluster, common::AuthConfig auth) : cluster_(cluster), auth_(std::move(auth)) {}

  grpc::Status Plan(grpc::ServerContext* context, const v1::PlanRequest* request, v1::ShardPlan* response) override {
    RETURN_IF_DENIED(context, common::Access::kRead);
    const absl::StatusOr<v1::PlanRequest> local = cluster_->LocalRequest(*request);
    if (!local.ok()) return common::ToGrpcStatus(local.status());
    return common::ToGrpcStatus(planner::PlanInto(*local, response));
  }
  grpc::Status RegisterWorker(grpc::ServerContext* context, const v1::RegisterWorkerRequest* request,
                              v1::RegisterWorkerResponse* response) override {
    RETURN_IF_DENIED(context, common::Access::kAdmin);
    if (request->address().empty()) return {grpc::StatusCode::INVALID_ARGUMENT, "a worker needs an address"};
    if (absl::Status device = CheckDevice(request->device()); !device.ok()) return common::ToGrpcStatus(device);
    *response = cluster_->RegisterWorker(*request);
    return grpc::Status::OK;
  }
  grpc::Status Heartbeat(grpc::ServerContext* context, const v1::HeartbeatRequest* request,
                         v1::HeartbeatResponse* response) override {
    RETURN_IF_DENIED(context, common::Access::kAdmin);
    return Reply(cluster_->Heartbeat(*request), response);
  }
  grpc::Status ListWorkers(grpc::ServerContext* context, const v1::ListWorkersRequest*,
                           v1::ListWorkersResponse* response) override {
    RETURN_IF_DENIED(context, common::Access::kRead);
    *response = cluster_->ListWorkers();
    return grpc::Status::OK;
  }
  grpc::Status SubmitJob(grpc::ServerContext* context, const v1::SubmitJobRequest* request,
                         v1::Job* response) override {
    RETURN_IF_DENIED(context, common::Access::kAdmin);
    return Reply(cluster_->SubmitJob(*request, ClientOf(*context)), response);
  }
  grpc::Status GetJob(grpc::ServerContext* context, const v1::GetJobRequest* request, v1::Job* response) override {
    RETURN_IF_DENIED(context, common::Access::kRead);
    return Reply(cluster_->GetJob(request->job_id()), response);
  }
  grpc::Status ListJobs(grpc::ServerContext* context, const v1::ListJobsRequest* request,
                        v1::ListJobsResponse* response) override {
    RETURN_IF_DENIED(context, common::Access::kRead);
    if (request->page_size() < 0) {
      return {grpc::StatusCode::INVALID_ARGUMENT, absl::StrCat("page_size must be >= 0, not ", request->page_size())};
    }
    // 0 (older clients): the default page; larger than the most: the most.
    const int page_size = request->page_size() == 0 ? kDefaultJobsPage : std::min(request->page_size(), kMaxJobsPage);
    auto page = cluster_->ListJobs(page_size, request->page_token());
    if (!page.ok()) return common::ToGrpcStatus(page.status());
    for (auto& j : page->jobs) *response->add_jobs() = std::move(j);
    response->set_next_page_token(page->next_page_token);
    return grpc::Status::OK;
  }
  grpc::Status CancelJob(grpc::ServerContext* context, const v1::GetJobRequest* request, v1::Job* response) override {
    RETURN_IF_DENIED(context, common::Access::kAdmin);
    return Reply(cluster_->CancelJob(request->job_id()), response);
  }
  grpc::Status ScaleJob(grpc::ServerContext* context, const v1::ScaleJobRequest* request, v1::Job* response) override {
    RETURN_IF_DENIED(context, common::Access::kAdmin);
    return Reply(
        cluster_->ScaleJob(request->job_id(), request->replicas(), request->min_replicas(), request->max_replicas()),
        response);
  }
  grpc::Status UpdateJob(grpc::ServerContext* context, const v1::UpdateJobRequest* request,
                         v1::Job* response) override {
    RETURN_IF_DENIED(context, common::Access::kAdmin);
    return Reply(cluster_->UpdateJob(*request), response);
  }
  grpc::Status WatchJob(grpc::ServerContext* context, const v1::GetJobRequest* request,
                        grpc::ServerWriter<v1::JobEvent>* writer) override {
    RETURN_IF_DENIED(context, common::Access::kRead);
    return common::ToGrpcStatus(cluster_->WatchJob(
        request->job_id(), Deadline(context, absl::Hours(1)),
        [&](const v1::JobEvent& e) { return !context->IsCancelled() && writer->Write(e); },
        [context] { return context->IsCancelled(); }, request->all_replicas()));
  }
  grpc::Status Infer(grpc::ServerContext* context, const v1::InferRequest* request,
                     v1::InferResponse* response) override {
    RETURN_IF_DENIED(context, common::Access::kRead);
    return Reply(cluster_->Infer(
                     *request, Deadline(context, absl::Minutes(10)), [context] { return context->IsCancelled(); },
                     CallerOf(*context)),
                 response);
  }
  grpc::Status Embed(grpc::ServerContext* context, const v1::EmbedRequest* request,
                     v1::EmbedResponse* response) override {
    RETURN_IF_DENIED(context, common::Access::kRead);
    return Reply(cluster_->Embed(
                     *request, Deadline(context, absl::Minutes(10)), [context] { return context->IsCancelled(); },
                     CallerOf(*context)),
                 response);
  }
  grpc::Status Rerank(grpc::ServerContext* context, const v1::RerankRequest* request,
                      v1::RerankResponse* response) override {
    RETURN_IF_DENIED(context, common::Access::kRead);
    return Reply(cluster_->Rerank(
                     *request, Deadline(context, absl::Minutes(10)), [context] { return context->IsCancelled(); },
                     CallerOf(*context)),
                 response);
  }

 private:
  Cluster* const cluster_;
  const common::AuthConfig auth_;
};

#undef RETURN_IF_DENIED

int DefaultMaxRequestBytes(const BatchLimits& batching) {
  if (batching.max_request_text_bytes <= 0) return 0;
  constexpr int64_t kMost = std::numeric_limits<int>::max();
  // Per token: three varints of at most 10 bytes, and at most 4 bytes of text framing (a text takes
  // 3 tokens at least, and a text and its pair up to 6 bytes of tag and length each).
  constexpr int64_t kBytesPerToken = 40;
  const int64_t tokens = std::min(std::max<int64_t>(batching.max_batch_tokens, 1), kMost / kBytesPerToken);
  const int64_t bytes = std::min(batching.max_request_text_bytes, kMost) + tokens * kBytesPerToken + (1 << 20);
  return static_cast<int>(std::clamp<int64_t>(bytes, 4 << 20, kMost));
}

CoordinatorServer::CoordinatorServer(std::unique_ptr<Cluster> cluster, std::unique_ptr<Service> service,
                                     std::unique_ptr<grpc::Server> server, int port)
    : cluster_(std::move(cluster)), service_(std::move(service)), server_(std::move(server)), port_(port) {}

CoordinatorServer::~CoordinatorServer() {
  Shutdown(absl::ZeroDuration());
  server_->Wait();
}

absl::StatusOr<std::unique_ptr<CoordinatorServer>> CoordinatorServer::Start(const CoordinatorOptions& options) {
  ClusterOptions cluster_options = options.cluster;
  if (options.metrics != nullptr) {
    ASSIGN_OR_RETURN(BatchObserver observer, BatchMetrics(options.metrics));
    cluster_options.batch_observer = [observer, next = options.cluster.batch_observer](const BatchStats& stats) {
      observer(stats);
      if (next) next(stats);
    };
  }
  ASSIGN_OR_RETURN(auto cluster, Cluster::Create(cluster_options));
  auto service = std::make_unique<Service>(cluster.get(), options.auth);
  std::vector<common::MetricsRegistry::CollectorHandle> collectors;
  if (options.metrics != nullptr) {
    ASSIGN_OR_RETURN(collectors, RegisterCoordinatorMetrics(options.metrics, cluster.get()));
  }
  common::ServerTransport transport = {.keepalive_time = options.keepalive_time,
                                       .keepalive_timeout = options.keepalive_timeout};
  transport.max_receive_bytes =
      options.max_request_bytes > 0 ? options.max_request_bytes : DefaultMaxRequestBytes(options.cluster.batching);
  const int64_t received = transport.max_receive_bytes > 0
                               ? std::min(transport.max_receive_bytes, options.max_message_bytes)
                               : options.max_message_bytes;
  transport.max_transport_memory_bytes = options.max_transport_memory_bytes != 0
                                             ? std::max<int64_t>(options.max_transport_memory_bytes, 0)
                                             : std::max<int64_t>(4 * received, 64 << 20);
  if (transport.max_transport_memory_bytes > 0 && transport.max_transport_memory_bytes < 2 * received) {
    // Below that, a request the receive limit admits would be reset whenever it came.
    return absl::InvalidArgumentError(absl::StrCat("the transport memory quota (", transport.max_transport_memory_bytes,
                                                   " bytes) must be at least twice the largest request received (",
                                                   received, " bytes), or -1 for none"));
  }
  // KServe v2 beside bertshard.v1, on the request path the HTTP routes take (ClusterHttpBackend).
  auto http_backend = std::make_unique<ClusterHttpBackend>(cluster.get());
  auto kserve_service = std::make_unique<KServeService>(
      http_backend.get(), KServeOptions{.default_job = options.http_api.default_job,
                                        .auth = options.auth,
                                        .version = options.http_api.version,
                                        .max_padded_ids = options.cluster.batching.max_batch_tokens,
                                        .client_of = [](const grpc::ServerContext& c) { return ClientOf(c); }});
  ASSIGN_OR_RETURN(
      common::StartedServer started,
      common::StartServer(options.listen_address, {service.get(), kserve_service.get()}, options.max_message_bytes,
                          options.metrics, options.server_credentials, transport));
  std::unique_ptr<CoordinatorServer> server(
      new CoordinatorServer(std::move(cluster), std::move(service), std::move(started.server), started.port));
  server->collectors_ = std::move(collectors);
  server->http_backend_ = std::move(http_backend);
  server->kserve_service_ = std::move(kserve_service);
  if (!options.http.listen.empty()) {
    // The same tokens as the RPCs: inference needs the read token (or the cluster's) when one is set.
    http::HttpApiOptions api_options = options.http_api;
    api_options.admin_token = options.auth.admin_token;
    api_options.read_token = options.auth.read_token;
    if (common::MetricsRegistry* registry = options.metrics; registry != nullptr) {
      api_options.metrics = [registry] { return registry->Render(); };
    }
    server->http_api_ = std::make_unique<http::HttpApi>(server->http_backend_.get(), api_options);
    http::HttpApi* api = server->http_api_.get();
    absl::StatusOr<std::unique_ptr<http::HttpServer>> listener =
        http::HttpServer::Start(options.http, [api](const http::HttpRequest& request) { return api->Handle(request); });
    if (!listener.ok()) return listener.status();  // the gRPC server drains and goes with `server`
    server->http_port_ = (*listener)->port();
    absl::MutexLock lock(&server->mu_);
    server->http_server_ = *std::move(listener);
  }
  return std::move(server);
}

void CoordinatorServer::Shutdown(absl::Duration drain) {
  {
    absl::MutexLock lock(&mu_);
    if (shut_down_) return;
    shut_down_ = true;
  }
  cluster_->Drain();  // heartbeats stop now: no worker may be declared dead for that
  std::unique_ptr<http::HttpServer> http;
  {
    absl::MutexLock lock(&mu_);
    http = std::move(http_server_);
  }
  http.reset();  // stops accepting; its requests in flight finish on the (still serving) cluster
  common::DrainAndShutdown(server_.get(), drain);
}

void CoordinatorServer::Wait() { server_->Wait(); }

}  // namespace bertshard::server
