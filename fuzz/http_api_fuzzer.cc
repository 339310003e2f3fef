// Fuzz target: bytes -> an HTTP request to the coordinator's HTTP API (http/http_api.h): the first
// byte picks a route (TEI's /embed, /embed_all, /predict, /rerank, /similarity, /tokenize, /decode, /info, POST /;
// OpenAI's /v1/embeddings, /v1/models/ID), the rest is the body, answered by a canned backend (http/fake_backend.h).
// Every request must get an answer with a known status whose JSON body parses, never a crash.
#include <cstdint>
#include <cstdlib>
#include <string>

#include "google/protobuf/struct.pb.h"
#include "google/protobuf/stubs/logging.h"
#include "google/protobuf/util/json_util.h"
#include "http/fake_backend.h"
#include "http/http_api.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const bool quiet = [] {
    google::protobuf::SetLogHandler([](google::protobuf::LogLevel, const char*, int, const std::string&) {});
    return true;
  }();
  (void)quiet;
  if (size == 0) return 0;
  static const char* const kRoutes[][2] = {
      {"POST", "/embed"},  {"POST", "/embed_all"},     {"POST", "/predict"}, {"POST", "/tokenize"},
      {"POST", "/decode"}, {"POST", "/v1/embeddings"}, {"GET", "/info"},     {"GET", "/v1/models/minilm"},
  };
  bertshard::http::FakeBackend backend;
  bertshard::http::HttpApiOptions options;
  options.max_client_batch_size = 8;
  bertshard::http::HttpApi api(&backend, options);
  bertshard::http::HttpRequest request;
  const auto& route = kRoutes[data[0] % (sizeof(kRoutes) / sizeof(kRoutes[0]))];
  request.method = route[0];
  request.path = route[1];
  request.body.assign(reinterpret_cast<const char*>(data + 1), size - 1);
  const bertshard::http::HttpResponse response = api.Handle(request);
  switch (response.status) {
    case 200:
    case 400:
    case 401:
    case 404:
    case 405:
    case 413:
    case 422:
    case 424:
    case 429:
    case 500:
    case 503:
      break;
    default:
      std::abort();  // a status no route answers
  }
  if (response.content_type == "application/json") {
    google::protobuf::Value parsed;
    if (!google::protobuf::util::JsonStringToMessage(response.body, &parsed).ok()) std::abort();
  }
  return 0;
}
