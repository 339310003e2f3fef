// File: server/http_backend.h
// -----------------------------------------------------------------------------
// The HTTP protocols' view of the coordinator (http/inference_backend.h) over its Cluster: the
// same calls the gRPC service makes (Cluster::ResolveJob, Embed, Infer, the job's tokenizer), so
// an HTTP request and a gRPC one take one request path, batcher and limits included. It converts
// nothing but the serving jobs' descriptions (ModelInfo).
//
// Example:
//   ClusterHttpBackend backend(cluster);
//   http::HttpApi api(&backend, api_options);
//
// Thread safety: thread-safe (the Cluster is). The cluster must outlive it.
#ifndef BERTSHARD_SERVER_HTTP_BACKEND_H_
#define BERTSHARD_SERVER_HTTP_BACKEND_H_

#include <string>
#include <vector>

#include "http/inference_backend.h"
#include "server/cluster.h"

namespace bertshard::server {

class ClusterHttpBackend final : public http::InferenceBackend {
 public:
  explicit ClusterHttpBackend(Cluster* cluster) : cluster_(cluster) {}

  absl::StatusOr<std::string> ResolveJob(const std::string& model) override;
  absl::StatusOr<http::ModelInfo> Model(const std::string& job_id) override;
  std::vector<http::ModelInfo> ServingModels() override;
  absl::StatusOr<v1::EmbedResponse> Embed(const v1::EmbedRequest& request, const http::CallContext& call) override;
  absl::StatusOr<v1::InferResponse> Infer(const v1::InferRequest& request, const http::CallContext& call) override;
  absl::StatusOr<std::vector<http::TokenInfo>> Tokenize(const std::string& job_id, const std::string& text,
                                                        bool add_special_tokens) override;
  absl::StatusOr<std::string> Decode(const std::string& job_id, const std::vector<int64_t>& ids) override;
  absl::StatusOr<std::string> Prompt(const std::string& job_id, const std::string& prompt_name) override;

  // What /info and /v1/models say of a serving job (created_unix_seconds left 0).
  static http::ModelInfo Describe(const Cluster::ServingJob& job);

 private:
  Cluster* const cluster_;
};

}  // namespace bertshard::server

#endif  // BERTSHARD_SERVER_HTTP_BACKEND_H_
