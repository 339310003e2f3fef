#include "http/api_support.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/proto_json.h"
#include "common/status_macros.h"

namespace bertshard::http {

const char* TeiErrorName(TeiErrorType type) {
  switch (type) {
    case TeiErrorType::kUnhealthy:
      return "Unhealthy";
    case TeiErrorType::kBackend:
      return "Backend";
    case TeiErrorType::kOverloaded:
      return "Overloaded";
    case TeiErrorType::kValidation:
      return "Validation";
    case TeiErrorType::kTokenizer:
      return "Tokenizer";
    case TeiErrorType::kEmpty:
      return "Empty";
  }
  return "Backend";
}

int TeiErrorStatus(TeiErrorType type) {
  switch (type) {
    case TeiErrorType::kUnhealthy:
      return 503;
    case TeiErrorType::kBackend:
      return 424;
    case TeiErrorType::kOverloaded:
      return 429;
    case TeiErrorType::kValidation:
      return 413;
    case TeiErrorType::kTokenizer:
      return 422;
    case TeiErrorType::kEmpty:
      return 400;
  }
  return 424;
}

ApiError MakeError(TeiErrorType type, std::string message) { return {TeiErrorStatus(type), type, std::move(message)}; }

ApiError MalformedRequest(std::string message) { return {422, TeiErrorType::kValidation, std::move(message)}; }

ApiError FromStatus(const absl::Status& status) {
  std::string message(status.message());
  switch (status.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kOutOfRange:
      // The request path's refusals of what was asked (too many tokens, a cut wider than the
      // vectors): TEI's Validation, which TEI answers 413. 422 stays for bodies that do not parse.
      return MakeError(TeiErrorType::kValidation, std::move(message));
    case absl::StatusCode::kNotFound:
      return MalformedRequest(std::move(message));
    case absl::StatusCode::kResourceExhausted:
      return MakeError(TeiErrorType::kOverloaded, std::move(message));
    case absl::StatusCode::kUnavailable:
      return MakeError(TeiErrorType::kUnhealthy, std::move(message));
    case absl::StatusCode::kFailedPrecondition:
    default:
      return MakeError(TeiErrorType::kBackend, std::move(message));
  }
}

HttpResponse TeiError(const ApiError& error) {
  std::string body = "{\"error\":";
  common::AppendJsonString(error.message, &body);
  absl::StrAppend(&body, ",\"error_type\":\"", TeiErrorName(error.type), "\"}");
  HttpResponse response = JsonResponse(std::move(body));
  response.status = error.status;
  return response;
}

HttpResponse OpenAiError(int status, const std::string& type, const std::string& message, const std::string& code) {
  std::string body = "{\"error\":{\"message\":";
  common::AppendJsonString(message, &body);
  body += ",\"type\":";
  common::AppendJsonString(type, &body);
  body += ",\"param\":null,\"code\":";
  if (code.empty()) {
    body += "null";
  } else {
    common::AppendJsonString(code, &body);
  }
  body += "}}";
  HttpResponse response = JsonResponse(std::move(body));
  response.status = status;
  return response;
}

HttpResponse OpenAiError(const ApiError& error) {
  // OpenAI answers what is wrong with a request 400 (invalid_request_error), a missing model 404,
  // a rate limit 429 and its own failures 5xx; TEI's 424 and 413 have no place there.
  switch (error.type) {
    case TeiErrorType::kOverloaded:
      return OpenAiError(429, "rate_limit_error", error.message, "rate_limit_exceeded");
    case TeiErrorType::kUnhealthy:
      return OpenAiError(503, "server_error", error.message, "");
    case TeiErrorType::kBackend:
      return OpenAiError(error.status == 424 ? 500 : error.status, "server_error", error.message, "");
    default:
      return OpenAiError(400, "invalid_request_error", error.message, "");
  }
}

InferencePermit::InferencePermit(std::atomic<int>* in_flight, int limit) : in_flight_(in_flight) {
  int now = in_flight_->load();
  while (now < limit) {
    if (in_flight_->compare_exchange_weak(now, now + 1)) {
      acquired_ = true;
      return;
    }
  }
}

InferencePermit::~InferencePermit() {
  if (acquired_) in_flight_->fetch_sub(1);
}

void CallTimes::Add(const v1::BatchInfo& batch) {
  tokenization += batch.tokenization_seconds();
  queue += batch.queue_seconds();
  inference += batch.forward_seconds();
}

std::vector<std::pair<std::string, std::string>> TimingHeaders(absl::Time start, const CallTimes& times,
                                                               int64_t characters, int64_t tokens) {
  const auto ms = [](double seconds) { return absl::StrCat(static_cast<int64_t>(std::floor(seconds * 1000))); };
  const std::string total = absl::StrCat(absl::ToInt64Milliseconds(absl::Now() - start));
  return {{"x-compute-type", "bertshard"},
          {"x-compute-time", total},
          {"x-compute-characters", absl::StrCat(characters)},
          {"x-compute-tokens", absl::StrCat(tokens)},
          {"x-total-time", total},
          {"x-tokenization-time", ms(times.tokenization)},
          {"x-queue-time", ms(times.queue)},
          {"x-inference-time", ms(times.inference)}};
}

absl::StatusOr<int64_t> CheckInputs(const ParsedInputs& inputs, int max_batch, ApiError* error) {
  if (inputs.items.empty()) {
    *error = MakeError(TeiErrorType::kEmpty, "`inputs` cannot be empty");
    return absl::InvalidArgumentError(error->message);
  }
  const int64_t n = static_cast<int64_t>(inputs.items.size());
  if (n > max_batch) {
    *error = MakeError(TeiErrorType::kValidation,
                       absl::StrCat("batch size ", n, " > maximum allowed batch size ", max_batch));
    return absl::InvalidArgumentError(error->message);
  }
  for (const InputItem& item : inputs.items) {
    if (item.is_ids ? item.ids.empty() : item.text.empty()) {
      *error = MakeError(TeiErrorType::kEmpty, "Input validation error: `inputs` cannot be empty");
      return absl::InvalidArgumentError(error->message);
    }
  }
  return n;
}

int64_t CountCharacters(const std::vector<InputItem>& items) {
  int64_t n = 0;
  for (const InputItem& item : items) {
    if (item.is_ids) {
      n += static_cast<int64_t>(item.ids.size());
      continue;
    }
    for (const char c : item.text) n += (static_cast<unsigned char>(c) & 0xC0) != 0x80 ? 1 : 0;
  }
  return n;
}

absl::StatusOr<std::vector<InputGroup>> GroupInputs(const std::vector<InputItem>& items, int64_t max_padded_ids) {
  InputGroup texts, ids;
  ids.is_ids = true;
  size_t longest = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    if (items[i].is_ids) {
      ids.index.push_back(i);
      longest = std::max(longest, items[i].ids.size());
    } else {
      texts.index.push_back(i);
      texts.text.add_texts(items[i].text);
    }
  }
  if (!ids.index.empty()) {
    // Both at most what the body held (a few MB), so their product fits in 64 bits.
    const int64_t padded = static_cast<int64_t>(ids.index.size()) * static_cast<int64_t>(longest);
    if (padded > max_padded_ids) {
      return absl::InvalidArgumentError(absl::StrCat("the token-id inputs, padded to their longest, are ",
                                                     ids.index.size(), " x ", longest, " = ", padded,
                                                     " ids, more than the ", max_padded_ids, " a batch takes"));
    }
    v1::TokenInputs& t = ids.tokens;
    t.set_rows(static_cast<int64_t>(ids.index.size()));
    t.set_seq(static_cast<int64_t>(longest));
    for (const size_t i : ids.index) {
      const std::vector<int64_t>& row = items[i].ids;
      for (size_t k = 0; k < longest; ++k) {
        const bool real = k < row.size();
        t.add_input_ids(real ? row[k] : 0);  // padding is masked out: its id is never read as a token
        t.add_attention_mask(real ? 1 : 0);
        t.add_token_type_ids(0);
      }
    }
  }
  std::vector<InputGroup> groups;
  if (!texts.index.empty()) groups.push_back(std::move(texts));
  if (!ids.index.empty()) groups.push_back(std::move(ids));
  return groups;
}

