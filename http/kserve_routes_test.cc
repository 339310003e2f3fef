// KServe v2's /v2 routes of HttpApi against a canned backend (fake_backend.h): health, metadata,
// readiness and infer, JSON tensors and the binary tensor extension as tritonclient.http sends
// them, and KServe's {"error": ...} for every refusal.
#include <cstring>
#include <map>
#include <string>

#include "gtest/gtest.h"
#include "http/fake_backend.h"
#include "http/http_api.h"
#include "nlohmann/json.hpp"

namespace bertshard::http {
namespace {

using nlohmann::json;

class KServeRoutesTest : public ::testing::Test {
 protected:
  HttpResponse Send(const std::string& method, const std::string& path, const std::string& body = "",
                    std::vector<std::pair<std::string, std::string>> headers = {}) {
    HttpRequest request;
    request.method = method;
    request.path = path;
    request.body = body;
    request.headers = std::move(headers);
    request.authorization = authorization_;
    if (api_ == nullptr) api_ = std::make_unique<HttpApi>(&backend_, options_);
    return api_->Handle(request);
  }
  static std::string Header(const HttpResponse& response, const std::string& name) {
    for (const auto& [key, value] : response.headers) {
      if (key == name) return value;
    }
    return "";
  }
  // KServe's error body: {"error": MESSAGE} and nothing else.
  static void ExpectError(const HttpResponse& response, int status, const std::string& part) {
    EXPECT_EQ(response.status, status) << response.body;
    if (status == 405) {
      // The methods the route takes (RFC 9110: a 405 carries Allow), as `part` names them.
      bool allow = false;
      for (const auto& [name, value] : response.headers) allow |= name == "Allow" && value == part;
      EXPECT_TRUE(allow) << "no Allow: " << part << " header on " << response.body;
    }
    const json body = json::parse(response.body, nullptr, false);
    ASSERT_TRUE(body.is_object()) << response.body;
    EXPECT_EQ(body.size(), 1u) << response.body;
    EXPECT_NE(body.value("error", "").find(part), std::string::npos) << response.body;
  }
  static std::string Int64s(std::initializer_list<int64_t> values) {
    std::string raw;
    for (const int64_t v : values) raw.append(reinterpret_cast<const char*>(&v), 8);  // little-endian here
    return raw;
  }

