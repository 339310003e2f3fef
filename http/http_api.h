// File: http/http_api.h
// -----------------------------------------------------------------------------
// The coordinator's HTTP protocols, one handler for http/http_server.h, a thin layer over the
// same request path as gRPC (http/inference_backend.h, implemented over server/cluster.h):
//   - Hugging Face text-embeddings-inference's routes, with TEI's request and response shapes,
//     error codes and bodies ({"error": ..., "error_type": "Validation"}) and timing headers:
//     POST /embed, /embed_all, /embed_sparse, /predict, /rerank, /similarity, /tokenize, /decode, GET /info, /health,
//     and POST / (the serving model's own task, where Hugging Face's InferenceClient posts).
//   - OpenAI's POST /v1/embeddings (also TEI's alias /embeddings) and GET /v1/models[/ID], with
//     OpenAI's error JSON ({"error": {"message", "type", "param", "code"}}).
//   - KServe v2's inference protocol under /v2 (http/kserve.h): GET /v2/health/live, /v2/health/ready,
//     /v2, /v2/models/NAME[/versions/V][/ready], POST /v2/models/NAME[/versions/V]/infer, with JSON
//     tensors and the binary tensor extension, and KServe's error JSON ({"error": ...}).
// docs/http.md lists every route, field and error, and where bertshard differs from TEI.
//
// Jobs: OpenAI's `model` (and, as an extension, a `model` field in TEI's bodies) names a job by
// id or by its name (SubmitJobRequest.name); none named: HttpApiOptions::default_job, else the
// only serving job (Cluster::ResolveJob).
//
// Access: as the gRPC side (common/grpc_auth.h): with a read token set, every route but /health
// needs `Authorization: Bearer <read token or cluster token>`, or gets 401 (TEI: an empty body, as
// TEI's api-key check; OpenAI: its invalid_api_key error, which its SDK raises as
// AuthenticationError). Without a read token the routes are open, as read RPCs are.
//
// Limits (TEI's flags and defaults): more than max_concurrent_requests inference requests at once:
// 429 Overloaded; more than max_client_batch_size inputs: 413 Validation; a body over the HTTP
// server's limit: 413 Validation. The batcher's own refusals (RESOURCE_EXHAUSTED) are 429 too.
//
// Example:
//   HttpApi api(&backend, {.max_client_batch_size = 32});
//   ASSIGN_OR_RETURN(auto server, HttpServer::Start({.listen = "0.0.0.0:8080"},
//                                                   [&api](const HttpRequest& r) { return api.Handle(r); }));
//
// Thread safety: thread-safe. The backend must outlive the api.
#ifndef BERTSHARD_HTTP_HTTP_API_H_
#define BERTSHARD_HTTP_HTTP_API_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>

#include "absl/time/time.h"
#include "google/protobuf/struct.pb.h"
#include "http/http_message.h"
#include "http/inference_backend.h"

namespace bertshard::http {

struct HttpApiOptions {
  // Bearer tokens, as common::AuthConfig: with read_token set, requests need it or admin_token.
  std::string admin_token;
  std::string read_token;
  // An id or name for requests that name no job (--default_job); empty: the only serving job.
  std::string default_job;
  int max_concurrent_requests = 512;  // TEI's defaults
  int max_client_batch_size = 32;
  // What /info reports of the batcher (the coordinator's --max_batch_tokens, --max_batch_requests).
  int64_t max_batch_tokens = 16384;
  int max_batch_requests = 32;
  // How long one request may take (HTTP has no deadline header).
  absl::Duration request_timeout = absl::Minutes(10);
  std::string version;  // /info's version
  // GET /metrics (TEI serves it on its port too): the coordinator's Prometheus text, behind the
  // read token as the routes are. Unset: 404.
  std::function<std::string()> metrics;
};

class HttpApi {
 public:
  HttpApi(InferenceBackend* backend, HttpApiOptions options) : backend_(backend), options_(std::move(options)) {}
  HttpApi(const HttpApi&) = delete;
  HttpApi& operator=(const HttpApi&) = delete;

  HttpResponse Handle(const HttpRequest& request);

  // Inference requests in progress (the 429 threshold's count).
  int in_flight() const { return in_flight_.load(); }

 private:
  friend class InferencePermit;
  using Struct = google::protobuf::Struct;

  // TEI's routes (tei_routes.cc; tokenizer, info and health: tei_meta_routes.cc).
  HttpResponse TeiEmbed(const Struct& body, const CallContext& call);
  HttpResponse TeiEmbedAll(const Struct& body, const CallContext& call);
  HttpResponse TeiEmbedSparse(const Struct& body, const CallContext& call);
  HttpResponse TeiPredict(const Struct& body, const CallContext& call);
  HttpResponse TeiSimilarity(const Struct& body, const CallContext& call);
  HttpResponse TeiRerank(const Struct& body, const CallContext& call);
  // POST / and /invocations: /embed, /predict or /rerank, as the default job's model is.
  HttpResponse TeiDefaultRoute(const Struct& body, const CallContext& call);
  HttpResponse TeiTokenize(const Struct& body);
  HttpResponse TeiDecode(const Struct& body);
  HttpResponse TeiInfo();
  HttpResponse TeiHealth();
  // OpenAI's (openai_routes.cc).
  HttpResponse OpenAiEmbeddings(const Struct& body, const CallContext& call);
  HttpResponse OpenAiModels(const std::string& model);
  // KServe v2's (kserve_routes.cc): every /v2 route, its access check included (the health
  // routes are open), and infer on `model` at `version`.
  HttpResponse KServe(const HttpRequest& request);
  HttpResponse KServeInfer(const HttpRequest& request, const std::string& model, const std::string& version);

  // Whether the Authorization header carries a token that may read (or none is needed).
  bool Authorized(const std::string& authorization) const;

  InferenceBackend* const backend_;
  const HttpApiOptions options_;
  std::atomic<int> in_flight_{0};
};

}  // namespace bertshard::http

#endif  // BERTSHARD_HTTP_HTTP_API_H_