absl::StatusOr<EmbedOutcome> EmbedItems(InferenceBackend* backend, const std::string& job_id,
                                        const std::vector<InputItem>& items, const v1::EmbedRequest& base,
                                        const CallContext& call) {
  EmbedOutcome outcome;
  outcome.vectors.resize(items.size());
  if (base.sparse()) outcome.indices.resize(items.size());
  ASSIGN_OR_RETURN(std::vector<InputGroup> groups, GroupInputs(items, call.max_padded_ids));
  for (InputGroup& group : groups) {
    v1::EmbedRequest request = base;
    request.set_job_id(job_id);
    if (group.is_ids) {
      *request.mutable_tokens() = std::move(group.tokens);
    } else {
      *request.mutable_text() = std::move(group.text);
    }
    absl::StatusOr<v1::EmbedResponse> response = backend->Embed(request, call);
    if (!response.ok()) return response.status();
    if (response->embeddings_size() != static_cast<int>(group.index.size())) {
      return absl::InternalError(
          absl::StrCat("Embed answered ", response->embeddings_size(), " vectors for ", group.index.size(), " inputs"));
    }
    for (size_t r = 0; r < group.index.size(); ++r) {
      const auto& values = response->embeddings(static_cast<int>(r)).values();
      outcome.vectors[group.index[r]].assign(values.begin(), values.end());
      if (base.sparse()) {
        const auto& ids = response->embeddings(static_cast<int>(r)).indices();
        if (ids.size() != values.size()) return absl::InternalError("Embed answered a sparse vector of unequal parts");
        outcome.indices[group.index[r]].assign(ids.begin(), ids.end());
      }
    }
    for (const int32_t n : response->token_counts()) outcome.tokens += n;
    outcome.times.Add(response->batch());
  }
  return outcome;
}