  FakeBackend backend_;
  HttpApiOptions options_;
  std::string authorization_;
  std::unique_ptr<HttpApi> api_;
};

TEST_F(KServeRoutesTest, HealthIsOpenAndReadyFollowsTheDefaultJob) {
  options_.read_token = "secret";
  EXPECT_EQ(Send("GET", "/v2/health/live").status, 200);
  EXPECT_EQ(Send("GET", "/v2/health/ready").status, 200);
  ExpectError(Send("POST", "/v2/health/live"), 405, "GET");
  api_.reset();
  options_.default_job = "ended";
  ExpectError(Send("GET", "/v2/health/ready"), 503, "not ready");
}

TEST_F(KServeRoutesTest, EverythingElseNeedsTheToken) {
  options_.read_token = "secret";
  const HttpResponse refused = Send("GET", "/v2");
  ExpectError(refused, 401, "read token");
  EXPECT_EQ(Header(refused, "WWW-Authenticate"), "Bearer");
  ExpectError(Send("POST", "/v2/models/minilm/infer", "{}"), 401, "read token");
  authorization_ = "Bearer secret";
  EXPECT_EQ(Send("GET", "/v2").status, 200);
}

TEST_F(KServeRoutesTest, ServerAndModelMetadata) {
  options_.version = "bertshard-coordinator";
  const json server = json::parse(Send("GET", "/v2").body);
  EXPECT_EQ(server["name"], "bertshard");
  EXPECT_EQ(server["version"], "bertshard-coordinator");
  EXPECT_EQ(server["extensions"], json::array({"binary_tensor_data"}));
  for (const char* path : {"/v2/models/minilm", "/v2/models/minilm/versions/1", "/v2/models/job-1"}) {
    SCOPED_TRACE(path);
    const HttpResponse answer = Send("GET", path);
    ASSERT_EQ(answer.status, 200) << answer.body;
    const json model = json::parse(answer.body);
    EXPECT_EQ(model["versions"], json::array({"1"}));
    EXPECT_EQ(model["platform"], "bertshard_BertModel");
    EXPECT_EQ(model["inputs"][0], json({{"name", "input_ids"}, {"datatype", "INT64"}, {"shape", {-1, -1}}}));
    EXPECT_EQ(model["outputs"][0]["name"], "last_hidden_state");
    EXPECT_EQ(model["outputs"][0]["shape"], json({-1, -1, 4}));
  }
  EXPECT_EQ(json::parse(Send("GET", "/v2/models/minilm").body)["name"], "minilm");
  EXPECT_EQ(Send("GET", "/v2/models/minilm/ready").status, 200);
  EXPECT_EQ(Send("GET", "/v2/models/sentiment/versions/1/ready").status, 200);
  ExpectError(Send("GET", "/v2/models/gpt-4"), 404, "unknown model 'gpt-4'");
  ExpectError(Send("GET", "/v2/models/gpt-4/ready"), 404, "unknown model");
  ExpectError(Send("GET", "/v2/models/minilm/versions/2"), 404, "no version '2'");
  ExpectError(Send("GET", "/v2/models/ended/ready"), 400, "will not serve again");
  ExpectError(Send("GET", "/v2/models/loading/ready"), 503, "not ready");
  ExpectError(Send("GET", "/v2/repository/index"), 404, "no route");
  ExpectError(Send("POST", "/v2/models/minilm"), 405, "GET");
  ExpectError(Send("GET", "/v2/models/minilm/infer"), 405, "POST");
}

TEST_F(KServeRoutesTest, InferWithJsonTensors) {
  const HttpResponse answer = Send("POST", "/v2/models/minilm/infer", R"({"id": "r1", "inputs": [
      {"name": "input_ids", "datatype": "INT64", "shape": [1, 3], "data": [[101, 7592, 102]]},
      {"name": "attention_mask", "datatype": "INT64", "shape": [1, 3], "data": [1, 1, 1]}]})");
  ASSERT_EQ(answer.status, 200) << answer.body;
  EXPECT_EQ(answer.content_type, "application/json");
  ASSERT_EQ(backend_.infers.size(), 1u);
  const v1::TokenInputs& sent = backend_.infers[0].tokens();
  EXPECT_EQ(sent.rows(), 1);
  EXPECT_EQ(sent.seq(), 3);
  EXPECT_EQ(sent.input_ids(1), 7592);
  EXPECT_EQ(sent.attention_mask_size(), 3);
  const json body = json::parse(answer.body);
  EXPECT_EQ(body["model_name"], "minilm");
  EXPECT_EQ(body["model_version"], "1");
  EXPECT_EQ(body["id"], "r1");
  ASSERT_EQ(body["outputs"].size(), 1u);
  const json& hidden = body["outputs"][0];
  EXPECT_EQ(hidden["name"], "last_hidden_state");
  EXPECT_EQ(hidden["datatype"], "FP32");
  EXPECT_EQ(hidden["shape"], json({1, 4, 2}));
  // The fake's hidden state of row 0: (0, position) per token, flattened row-major.
  EXPECT_EQ(hidden["data"], json({0, 0, 0, 1, 0, 2, 0, 3}));
}

