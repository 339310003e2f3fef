// OpenAI's routes of HttpApi (http_api.h): POST /v1/embeddings in the shapes of OpenAI's API
// reference (what its SDK sends and reads), and GET /v1/models listing the serving jobs.
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/proto_json.h"
#include "http/api_support.h"
#include "http/http_api.h"
#include "http/json_body.h"

namespace bertshard::http {
namespace {

using google::protobuf::Struct;

void AppendModel(const ModelInfo& model, std::string* out) {
  *out += "{\"id\":";
  common::AppendJsonString(model.public_name(), out);
  absl::StrAppend(out, ",\"object\":\"model\",\"created\":", model.created_unix_seconds,
                  ",\"owned_by\":\"bertshard\"}");
}

HttpResponse InvalidRequest(const std::string& message) {
  return OpenAiError(400, "invalid_request_error", message, "");
}

}  // namespace

HttpResponse HttpApi::OpenAiEmbeddings(const Struct& body, const CallContext& call) {
  const absl::Time start = absl::Now();
  absl::StatusOr<ParsedInputs> inputs = ParseInputs(body, "input");
  if (!inputs.ok()) return InvalidRequest(std::string(inputs.status().message()));
  if (inputs->items.empty()) return InvalidRequest("'$.input' is invalid: it must not be an empty list");
  for (const InputItem& item : inputs->items) {
    if (item.is_ids ? item.ids.empty() : item.text.empty()) {
      return InvalidRequest("'$.input' is invalid: an input must not be empty");
    }
  }
  if (static_cast<int64_t>(inputs->items.size()) > options_.max_client_batch_size) {
    return InvalidRequest(absl::StrCat("'$.input' has ", inputs->items.size(), " inputs; at most ",
                                       options_.max_client_batch_size, " are taken per request"));
  }
  absl::StatusOr<std::string> model = StringField(body, "model", "");
  absl::StatusOr<std::string> format = StringField(body, "encoding_format", "float");
  absl::StatusOr<std::optional<int64_t>> dimensions = IntField(body, "dimensions", 1, 1 << 20);
  absl::StatusOr<std::string> user = StringField(body, "user", "");
  for (const absl::Status& s : {model.status(), format.status(), dimensions.status(), user.status()}) {
    if (!s.ok()) return InvalidRequest(std::string(s.message()));
  }
  if (*format != "float" && *format != "base64") {
    return InvalidRequest(absl::StrCat("encoding_format must be 'float' or 'base64', not '", *format, "'"));
  }
  ApiError error;
  absl::StatusOr<std::string> job = ResolveModel(backend_, *model, options_.default_job, &error);
  if (!job.ok()) {
    if (error.type == TeiErrorType::kUnhealthy) return OpenAiError(error);
    return OpenAiError(404, "invalid_request_error", error.message, "model_not_found");
  }
  absl::StatusOr<ModelInfo> info = backend_->Model(*job);
  if (!info.ok()) {
    // A job that is not serving (ended, pending, loading) is not a model one can use: 404, as
    // OpenAI answers a model one has no access to; a recovering one is 503 (retry).
    if (info.status().code() == absl::StatusCode::kUnavailable) return OpenAiError(FromStatus(info.status()));
    return OpenAiError(404, "invalid_request_error", std::string(info.status().message()), "model_not_found");
  }
  // OpenAI's embeddings are unit vectors (and its `dimensions` shortens them and normalises again).
  v1::EmbedRequest base;
  base.set_normalize(v1::NORMALIZE_ON);
  base.set_dimensions(static_cast<int32_t>(dimensions->value_or(0)));
  absl::StatusOr<EmbedOutcome> outcome = EmbedItems(backend_, *job, inputs->items, base, call);
  if (!outcome.ok()) return OpenAiError(FromStatus(outcome.status()));
  const bool base64 = *format == "base64";
  std::string out = "{\"object\":\"list\",\"data\":[";
  for (size_t i = 0; i < outcome->vectors.size(); ++i) {
    absl::StrAppend(&out, i > 0 ? "," : "", "{\"object\":\"embedding\",\"index\":", i, ",\"embedding\":");
    const std::vector<float>& v = outcome->vectors[i];
    if (base64) {
      // Little-endian float32, as numpy.frombuffer(base64.b64decode(s), dtype="float32") reads it.
      static_assert(sizeof(float) == 4);
      std::string bytes(v.size() * 4, '\0');
      for (size_t k = 0; k < v.size(); ++k) {
        uint32_t u;
        std::memcpy(&u, &v[k], 4);
        for (int b = 0; b < 4; ++b) bytes[k * 4 + b] = static_cast<char>((u >> (8 * b)) & 0xff);
      }
      absl::StrAppend(&out, "\"", Base64(bytes), "\"");
    } else {
      AppendFloatArray(v, &out);
    }
    out.push_back('}');
  }
  out += "],\"model\":";
  common::AppendJsonString(info->public_name(), &out);
  absl::StrAppend(&out, ",\"usage\":{\"prompt_tokens\":", outcome->tokens, ",\"total_tokens\":", outcome->tokens, "}}");
  return JsonResponse(std::move(out),
                      TimingHeaders(start, outcome->times, CountCharacters(inputs->items), outcome->tokens));
}

HttpResponse HttpApi::OpenAiModels(const std::string& model) {
  if (!model.empty()) {
    const absl::StatusOr<std::string> job = backend_->ResolveJob(model);
    for (const ModelInfo& info : backend_->ServingModels()) {
      if (job.ok() && info.job_id == *job) {
        std::string out;
        AppendModel(info, &out);
        return JsonResponse(std::move(out));
      }
    }
    return OpenAiError(404, "invalid_request_error",
                       absl::StrCat("The model '", model, "' does not exist or is not serving"), "model_not_found");
  }
  std::string out = "{\"object\":\"list\",\"data\":[";
  const std::vector<ModelInfo> models = backend_->ServingModels();
  for (size_t i = 0; i < models.size(); ++i) {
    if (i > 0) out.push_back(',');
    AppendModel(models[i], &out);
  }
  out += "]}";
  return JsonResponse(std::move(out));
}

}  // namespace bertshard::http
