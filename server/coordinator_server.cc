#include "server/coordinator_server.h"

#include <utility>

#include "bertshard/v1/coordinator.grpc.pb.h"
#include "common/grpc_serving.h"
#include "common/grpc_status.h"
#include "common/status_macros.h"
#include "grpcpp/grpcpp.h"
#include "planner/planner.h"

namespace bertshard::server {

// Planning takes microseconds, so the handler answers inline in the reactor. Reading a
// checkpoint's config.json is one small file read.
class CoordinatorServer::Service final : public v1::Coordinator::CallbackService {
 public:
  grpc::ServerUnaryReactor* Plan(grpc::CallbackServerContext* context, const v1::PlanRequest* request,
                                 v1::ShardPlan* response) override {
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    if (context->IsCancelled()) {
      reactor->Finish(grpc::Status(grpc::StatusCode::CANCELLED, "call cancelled before planning"));
      return reactor;
    }
    absl::StatusOr<v1::ShardPlan> plan = planner::Plan(*request);
    if (!plan.ok()) {
      reactor->Finish(common::ToGrpcStatus(plan.status()));
      return reactor;
    }
    *response = *std::move(plan);
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }
};

CoordinatorServer::CoordinatorServer(std::unique_ptr<Service> service,
                                     std::unique_ptr<grpc::Server> server, int port)
    : service_(std::move(service)), server_(std::move(server)), port_(port) {}

CoordinatorServer::~CoordinatorServer() { Shutdown(absl::ZeroDuration()); }

absl::StatusOr<std::unique_ptr<CoordinatorServer>> CoordinatorServer::Start(
    const CoordinatorOptions& options) {
  auto service = std::make_unique<Service>();
  ASSIGN_OR_RETURN(common::StartedServer started,
                   common::StartServer(options.listen_address, {service.get()}, options.max_message_bytes));
  return std::unique_ptr<CoordinatorServer>(
      new CoordinatorServer(std::move(service), std::move(started.server), started.port));
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
