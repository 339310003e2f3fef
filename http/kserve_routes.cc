// KServe v2's HTTP/REST routes of HttpApi (http_api.h), over the protocol core (http/kserve.h):
// health, server and model metadata, model readiness and infer, with JSON tensors and the binary
// tensor extension (Inference-Header-Content-Length) that tritonclient.http uses by default.
// Errors are KServe's {"error": MESSAGE}.
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "common/proto_json.h"
#include "http/api_support.h"
#include "http/http_api.h"
#include "http/json_body.h"
#include "http/kserve.h"

namespace bertshard::http {
namespace {

using google::protobuf::Struct;
using google::protobuf::Value;

constexpr char kHeaderLength[] = "Inference-Header-Content-Length";

HttpResponse KServeError(int status, absl::string_view message) {
  std::string body = "{\"error\":";
  common::AppendJsonString(message, &body);
  body.push_back('}');
  HttpResponse response = JsonResponse(std::move(body));
  response.status = status;
  return response;
}

HttpResponse KServeError(const absl::Status& status) {
  return KServeError(kserve::HttpStatusOf(status), status.message());
}

// 405 with the methods the route takes (RFC 9110 15.5.6: Allow is required), in KServe's error shape.
HttpResponse KServeMethodNotAllowed(const char* allowed, absl::string_view message) {
  HttpResponse response = KServeError(405, message);
  response.headers.push_back({"Allow", allowed});
  return response;
}

HttpResponse EmptyOk() {
  HttpResponse response;
  response.content_type = "text/plain; charset=utf-8";
  return response;
}

// `name` of `object` as a JSON object (null when absent); INVALID_ARGUMENT when of another type.
absl::StatusOr<const Struct*> ObjectField(const Struct& object, const std::string& name, const std::string& what) {
  const Value* v = Field(object, name);
  if (v == nullptr) return nullptr;
  if (v->kind_case() != Value::kStructValue) {
    return absl::InvalidArgumentError(absl::StrCat("`", what, name, "` must be an object"));
  }
  return &v->struct_value();
}

// A tensor's `data`, flattened (nested lists are row-major too), into the list of its datatype.
absl::Status ReadData(const Value& data, const std::string& what, kserve::Tensor* tensor) {
  if (data.kind_case() == Value::kListValue) {
    for (const Value& item : data.list_value().values()) {
      if (absl::Status s = ReadData(item, what, tensor); !s.ok()) return s;
    }
    return absl::OkStatus();
  }
  if (tensor->datatype == "BYTES") {
    if (data.kind_case() != Value::kStringValue) {
      return absl::InvalidArgumentError(absl::StrCat("`", what, ".data` of a BYTES tensor must hold strings"));
    }
    tensor->bytes.push_back(data.string_value());
    return absl::OkStatus();
  }
  const bool int32 = tensor->datatype == "INT32";
  if (!int32 && tensor->datatype != "INT64") {
    return absl::InvalidArgumentError(
        absl::StrCat("`", what, "`: datatype ", tensor->datatype, " is not taken (INT64, INT32 or BYTES)"));
  }
  // JSON numbers are doubles: ids are far below 2^53, where they are exact.
  constexpr int64_t kExact = int64_t{1} << 53;
  absl::StatusOr<int64_t> v = WholeNumber(data, what + ".data[]", int32 ? -(int64_t{1} << 31) : -kExact,
                                          int32 ? (int64_t{1} << 31) - 1 : kExact);
  if (!v.ok()) return v.status();
  tensor->ints.push_back(*v);
  return absl::OkStatus();
}

// One of the request's `inputs`; its binary data (binary_data_size) taken from `binary` at `*offset`.
absl::StatusOr<kserve::Tensor> ReadInput(const Value& input, int index, absl::string_view binary, size_t* offset) {
  const std::string what = absl::StrCat("inputs[", index, "]");
  if (input.kind_case() != Value::kStructValue)
    return absl::InvalidArgumentError(absl::StrCat("`", what, "` must be an object"));
  const Struct& object = input.struct_value();
  kserve::Tensor tensor;
  absl::StatusOr<std::string> name = StringField(object, "name", "");
  absl::StatusOr<std::string> datatype = StringField(object, "datatype", "");
  for (const absl::Status& s : {name.status(), datatype.status()}) {
    if (!s.ok()) return absl::InvalidArgumentError(absl::StrCat(what, ": ", s.message()));
  }
  if (name->empty() || datatype->empty()) {
    return absl::InvalidArgumentError(absl::StrCat("`", what, "` needs a `name` and a `datatype`"));
  }
  tensor.name = *name;
  tensor.datatype = *datatype;
  const std::string named = absl::StrCat(what, " (", tensor.name, ")");
  const Value* shape = Field(object, "shape");
  if (shape == nullptr || shape->kind_case() != Value::kListValue) {
    return absl::InvalidArgumentError(absl::StrCat("`", named, ".shape` must be a list of dimensions"));
  }
  for (const Value& d : shape->list_value().values()) {
    absl::StatusOr<int64_t> dim = WholeNumber(d, named + ".shape[]", 0, int64_t{1} << 40);
    if (!dim.ok()) return dim.status();
    tensor.shape.push_back(*dim);
  }
  absl::StatusOr<const Struct*> parameters = ObjectField(object, "parameters", what + ".");
  if (!parameters.ok()) return parameters.status();
  std::optional<int64_t> binary_size;
  if (*parameters != nullptr) {
    if (Field(**parameters, "shared_memory_region") != nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("`", named, "`: shared memory is not supported"));
    }
    absl::StatusOr<std::optional<int64_t>> size = IntField(**parameters, "binary_data_size", 0, int64_t{1} << 40);
    if (!size.ok()) return absl::InvalidArgumentError(absl::StrCat(named, ".parameters: ", size.status().message()));
    binary_size = *size;
  }
  if (binary_size.has_value()) {
    if (static_cast<uint64_t>(*binary_size) > binary.size() - *offset) {
      return absl::InvalidArgumentError(absl::StrCat("`", named, "`: binary_data_size ", *binary_size,
                                                     " runs past the ", binary.size(),
                                                     " bytes of binary data after the JSON header"));
    }
    absl::Status decoded = kserve::DecodeRaw(binary.substr(*offset, static_cast<size_t>(*binary_size)), &tensor);
    *offset += static_cast<size_t>(*binary_size);
    if (!decoded.ok()) return decoded;
    return tensor;
  }
  const Value* data = Field(object, "data");
  if (data == nullptr) return absl::InvalidArgumentError(absl::StrCat("`", named, "` has no `data`"));
  if (absl::Status read = ReadData(*data, named, &tensor); !read.ok()) return read;
  return tensor;
}

// The infer request's body (its JSON header and the binary data after it). `binary_outputs`: per
// requested output, whether it goes back binary; `all_binary`: the same for every output when
// none is named (parameters.binary_data_output).
absl::StatusOr<kserve::InferRequest> ReadInferBody(const Struct& body, absl::string_view binary,
                                                   std::vector<bool>* binary_outputs, bool* all_binary) {
  kserve::InferRequest request;
  absl::StatusOr<std::string> id = StringField(body, "id", "");
  if (!id.ok()) return id.status();
  request.id = *id;
  absl::StatusOr<const Struct*> parameters = ObjectField(body, "parameters", "");
  if (!parameters.ok()) return parameters.status();
  *all_binary = false;
  if (*parameters != nullptr) {
    absl::StatusOr<bool> all = BoolField(**parameters, "binary_data_output", false);
    absl::StatusOr<bool> truncate = BoolField(**parameters, "truncate", false);
    for (const absl::Status& s : {all.status(), truncate.status()}) {
      if (!s.ok()) return absl::InvalidArgumentError(absl::StrCat("parameters: ", s.message()));
    }
    *all_binary = *all;
    request.truncate = *truncate;
  }
  const Value* inputs = Field(body, "inputs");
  if (inputs == nullptr || inputs->kind_case() != Value::kListValue || inputs->list_value().values_size() == 0) {
    return absl::InvalidArgumentError("`inputs` must be a list of tensors");
  }
  size_t offset = 0;
  for (int i = 0; i < inputs->list_value().values_size(); ++i) {
    absl::StatusOr<kserve::Tensor> tensor = ReadInput(inputs->list_value().values(i), i, binary, &offset);
    if (!tensor.ok()) return tensor.status();
    request.inputs.push_back(*std::move(tensor));
  }
  if (offset != binary.size()) {
    return absl::InvalidArgumentError(absl::StrCat(binary.size() - offset, " bytes of binary data after the JSON ",
                                                   "header belong to no input's binary_data_size"));
  }
  const Value* outputs = Field(body, "outputs");
  if (outputs == nullptr) return request;
  if (outputs->kind_case() != Value::kListValue) return absl::InvalidArgumentError("`outputs` must be a list");
  for (int i = 0; i < outputs->list_value().values_size(); ++i) {
    const Value& output = outputs->list_value().values(i);
    const std::string what = absl::StrCat("outputs[", i, "]");
    if (output.kind_case() != Value::kStructValue) {
      return absl::InvalidArgumentError(absl::StrCat("`", what, "` must be an object"));
    }
    absl::StatusOr<std::string> name = StringField(output.struct_value(), "name", "");
    if (!name.ok() || name->empty()) return absl::InvalidArgumentError(absl::StrCat("`", what, "` needs a `name`"));
    absl::StatusOr<const Struct*> params = ObjectField(output.struct_value(), "parameters", what + ".");
    if (!params.ok()) return params.status();
    // The request's binary_data_output is the default; an output's own binary_data overrides it
    // (as Triton's server reads them).
    bool binary_output = *all_binary;
    if (*params != nullptr) {
      if (Field(**params, "classification") != nullptr || Field(**params, "shared_memory_region") != nullptr) {
        return absl::InvalidArgumentError(
            absl::StrCat("`", what, "`: the classification and shared memory extensions are not supported"));
      }
      absl::StatusOr<bool> b = BoolField(**params, "binary_data", binary_output);
      if (!b.ok()) return absl::InvalidArgumentError(absl::StrCat(what, ".parameters: ", b.status().message()));
      binary_output = *b;
    }
    request.outputs.push_back(*name);
    binary_outputs->push_back(binary_output);
  }
  return request;
}

void AppendShape(const std::vector<int64_t>& shape, std::string* out) {
  absl::StrAppend(out, "[", absl::StrJoin(shape, ","), "]");
}

// The answer: JSON, with the outputs that go back binary appended after it.
HttpResponse InferAnswer(const kserve::InferResult& result, const std::vector<bool>& binary_outputs, bool all_binary) {
  std::string json = "{\"model_name\":";
  common::AppendJsonString(result.model_name, &json);
  json.append(",\"model_version\":");
  common::AppendJsonString(result.model_version, &json);
  if (!result.id.empty()) {
    json.append(",\"id\":");
    common::AppendJsonString(result.id, &json);
  }
  json.append(",\"outputs\":[");
  std::string binary;
  bool any_binary = false;
  for (size_t i = 0; i < result.outputs.size(); ++i) {
    const kserve::Tensor& t = result.outputs[i];
    if (i > 0) json.push_back(',');
    json.append("{\"name\":");
    common::AppendJsonString(t.name, &json);
    absl::StrAppend(&json, ",\"datatype\":\"", t.datatype, "\",\"shape\":");
    AppendShape(t.shape, &json);
    const bool as_binary = binary_outputs.empty() ? all_binary : binary_outputs[i];
    if (as_binary) {
      const std::string raw = kserve::EncodeRaw(t);
      absl::StrAppend(&json, ",\"parameters\":{\"binary_data_size\":", raw.size(), "}}");
      binary.append(raw);
      any_binary = true;
      continue;
    }
    json.append(",\"data\":");
    if (t.datatype == "FP32") {
      AppendFloatArray(t.floats, &json);
    } else {
      absl::StrAppend(&json, "[", absl::StrJoin(t.ints, ","), "]");
    }
    json.push_back('}');
  }
  json.append("]}");
  if (!any_binary) return JsonResponse(std::move(json));
  HttpResponse response;
  response.content_type = "application/octet-stream";
  response.headers.push_back({kHeaderLength, std::to_string(json.size())});
  response.body = std::move(json);
  response.body.append(binary);
  return response;
}

}  // namespace

