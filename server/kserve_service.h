// File: server/kserve_service.h
// -----------------------------------------------------------------------------
// KServe v2's gRPC service, inference.GRPCInferenceService (proto/inference/grpc_service.proto),
// served on the coordinator's gRPC port beside bertshard.v1 so that tritonclient.grpc and other
// KServe clients work unchanged: ServerLive, ServerReady, ModelReady, ServerMetadata,
// ModelMetadata and ModelInfer. A thin layer: it reads the messages into the protocol core's
// values (http/kserve.h, shared with the /v2 HTTP routes) and writes the answers back, outputs as
// raw_output_contents (what tritonclient.grpc reads).
//
// Access: as every bertshard RPC (common/grpc_auth.h): ServerLive and ServerReady stay open (they
// are health probes, as grpc.health.v1 is); the rest need the read token when one is set.
// Errors: the core's codes as gRPC codes (INVALID_ARGUMENT for bad input, NOT_FOUND for an
// unknown model, UNAVAILABLE for one that does not serve).
//
// Example:
//   KServeService kserve(&backend, {.default_job = "minilm", .auth = auth, .version = "1.0"});
//   common::StartServer(address, {&coordinator_service, &kserve});
//
// Thread safety: thread-safe. The backend must outlive the service.
#ifndef BERTSHARD_SERVER_KSERVE_SERVICE_H_
#define BERTSHARD_SERVER_KSERVE_SERVICE_H_

#include <functional>
#include <string>

#include "common/grpc_auth.h"
#include "http/inference_backend.h"
#include "inference/grpc_service.grpc.pb.h"

namespace bertshard::server {

struct KServeOptions {
  std::string default_job;  // for requests that name no model (--default_job)
  common::AuthConfig auth;
  std::string version;  // ServerMetadata's version
  // Ids one request may hold (the coordinator's --max_batch_tokens): more are refused up front.
  int64_t max_padded_ids = 16384;
  // Who calls, as the batcher names clients (coordinator_server.cc's ClientOf); null: the peer.
  std::function<std::string(const grpc::ServerContext&)> client_of;
};

class KServeService final : public inference::GRPCInferenceService::Service {
 public:
  KServeService(http::InferenceBackend* backend, KServeOptions options)
      : backend_(backend), options_(std::move(options)) {}

  grpc::Status ServerLive(grpc::ServerContext* context, const inference::ServerLiveRequest* request,
                          inference::ServerLiveResponse* response) override;
  grpc::Status ServerReady(grpc::ServerContext* context, const inference::ServerReadyRequest* request,
                           inference::ServerReadyResponse* response) override;
  grpc::Status ModelReady(grpc::ServerContext* context, const inference::ModelReadyRequest* request,
                          inference::ModelReadyResponse* response) override;
  grpc::Status ServerMetadata(grpc::ServerContext* context, const inference::ServerMetadataRequest* request,
                              inference::ServerMetadataResponse* response) override;
  grpc::Status ModelMetadata(grpc::ServerContext* context, const inference::ModelMetadataRequest* request,
                             inference::ModelMetadataResponse* response) override;
  grpc::Status ModelInfer(grpc::ServerContext* context, const inference::ModelInferRequest* request,
                          inference::ModelInferResponse* response) override;

 private:
  http::InferenceBackend* const backend_;
  const KServeOptions options_;
};

}  // namespace bertshard::server

#endif  // BERTSHARD_SERVER_KSERVE_SERVICE_H_