TEST_F(KServeRoutesTest, InferWithBinaryTensorsAsTritonclientSendsThem) {
  // tritonclient.http: the JSON header, then each input's raw bytes in order; the header's length in
  // Inference-Header-Content-Length; outputs asked for binary.
  const std::string header = R"({"inputs": [
      {"name": "input_ids", "datatype": "INT64", "shape": [1, 2], "parameters": {"binary_data_size": 16}},
      {"name": "token_type_ids", "datatype": "INT64", "shape": [1, 2], "parameters": {"binary_data_size": 16}}],
      "outputs": [{"name": "last_hidden_state", "parameters": {"binary_data": true}},
                  {"name": "attention_mask", "parameters": {"binary_data": false}}]})";
  const HttpResponse answer =
      Send("POST", "/v2/models/minilm/versions/1/infer", header + Int64s({101, 102}) + Int64s({0, 1}),
           {{"inference-header-content-length", std::to_string(header.size())}});
  ASSERT_EQ(answer.status, 200) << answer.body;
  ASSERT_EQ(backend_.infers.size(), 1u);
  EXPECT_EQ(backend_.infers[0].tokens().input_ids(1), 102);
  EXPECT_EQ(backend_.infers[0].tokens().token_type_ids(1), 1);
  const std::string length = Header(answer, "Inference-Header-Content-Length");
  ASSERT_FALSE(length.empty());
  const size_t json_size = std::stoul(length);
  const json body = json::parse(answer.body.substr(0, json_size));
  const json& hidden = body["outputs"][0];
  EXPECT_EQ(hidden["parameters"]["binary_data_size"], 1 * 4 * 2 * 4);
  EXPECT_FALSE(hidden.contains("data"));
  EXPECT_EQ(body["outputs"][1]["name"], "attention_mask");
  EXPECT_EQ(body["outputs"][1]["data"], json({1, 1, 1, 0}));
  const std::string raw = answer.body.substr(json_size);
  ASSERT_EQ(raw.size(), 32u);
  float values[8];
  std::memcpy(values, raw.data(), sizeof(values));
  EXPECT_EQ(values[7], 3.0f);  // row 0, position 3
}

TEST_F(KServeRoutesTest, AllOutputsBinaryWhenNoneIsNamed) {
  const std::string header = R"({"inputs": [{"name": "text", "datatype": "BYTES", "shape": [2],
      "parameters": {"binary_data_size": 13}}], "parameters": {"binary_data_output": true, "truncate": true}})";
  const std::string texts = std::string("\x05\0\0\0hello", 9) + std::string("\0\0\0\0", 4);
  ASSERT_EQ(texts.size(), 13u);
  const HttpResponse answer = Send("POST", "/v2/models/sentiment/infer", header + texts,
                                   {{"Inference-Header-Content-Length", std::to_string(header.size())}});
  ASSERT_EQ(answer.status, 200) << answer.body;
  EXPECT_EQ(answer.content_type, "application/octet-stream");
  ASSERT_EQ(backend_.infers.size(), 1u);
  const v1::InferRequest& sent = backend_.infers[0];
  ASSERT_EQ(sent.text().texts_size(), 2);
  EXPECT_EQ(sent.text().texts(0), "hello");
  EXPECT_EQ(sent.text().texts(1), "");
  EXPECT_TRUE(sent.truncate());
  const size_t json_size = std::stoul(Header(answer, "Inference-Header-Content-Length"));
  const json body = json::parse(answer.body.substr(0, json_size));
  EXPECT_EQ(body["outputs"][0]["name"], "logits");
  EXPECT_EQ(body["outputs"][0]["parameters"]["binary_data_size"], 2 * 2 * 4);
  EXPECT_EQ(answer.body.size() - json_size, 16u);
}

