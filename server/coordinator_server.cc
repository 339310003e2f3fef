#include "server/coordinator_server.h"

#include <utility>

#include "bertshard/v1/coordinator.grpc.pb.h"
#include "common/grpc_serving.h"
#include "common/grpc_status.h"
#include "common/status_macros.h"
#include "grpcpp/grpcpp.h"
#include "planner/planner.h"

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

}  // namespace

// The synchronous API on purpose: Infer and WatchJob block until workers answer, which a
// callback reactor must not do. Each handler validates, calls the core, and maps the Status.
class CoordinatorServer::Service final : public v1::Coordinator::Service {
 public:
  explicit Service(Cluster* cluster) : cluster_(cluster) {}

  grpc::Status Plan(grpc::ServerContext*, const v1::PlanRequest* request, v1::ShardPlan* response) override {
    return common::ToGrpcStatus(planner::PlanInto(*request, response));
  }
  grpc::Status RegisterWorker(grpc::ServerContext*, const v1::RegisterWorkerRequest* request,
                              v1::RegisterWorkerResponse* response) override {
    if (request->address().empty()) return {grpc::StatusCode::INVALID_ARGUMENT, "a worker needs an address"};
    *response = cluster_->RegisterWorker(*request);
    return grpc::Status::OK;
  }
  grpc::Status Heartbeat(grpc::ServerContext*, const v1::HeartbeatRequest* request, v1::HeartbeatResponse*) override {
    return common::ToGrpcStatus(cluster_->Heartbeat(*request));
  }
  grpc::Status ListWorkers(grpc::ServerContext*, const v1::ListWorkersRequest*, v1::ListWorkersResponse* response) override {
    *response = cluster_->ListWorkers();
    return grpc::Status::OK;
  }
  grpc::Status SubmitJob(grpc::ServerContext*, const v1::SubmitJobRequest* request, v1::Job* response) override {
    return Reply(cluster_->SubmitJob(*request), response);
  }
  grpc::Status GetJob(grpc::ServerContext*, const v1::GetJobRequest* request, v1::Job* response) override {
    return Reply(cluster_->GetJob(request->job_id()), response);
  }
  grpc::Status ListJobs(grpc::ServerContext*, const v1::ListJobsRequest*, v1::ListJobsResponse* response) override {
    auto jobs = cluster_->ListJobs();
    if (!jobs.ok()) return common::ToGrpcStatus(jobs.status());
    for (auto& j : *jobs) *response->add_jobs() = std::move(j);
    return grpc::Status::OK;
  }
  grpc::Status CancelJob(grpc::ServerContext*, const v1::GetJobRequest* request, v1::Job* response) override {
    return Reply(cluster_->CancelJob(request->job_id()), response);
  }
  grpc::Status WatchJob(grpc::ServerContext* context, const v1::GetJobRequest* request,
                        grpc::ServerWriter<v1::JobEvent>* writer) override {
    return common::ToGrpcStatus(cluster_->WatchJob(request->job_id(), Deadline(context, absl::Hours(1)),
                                                   [&](const v1::JobEvent& e) {
                                                     return !context->IsCancelled() && writer->Write(e);
                                                   },
                                                   [context] { return context->IsCancelled(); }));
  }
  grpc::Status Infer(grpc::ServerContext* context, const v1::InferRequest* request, v1::InferResponse* response) override {
    return Reply(cluster_->Infer(*request, Deadline(context, absl::Minutes(10)), [context] { return context->IsCancelled(); }),
                 response);
  }

 private:
  Cluster* const cluster_;
};

CoordinatorServer::CoordinatorServer(std::unique_ptr<Cluster> cluster, std::unique_ptr<Service> service,
                                     std::unique_ptr<grpc::Server> server, int port)
    : cluster_(std::move(cluster)), service_(std::move(service)), server_(std::move(server)), port_(port) {}

CoordinatorServer::~CoordinatorServer() {
  Shutdown(absl::ZeroDuration());
  server_->Wait();
}

absl::StatusOr<std::unique_ptr<CoordinatorServer>> CoordinatorServer::Start(const CoordinatorOptions& options) {
  ASSIGN_OR_RETURN(auto cluster, Cluster::Create(options.cluster));
  auto service = std::make_unique<Service>(cluster.get());
  ASSIGN_OR_RETURN(common::StartedServer started,
                   common::StartServer(options.listen_address, {service.get()}, options.max_message_bytes));
  return std::unique_ptr<CoordinatorServer>(
      new CoordinatorServer(std::move(cluster), std::move(service), std::move(started.server), started.port));
}

void CoordinatorServer::Shutdown(absl::Duration drain) {
  {
    absl::MutexLock lock(&mu_);
    if (shut_down_) return;
    shut_down_ = true;
  }
  common::DrainAndShutdown(server_.get(), drain);
}

void CoordinatorServer::Wait() { server_->Wait(); }

}  // namespace bertshard::server
