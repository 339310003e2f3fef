// TEI's routes of HttpApi (http_api.h) that run no forward: /tokenize and /decode on the job's
// tokenizer, /info and /health. Shapes as text-embeddings-inference's router.
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/proto_json.h"
#include "http/api_support.h"
#include "http/http_api.h"
#include "http/json_body.h"

namespace bertshard::http {

using google::protobuf::Struct;
using google::protobuf::Value;

HttpResponse HttpApi::TeiTokenize(const Struct& body) {
  ApiError error;
  absl::StatusOr<ParsedInputs> inputs = ParseInputs(body, "inputs");
  if (!inputs.ok()) return TeiError(MalformedRequest(std::string(inputs.status().message())));
  for (const InputItem& item : inputs->items) {
    if (item.is_ids) return TeiError(MalformedRequest("`inputs` must be a string or a list of strings"));
  }
  if (inputs->batch && inputs->items.empty())
    return TeiError(MakeError(TeiErrorType::kEmpty, "`inputs` cannot be empty"));
  if (static_cast<int64_t>(inputs->items.size()) > options_.max_client_batch_size) {
    return TeiError(MakeError(TeiErrorType::kValidation,
                              absl::StrCat("batch size ", inputs->items.size(), " > maximum allowed batch size ",
                                           options_.max_client_batch_size)));
  }
  absl::StatusOr<bool> special = BoolField(body, "add_special_tokens", true);
  absl::StatusOr<std::string> model = StringField(body, "model", "");
  for (const absl::Status& s : {special.status(), model.status()}) {
    if (!s.ok()) return TeiError(MalformedRequest(std::string(s.message())));
  }
  absl::StatusOr<std::string> prompt_name = StringField(body, "prompt_name", "");
  if (!prompt_name.ok()) return TeiError(MalformedRequest(std::string(prompt_name.status().message())));
  if (Field(body, "prompt_name") != nullptr && prompt_name->empty()) {
    return TeiError(MalformedRequest("prompt_name is empty: name one of the model's prompts, or leave it out"));
  }
  absl::StatusOr<std::string> job = ResolveModel(backend_, *model, options_.default_job, &error);
  if (!job.ok()) return TeiError(error);
  // The tokens /embed would run: the prompt (the model's default when none is named) first.
  if (!PromptInputs(backend_, *prompt_name, *job, &inputs->items, &error)) return TeiError(error);
  std::string out = "[";
  for (size_t i = 0; i < inputs->items.size(); ++i) {
    absl::StatusOr<std::vector<TokenInfo>> tokens = backend_->Tokenize(*job, inputs->items[i].text, *special);
    if (!tokens.ok()) {
      ApiError refused = FromStatus(tokens.status());
      if (tokens.status().code() == absl::StatusCode::kInvalidArgument) {
        refused = MakeError(TeiErrorType::kTokenizer, std::string(tokens.status().message()));
      }
      return TeiError(refused);
    }
    absl::StrAppend(&out, i > 0 ? "," : "", "[");
    for (size_t k = 0; k < tokens->size(); ++k) {
      const TokenInfo& t = (*tokens)[k];
      absl::StrAppend(&out, k > 0 ? "," : "", "{\"id\":", t.id, ",\"text\":");
      common::AppendJsonString(t.text, &out);
      // bertshard's tokenizer keeps no character offsets: start and stop are null (docs/http.md).
      absl::StrAppend(&out, ",\"special\":", t.special ? "true" : "false", ",\"start\":null,\"stop\":null}");
    }
    out.push_back(']');
  }
  out.push_back(']');
  return JsonResponse(std::move(out));
}

HttpResponse HttpApi::TeiDecode(const Struct& body) {
  ApiError error;
  const Value* ids = Field(body, "ids");
  if (ids == nullptr || ids->kind_case() != Value::kListValue) {
    return TeiError(MalformedRequest("`ids` must be a list of token ids or a list of token-id lists"));
  }
  Struct wrapped;
  (*wrapped.mutable_fields())["ids"] = *ids;
  absl::StatusOr<ParsedInputs> lists = ParseInputs(wrapped, "ids");
  if (!lists.ok()) return TeiError(MalformedRequest(std::string(lists.status().message())));
  if (ids->list_value().values_size() == 0) return TeiError(MakeError(TeiErrorType::kEmpty, "`ids` cannot be empty"));
  for (const InputItem& item : lists->items) {
    if (!item.is_ids)
      return TeiError(MalformedRequest("`ids` must be a list of token ids or a list of token-id lists"));
  }
  if (static_cast<int64_t>(lists->items.size()) > options_.max_client_batch_size) {
    return TeiError(MakeError(TeiErrorType::kValidation,
                              absl::StrCat("batch size ", lists->items.size(), " > maximum allowed batch size ",
                                           options_.max_client_batch_size)));
  }
  absl::StatusOr<bool> skip = BoolField(body, "skip_special_tokens", true);
  absl::StatusOr<std::string> model = StringField(body, "model", "");
  for (const absl::Status& s : {skip.status(), model.status()}) {
    if (!s.ok()) return TeiError(MalformedRequest(std::string(s.message())));
  }
  if (!*skip) {
    return TeiError(
        MalformedRequest("skip_special_tokens false is not supported: bertshard decodes as HF's "
                         "decode(skip_special_tokens=True)"));
  }
  absl::StatusOr<std::string> job = ResolveModel(backend_, *model, options_.default_job, &error);
  if (!job.ok()) return TeiError(error);
  std::string out = "[";
  for (size_t i = 0; i < lists->items.size(); ++i) {
    absl::StatusOr<std::string> text = backend_->Decode(*job, lists->items[i].ids);
    if (!text.ok()) {
      ApiError refused = FromStatus(text.status());
      if (text.status().code() == absl::StatusCode::kInvalidArgument) {
        refused = MakeError(TeiErrorType::kTokenizer, std::string(text.status().message()));
      }
      return TeiError(refused);
    }
    if (i > 0) out.push_back(',');
    common::AppendJsonString(*text, &out);
  }
  out.push_back(']');
  return JsonResponse(std::move(out));
}

HttpResponse HttpApi::TeiInfo() {
  ApiError error;
  absl::StatusOr<std::string> job = ResolveModel(backend_, "", options_.default_job, &error);
  if (!job.ok()) return TeiError(error);
  absl::StatusOr<ModelInfo> model = backend_->Model(*job);
  if (!model.ok()) return TeiError(FromStatus(model.status()));
  std::string out = "{\"model_id\":";
  common::AppendJsonString(model->public_name(), &out);
  out += ",\"model_sha\":null,\"model_dtype\":";
  common::AppendJsonString(model->dtype, &out);
  out += ",\"model_type\":";
  if (model->variant == v1::BERT_MODEL) {
    out += "{\"embedding\":{\"pooling\":";
    common::AppendJsonString(model->pooling, &out);
    out += "}}";
  } else if (model->variant == v1::BERT_FOR_MASKED_LM) {
    out += "{\"embedding\":{\"pooling\":\"splade\"}}";  // as TEI describes a model it serves /embed_sparse for
  } else if (model->variant == v1::BERT_FOR_SEQUENCE_CLASSIFICATION) {
    std::string id2label = "{", label2id = "{";
    for (size_t i = 0; i < model->labels.size(); ++i) {
      const char* comma = i > 0 ? "," : "";
      absl::StrAppend(&id2label, comma, "\"", i, "\":");
      common::AppendJsonString(model->labels[i], &id2label);
      label2id += comma;
      common::AppendJsonString(model->labels[i], &label2id);
      absl::StrAppend(&label2id, ":", i);
    }
    // TEI calls a one-label classifier a reranker (a cross-encoder), and clients pick /rerank by it.
    absl::StrAppend(&out, model->labels.size() == 1 ? "{\"reranker\"" : "{\"classifier\"", ":{\"id2label\":", id2label,
                    "},\"label2id\":", label2id, "}}}");
  } else {
    // Not one of TEI's kinds: the HF class, so that a reader sees what serves.
    out += "{\"other\":{\"architecture\":";
    common::AppendJsonString(model->architecture, &out);
    out += "}}";
  }
  absl::StrAppend(&out, ",\"max_concurrent_requests\":", options_.max_concurrent_requests,
                  ",\"max_input_length\":", model->max_input_length,
                  ",\"max_batch_tokens\":", options_.max_batch_tokens,
                  ",\"max_batch_requests\":", options_.max_batch_requests,
                  ",\"max_client_batch_size\":", options_.max_client_batch_size,
                  ",\"auto_truncate\":false,\"tokenization_workers\":1,\"version\":");
  common::AppendJsonString(options_.version, &out);
  out += ",\"sha\":null,\"docker_label\":null}";
  return JsonResponse(std::move(out));
}

HttpResponse HttpApi::TeiHealth() {
  ApiError error;
  absl::StatusOr<std::string> job = ResolveModel(backend_, "", options_.default_job, &error);
  absl::Status serving = job.status();
  if (job.ok()) serving = backend_->Model(*job).status();
  if (!serving.ok()) {
    // /health needs no token: with a read token set, its answer names no job (as /metrics and
    // ListJobs hide them from callers without it).
    return TeiError(MakeError(TeiErrorType::kUnhealthy,
                              options_.read_token.empty() ? absl::StrCat("unhealthy: ", serving.message())
                                                          : std::string("unhealthy: the default job does not serve")));
  }
  HttpResponse response;
  response.content_type = "text/plain; charset=utf-8";
  return response;
}

}  // namespace bertshard::http