absl::StatusOr<std::string> ResolveModel(InferenceBackend* backend, const std::string& model,
                                         const std::string& default_job, ApiError* error) {
  absl::StatusOr<std::string> job = backend->ResolveJob(model.empty() ? default_job : model);
  if (!job.ok()) {
    *error = job.status().code() == absl::StatusCode::kUnavailable
                 ? FromStatus(job.status())
                 : MalformedRequest(std::string(job.status().message()));
  }
  return job;
}

bool PromptInputs(InferenceBackend* backend, const std::string& prompt_name, const std::string& job,
                  std::vector<InputItem>* items, ApiError* error) {
  for (const InputItem& item : *items) {
    if (item.is_ids && !prompt_name.empty()) {
      *error = MalformedRequest("prompt_name applies to text input; token ids are taken as they are");
      return false;
    }
  }
  absl::StatusOr<std::string> prompt = backend->Prompt(job, prompt_name);
  if (!prompt.ok()) {
    *error = prompt.status().code() == absl::StatusCode::kInvalidArgument
                 ? MalformedRequest(std::string(prompt.status().message()))
                 : FromStatus(prompt.status());
    return false;
  }
  if (prompt->empty()) return true;
  for (InputItem& item : *items) {
    if (!item.is_ids) item.text.insert(0, *prompt);
  }
  return true;
}

HttpResponse JsonResponse(std::string body, std::vector<std::pair<std::string, std::string>> headers) {
  HttpResponse response;
  response.status = 200;
  response.content_type = "application/json";
  response.body = std::move(body);
  response.headers = std::move(headers);
  return response;
}

}  // namespace bertshard::http