TEST_F(KServeRoutesTest, BadInputIsAnErrorAndNothingIsSent) {
  const std::string ids = R"({"name": "input_ids", "datatype": "INT64", "shape": [1, 1], "data": [5]})";
  const std::string binary_ids =
      R"({"inputs": [{"name": "input_ids", "datatype": "INT64", "shape": [1, 1], "parameters": {"binary_data_size": 8}}]})";
  const struct {
    const char* what;
    std::string body;
    std::vector<std::pair<std::string, std::string>> headers;
    int status;
    const char* message;
  } cases[] = {
      {"not json", "{not json", {}, 400, "not valid JSON"},
      {"no inputs", "{}", {}, 400, "`inputs` must be a list"},
      {"unknown input",
       R"({"inputs": [{"name": "x", "datatype": "INT64", "shape": [1], "data": [1]}]})",
       {},
       400,
       "unknown input 'x'"},
      {"no datatype",
       R"({"inputs": [{"name": "input_ids", "shape": [1, 1], "data": [1]}]})",
       {},
       400,
       "needs a `name` and a `datatype`"},
      {"bad shape",
       R"({"inputs": [{"name": "input_ids", "datatype": "INT64", "shape": [1.5], "data": [1]}]})",
       {},
       400,
       "shape[]"},
      {"no data",
       R"({"inputs": [{"name": "input_ids", "datatype": "INT64", "shape": [1, 1]}]})",
       {},
       400,
       "has no `data`"},
      {"string ids",
       R"({"inputs": [{"name": "input_ids", "datatype": "INT64", "shape": [1, 1], "data": ["a"]}]})",
       {},
       400,
       "whole number"},
      {"count",
       R"({"inputs": [{"name": "input_ids", "datatype": "INT64", "shape": [1, 2], "data": [1]}]})",
       {},
       400,
       "1 values for shape [1, 2]"},
      {"unknown output",
       absl::StrCat(R"({"inputs": [)", ids, R"(], "outputs": [{"name": "probs"}]})"),
       {},
       400,
       "unknown output 'probs'"},
      {"classification",
       absl::StrCat(R"({"inputs": [)", ids,
                    R"(], "outputs": [{"name": "logits", "parameters": {"classification": 2}}]})"),
       {},
       400,
       "classification"},
      {"header length",
       absl::StrCat(R"({"inputs": [)", ids, "]}"),
       {{"Inference-Header-Content-Length", "9999"}},
       400,
       "Inference-Header-Content-Length"},
      {"binary past the end",
       binary_ids + "abc",
       {{"Inference-Header-Content-Length", std::to_string(binary_ids.size())}},
       400,
       "runs past the 3 bytes"},
      {"binary left over",
       absl::StrCat(R"({"inputs": [)", ids, "]}", std::string(8, '\0')),
       {{"Inference-Header-Content-Length", std::to_string(absl::StrCat(R"({"inputs": [)", ids, "]}").size())}},
       400,
       "belong to no input"},
      {"gzip", absl::StrCat(R"({"inputs": [)", ids, "]}"), {{"Content-Encoding", "gzip"}}, 400, "not supported"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.what);
    ExpectError(Send("POST", "/v2/models/minilm/infer", c.body, c.headers), c.status, c.message);
  }
  EXPECT_TRUE(backend_.infers.empty());
  ExpectError(Send("POST", "/v2/models/gpt-4/infer", absl::StrCat(R"({"inputs": [)", ids, "]}")), 404, "unknown model");
  ExpectError(Send("POST", "/v2/models/ended/infer", absl::StrCat(R"({"inputs": [)", ids, "]}")), 400, "CANCELLED");
  ExpectError(Send("POST", "/v2/models/loading/infer", absl::StrCat(R"({"inputs": [)", ids, "]}")), 503, "not ready");
  // The request path's refusals keep their meaning.
  backend_.infer_error = absl::ResourceExhaustedError("over the client's share");
  ExpectError(Send("POST", "/v2/models/minilm/infer", absl::StrCat(R"({"inputs": [)", ids, "]}")), 429, "share");
  backend_.infer_error = absl::InvalidArgumentError("token id 99999 outside the vocabulary");
  ExpectError(Send("POST", "/v2/models/minilm/infer", absl::StrCat(R"({"inputs": [)", ids, "]}")), 400, "vocabulary");
}

TEST_F(KServeRoutesTest, OverThePayloadLimit) {
  HttpRequest request;
  request.method = "POST";
  request.path = "/v2/models/minilm/infer";
  request.body_too_large = true;
  HttpApi api(&backend_, options_);
  ExpectError(api.Handle(request), 413, "payload limit");
}

}  // namespace
}  // namespace bertshard::http