HttpResponse HttpApi::KServe(const HttpRequest& request) {
  const std::string& path = request.path;
  const bool get = request.method == "GET";
  // The probes stay open, as /health and gRPC's health service are.
  if (path == "/v2/health/live" || path == "/v2/health/ready") {
    if (!get) return KServeMethodNotAllowed("GET", "health routes take GET");
    if (path == "/v2/health/live" || kserve::ServerReady(backend_, options_.default_job)) return EmptyOk();
    return KServeError(503, "not ready: no job serves (or the default job does not)");
  }
  if (!Authorized(request.authorization)) {
    HttpResponse response =
        KServeError(401, "bertshard needs its read token (or the cluster token) as the bearer token");
    response.headers.push_back({"WWW-Authenticate", "Bearer"});
    return response;
  }
  if (path == "/v2" || path == "/v2/") {
    if (!get) return KServeMethodNotAllowed("GET", "server metadata takes GET");
    std::string body = "{\"name\":";
    common::AppendJsonString(kserve::kServerName, &body);
    body.append(",\"version\":");
    common::AppendJsonString(options_.version, &body);
    body.append(",\"extensions\":[");
    const std::vector<std::string> extensions = kserve::ServerExtensions();
    for (size_t i = 0; i < extensions.size(); ++i) {
      if (i > 0) body.push_back(',');
      common::AppendJsonString(extensions[i], &body);
    }
    body.append("]}");
    return JsonResponse(std::move(body));
  }
  constexpr absl::string_view kModels = "/v2/models/";
  if (!absl::StartsWith(path, kModels)) return KServeError(404, absl::StrCat("no route ", path));
  // /v2/models/NAME[/versions/V][/ready|/infer]; a name may hold '/' (job names do).
  absl::string_view rest = absl::string_view(path).substr(kModels.size());
  enum class Action { kMetadata, kReady, kInfer } action = Action::kMetadata;
  if (absl::ConsumeSuffix(&rest, "/ready")) {
    action = Action::kReady;
  } else if (absl::ConsumeSuffix(&rest, "/infer")) {
    action = Action::kInfer;
  }
  std::string version;
  if (const size_t at = rest.rfind("/versions/"); at != absl::string_view::npos) {
    const absl::string_view v = rest.substr(at + 10);
    if (!v.empty() && !absl::StrContains(v, '/')) {
      version = std::string(v);
      rest = rest.substr(0, at);
    }
  }
  const std::string model(rest);
  if (model.empty()) return KServeError(404, "no model named in the route");
  if (action == Action::kInfer) {
    if (request.method != "POST") return KServeMethodNotAllowed("POST", "infer takes POST");
    return KServeInfer(request, model, version);
  }
  if (!get) return KServeMethodNotAllowed("GET", "model metadata and readiness take GET");
  absl::StatusOr<ModelInfo> info = kserve::ServingModel(backend_, model, version, options_.default_job);
  if (!info.ok()) return KServeError(info.status());
  if (action == Action::kReady) return EmptyOk();
  const kserve::ModelMetadata metadata = kserve::MetadataOf(*info);
  std::string body = "{\"name\":";
  common::AppendJsonString(model, &body);
  body.append(",\"versions\":[\"1\"],\"platform\":");
  common::AppendJsonString(metadata.platform, &body);
  for (const auto& [key, list] : {std::pair{"inputs", &metadata.inputs}, std::pair{"outputs", &metadata.outputs}}) {
    absl::StrAppend(&body, ",\"", key, "\":[");
    for (size_t i = 0; i < list->size(); ++i) {
      const kserve::TensorMetadata& t = (*list)[i];
      if (i > 0) body.push_back(',');
      body.append("{\"name\":");
      common::AppendJsonString(t.name, &body);
      absl::StrAppend(&body, ",\"datatype\":\"", t.datatype, "\",\"shape\":");
      AppendShape(t.shape, &body);
      body.push_back('}');
    }
    body.push_back(']');
  }
  body.push_back('}');
  return JsonResponse(std::move(body));
}

