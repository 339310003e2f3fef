// HttpApi's dispatch and access checks; the routes are in tei_routes.cc and openai_routes.cc.
#include "http/http_api.h"

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "http/api_support.h"
#include "http/json_body.h"

namespace bertshard::http {
namespace {

// Compares in time that depends only on the lengths, not on where the first difference is.
bool SameSecret(absl::string_view a, absl::string_view b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

bool IsOpenAiPath(const std::string& path) { return absl::StartsWith(path, "/v1/") || path == "/embeddings"; }

HttpResponse MethodNotAllowed(const char* allowed) {
  HttpResponse response;
  response.status = 405;
  response.content_type = "text/plain; charset=utf-8";
  response.headers = {{"Allow", allowed}};
  return response;
}

}  // namespace

bool HttpApi::Authorized(const std::string& authorization) const {
  if (options_.read_token.empty()) return true;  // as read RPCs: open while no read token is set
  constexpr absl::string_view kScheme = "Bearer ";
  absl::string_view value(authorization);
  if (value.size() <= kScheme.size() || !absl::EqualsIgnoreCase(value.substr(0, kScheme.size()), kScheme)) {
    return false;
  }
  value = absl::StripAsciiWhitespace(value.substr(kScheme.size()));
  const bool read = SameSecret(value, options_.read_token);
  const bool admin = !options_.admin_token.empty() && SameSecret(value, options_.admin_token);
  return read || admin;
}

HttpResponse HttpApi::Handle(const HttpRequest& request) {
  const std::string& path = request.path;
  const bool openai = IsOpenAiPath(path);
  const bool post = request.method == "POST";
  const bool get = request.method == "GET";
  // KServe v2's routes answer in KServe's shapes, their own access check and errors included.
  if (path == "/v2" || absl::StartsWith(path, "/v2/")) return KServe(request);
  // The probes stay open, as gRPC's health service is (TEI's public routes: /health, /ping, /).
  if (path == "/health" || path == "/ping" || (path == "/" && get)) return get ? TeiHealth() : MethodNotAllowed("GET");
  if (!Authorized(request.authorization)) {
    // Never the token itself, and the same answer for a missing and a wrong one.
    if (openai) {
      HttpResponse response = OpenAiError(401, "invalid_request_error",
                                          "Incorrect API key provided: bertshard needs its read token "
                                          "(or the cluster token) as the bearer token",
                                          "invalid_api_key");
      response.headers.push_back({"WWW-Authenticate", "Bearer"});
      return response;
    }
    HttpResponse response;
    response.status = 401;  // TEI's api-key check answers with no body
    response.content_type = "text/plain; charset=utf-8";
    response.headers = {{"WWW-Authenticate", "Bearer"}};
    return response;
  }
  if (path == "/info") return get ? TeiInfo() : MethodNotAllowed("GET");
  if (path == "/metrics" && options_.metrics) {
    if (!get) return MethodNotAllowed("GET");
    HttpResponse response;
    response.status = 200;
    response.content_type = "text/plain; version=0.0.4; charset=utf-8";  // Prometheus' text format
    response.body = options_.metrics();
    return response;
  }
  if (path == "/v1/models" || absl::StartsWith(path, "/v1/models/")) {
    if (!get) return MethodNotAllowed("GET");
    return OpenAiModels(path.size() > 11 ? path.substr(11) : "");
  }
  using Route = HttpResponse (HttpApi::*)(const Struct&, const CallContext&);
  Route inference = nullptr;
  HttpResponse (HttpApi::*tokenizer)(const Struct&) = nullptr;
  if (path == "/embed") {
    inference = &HttpApi::TeiEmbed;
  } else if (path == "/embed_all") {
    inference = &HttpApi::TeiEmbedAll;
  } else if (path == "/embed_sparse") {
    inference = &HttpApi::TeiEmbedSparse;
  } else if (path == "/predict") {
    inference = &HttpApi::TeiPredict;
  } else if (path == "/rerank") {
    inference = &HttpApi::TeiRerank;
  } else if (path == "/similarity") {
    inference = &HttpApi::TeiSimilarity;
  } else if (path == "/v1/embeddings" || path == "/embeddings") {
    inference = &HttpApi::OpenAiEmbeddings;
  } else if (path == "/" || path == "/invocations") {
    // TEI's default route (and SageMaker's): the serving model's own task, as Hugging Face's
    // InferenceClient posts to a URL: embed, predict, or rerank for a one-label classifier.
    inference = &HttpApi::TeiDefaultRoute;
  } else if (path == "/tokenize") {
    tokenizer = &HttpApi::TeiTokenize;
  } else if (path == "/decode") {
    tokenizer = &HttpApi::TeiDecode;
  } else {
    if (openai) return OpenAiError(404, "invalid_request_error", absl::StrCat("no route ", path), "unknown_url");
    HttpResponse response;
    response.status = 404;  // as TEI's router: no body
    response.content_type = "text/plain; charset=utf-8";
    return response;
  }
  if (!post) return MethodNotAllowed("POST");
  if (request.body_too_large) {
    const ApiError error =
        MakeError(TeiErrorType::kValidation, "Failed to buffer the request body: length limit exceeded");
    return openai ? OpenAiError(413, "invalid_request_error", error.message, "") : TeiError(error);
  }
  absl::StatusOr<Struct> body = ParseJsonObject(request.body);
  if (!body.ok()) {
    const ApiError error = MalformedRequest(std::string(body.status().message()));
    return openai ? OpenAiError(error) : TeiError(error);
  }
  if (tokenizer != nullptr) return (this->*tokenizer)(*body);
  // TEI's try_acquire_permit: past max_concurrent_requests, 429 at once rather than a queue.
  InferencePermit permit(&in_flight_, options_.max_concurrent_requests);
  if (!permit.acquired()) {
    const ApiError error = MakeError(TeiErrorType::kOverloaded, "Model is overloaded");
    return openai ? OpenAiError(error) : TeiError(error);
  }
  CallContext call;
  call.deadline = absl::Now() + options_.request_timeout;
  call.client = request.client;
  call.connection = request.connection;
  call.max_padded_ids = options_.max_batch_tokens;
  return (this->*inference)(*body, call);
}

}  // namespace bertshard::http
