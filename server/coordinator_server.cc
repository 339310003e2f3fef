#include "server/coordinator_server.h"

#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "bertshard/v1/coordinator.grpc.pb.h"
#include "common/grpc_status.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
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
  if (options.listen_address.empty() || !absl::StrContains(options.listen_address, ':')) {
    return absl::InvalidArgumentError(absl::StrCat("listen address '", options.listen_address,
                                                   "' is not host:port (e.g. 0.0.0.0:50051)"));
  }
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  auto service = std::make_unique<Service>();
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(options.listen_address, grpc::InsecureServerCredentials(), &port);
  // gRPC sets SO_REUSEPORT by default: a second coordinator would silently share the port.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.SetMaxReceiveMessageSize(options.max_message_bytes);
  builder.SetMaxSendMessageSize(options.max_message_bytes);
  builder.RegisterService(service.get());
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", options.listen_address,
                     " (address in use, or not an address of this machine)"));
  }
  server->GetHealthCheckService()->SetServingStatus(true);
  return std::unique_ptr<CoordinatorServer>(
      new CoordinatorServer(std::move(service), std::move(server), port));
}

void CoordinatorServer::Shutdown(absl::Duration drain) {
  {
    absl::MutexLock lock(&mu_);
    if (shut_down_) return;
    shut_down_ = true;
  }
  server_->GetHealthCheckService()->SetServingStatus(false);
  server_->Shutdown(absl::ToChronoTime(absl::Now() + drain));
}

void CoordinatorServer::Wait() { server_->Wait(); }

}  // namespace bertshard::server