HttpResponse HttpApi::KServeInfer(const HttpRequest& request, const std::string& model, const std::string& version) {
  if (request.body_too_large) return KServeError(413, "the request body is over the payload limit (--payload_limit)");
  if (const std::string* encoding = FindHeader(request, "Content-Encoding");
      encoding != nullptr && !encoding->empty() && *encoding != "identity") {
    return KServeError(400, absl::StrCat("Content-Encoding ", *encoding, " is not supported: send the body as it is"));
  }
  absl::string_view json = request.body;
  absl::string_view binary;
  if (const std::string* header = FindHeader(request, kHeaderLength); header != nullptr) {
    int64_t length = -1;
    if (!absl::SimpleAtoi(*header, &length) || length < 0 || static_cast<uint64_t>(length) > request.body.size()) {
      return KServeError(400, absl::StrCat(kHeaderLength, " must be the JSON header's length, 0..", request.body.size(),
                                           " (the body's), not '", *header, "'"));
    }
    json = json.substr(0, static_cast<size_t>(length));
    binary = absl::string_view(request.body).substr(static_cast<size_t>(length));
  }
  absl::StatusOr<Struct> body = ParseJsonObject(json);
  if (!body.ok()) return KServeError(400, body.status().message());
  std::vector<bool> binary_outputs;
  bool all_binary = false;
  absl::StatusOr<kserve::InferRequest> infer = ReadInferBody(*body, binary, &binary_outputs, &all_binary);
  if (!infer.ok()) return KServeError(400, infer.status().message());
  infer->model = model;
  infer->version = version;
  InferencePermit permit(&in_flight_, options_.max_concurrent_requests);
  if (!permit.acquired()) return KServeError(429, "the server is overloaded (--max_concurrent_requests)");
  CallContext call;
  call.deadline = absl::Now() + options_.request_timeout;
  call.client = request.client;
  call.connection = request.connection;
  call.max_padded_ids = options_.max_batch_tokens;
  absl::StatusOr<kserve::InferResult> result = kserve::Infer(backend_, *infer, options_.default_job, call);
  if (!result.ok()) return KServeError(result.status());
  return InferAnswer(*result, binary_outputs, all_binary);
}

}  // namespace bertshard::http
