// OpenAI's routes of HttpApi against a canned backend (fake_backend.h): the shapes its SDK sends
// and reads, and its error JSON.
#include <cstring>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "http/fake_backend.h"
#include "http/http_api.h"
#include "nlohmann/json.hpp"

namespace bertshard::http {
namespace {

using nlohmann::json;

HttpResponse Call(HttpApi& api, const std::string& method, const std::string& path, const std::string& body,
                  const std::string& authorization = "") {
  HttpRequest request;
  request.method = method;
  request.path = path;
  request.body = body;
  request.authorization = authorization;
  return api.Handle(request);
}

// The base64 OpenAI's SDK decodes: little-endian float32.
std::vector<float> FromBase64(const std::string& text) {
  static const std::string kAlphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string bytes;
  uint32_t buffer = 0;
  int bits = 0;
  for (const char c : text) {
    if (c == '=') break;
    buffer = (buffer << 6) | static_cast<uint32_t>(kAlphabet.find(c));
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      bytes.push_back(static_cast<char>((buffer >> bits) & 0xff));
    }
  }
  std::vector<float> values(bytes.size() / 4);
  std::memcpy(values.data(), bytes.data(), values.size() * 4);
  return values;
}

void ExpectOpenAiError(const HttpResponse& response, int status, const std::string& type, const std::string& code) {
  EXPECT_EQ(response.status, status) << response.body;
  const json body = json::parse(response.body, nullptr, false);
  ASSERT_TRUE(body.is_object() && body.contains("error")) << response.body;
  const json& error = body["error"];
  EXPECT_EQ(error["type"], type) << response.body;
  EXPECT_TRUE(error["message"].is_string() && !error["message"].get<std::string>().empty()) << response.body;
  EXPECT_TRUE(error.contains("param")) << response.body;
  if (code.empty()) {
    EXPECT_TRUE(error["code"].is_null()) << response.body;
  } else {
    EXPECT_EQ(error["code"], code) << response.body;
  }
}

TEST(OpenAiEmbeddings, AnswersInOpenAisShape) {
  FakeBackend backend;
  HttpApi api(&backend, {});
  const HttpResponse response =
      Call(api, "POST", "/v1/embeddings", R"({"input": ["a", "b"], "model": "minilm", "user": "u1"})");
  ASSERT_EQ(response.status, 200) << response.body;
  EXPECT_EQ(json::parse(response.body), json::parse(R"({
      "object": "list",
      "data": [{"object": "embedding", "index": 0, "embedding": [1, 0, 0.5, -1]},
               {"object": "embedding", "index": 1, "embedding": [1, 1, 0.5, -1]}],
      "model": "minilm",
      "usage": {"prompt_tokens": 10, "total_tokens": 10}})"));
  ASSERT_EQ(backend.embeds.size(), 1u);
  EXPECT_EQ(backend.embeds[0].normalize(), v1::NORMALIZE_ON);  // OpenAI's embeddings are unit vectors
  EXPECT_EQ(backend.resolved.back(), "minilm");
}

TEST(OpenAiEmbeddings, TakesTokenIdsDimensionsAndBase64) {
  FakeBackend backend;
  HttpApi api(&backend, {});
  const HttpResponse response = Call(api, "POST", "/v1/embeddings",
                                     R"({"input": [[101, 7592, 102]], "dimensions": 3, "encoding_format": "base64"})");
  ASSERT_EQ(response.status, 200) << response.body;
  const json body = json::parse(response.body);
  ASSERT_TRUE(body["data"][0]["embedding"].is_string()) << response.body;
  EXPECT_EQ(FromBase64(body["data"][0]["embedding"]), (std::vector<float>{1, 0, 0.5}));
  EXPECT_EQ(body["model"], "minilm");  // the job's name, though the request named none
  ASSERT_EQ(backend.embeds.size(), 1u);
  EXPECT_EQ(backend.embeds[0].dimensions(), 3);
  EXPECT_EQ(backend.embeds[0].tokens().rows(), 1);
  // A single token list is one input too (OpenAI's `input: [1, 2, 3]`); TEI's alias answers alike.
  const HttpResponse single = Call(api, "POST", "/embeddings", R"({"input": [101, 102]})");
  ASSERT_EQ(single.status, 200) << single.body;
  EXPECT_EQ(json::parse(single.body)["data"].size(), 1u);
}

TEST(OpenAiEmbeddings, RefusesWithOpenAisErrors) {
  FakeBackend backend;
  HttpApiOptions options;
  options.read_token = "read-secret";
  options.admin_token = "admin-secret";
  options.max_client_batch_size = 2;
  HttpApi api(&backend, options);
  const std::string key = "Bearer read-secret";
  ExpectOpenAiError(Call(api, "POST", "/v1/embeddings", R"({"input": "a"})"), 401, "invalid_request_error",
                    "invalid_api_key");
  ExpectOpenAiError(Call(api, "POST", "/v1/embeddings", R"({"input": "a"})", "Bearer sk-wrong"), 401,
                    "invalid_request_error", "invalid_api_key");
  ExpectOpenAiError(Call(api, "GET", "/v1/models", "", "Bearer sk-wrong"), 401, "invalid_request_error",
                    "invalid_api_key");
  ExpectOpenAiError(Call(api, "POST", "/v1/embeddings", R"({"input": ""})", key), 400, "invalid_request_error", "");
  ExpectOpenAiError(Call(api, "POST", "/v1/embeddings", R"({"input": []})", key), 400, "invalid_request_error", "");
  ExpectOpenAiError(Call(api, "POST", "/v1/embeddings", R"({"input": ["a", "b", "c"]})", key), 400,
                    "invalid_request_error", "");
  ExpectOpenAiError(Call(api, "POST", "/v1/embeddings", R"({"input": "a", "encoding_format": "hex"})", key), 400,
                    "invalid_request_error", "");
  ExpectOpenAiError(Call(api, "POST", "/v1/embeddings", R"({"input": "a", "model": "gpt-4"})", key), 404,
                    "invalid_request_error", "model_not_found");
  ExpectOpenAiError(Call(api, "POST", "/v1/embeddings", R"({"input": "a", "model": "ended"})", key), 404,
                    "invalid_request_error", "model_not_found");  // known, but no longer serving
  ExpectOpenAiError(Call(api, "POST", "/v1/embeddings", "{", key), 400, "invalid_request_error", "");
  EXPECT_TRUE(backend.embeds.empty());
  backend.embed_error = absl::InvalidArgumentError("text has 600 tokens; the model takes at most 256");
  ExpectOpenAiError(Call(api, "POST", "/v1/embeddings", R"({"input": "a"})", key), 400, "invalid_request_error", "");
  backend.embed_error = absl::ResourceExhaustedError("over this client's share");
  ExpectOpenAiError(Call(api, "POST", "/v1/embeddings", R"({"input": "a"})", key), 429, "rate_limit_error",
                    "rate_limit_exceeded");
  backend.embed_error = absl::InternalError("worker answered badly");
  ExpectOpenAiError(Call(api, "POST", "/v1/embeddings", R"({"input": "a"})", key), 500, "server_error", "");
  ExpectOpenAiError(Call(api, "GET", "/v1/nowhere", "", key), 404, "invalid_request_error", "unknown_url");
}

TEST(OpenAiModels, ListsTheServingJobs) {
  FakeBackend backend;
  HttpApi api(&backend, {});
  const HttpResponse list = Call(api, "GET", "/v1/models", "");
  ASSERT_EQ(list.status, 200) << list.body;
  EXPECT_EQ(json::parse(list.body), json::parse(R"({"object": "list", "data": [
      {"id": "minilm", "object": "model", "created": 1700000000, "owned_by": "bertshard"},
      {"id": "sentiment", "object": "model", "created": 0, "owned_by": "bertshard"}]})"));
  const HttpResponse one = Call(api, "GET", "/v1/models/sentiment", "");
  ASSERT_EQ(one.status, 200) << one.body;
  EXPECT_EQ(json::parse(one.body)["id"], "sentiment");
  ExpectOpenAiError(Call(api, "GET", "/v1/models/gpt-4", ""), 404, "invalid_request_error", "model_not_found");
}

}  // namespace
}  // namespace bertshard::http
