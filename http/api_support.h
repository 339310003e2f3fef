// File: http/api_support.h
// -----------------------------------------------------------------------------
// Internal to http/http_api.h: what TEI's and OpenAI's routes share. TEI's error kinds and the
// statuses TEI gives them, the mapping of the request path's absl::Status onto them, the
// concurrency permit behind 429, the Embed calls an input list turns into (texts in one request,
// token-id rows in another: each in their order), and TEI's timing headers.
//
// Thread safety: thread-safe (pure functions; the permit is an RAII count on an atomic).
#ifndef BERTSHARD_HTTP_API_SUPPORT_H_
#define BERTSHARD_HTTP_API_SUPPORT_H_

#include <atomic>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "bertshard/v1/coordinator.pb.h"
#include "http/http_message.h"
#include "http/inference_backend.h"
#include "http/json_body.h"

namespace bertshard::http {

// TEI's ErrorType, written as serde writes it ("Validation"), with TEI's status for each.
enum class TeiErrorType { kUnhealthy, kBackend, kOverloaded, kValidation, kTokenizer, kEmpty };
const char* TeiErrorName(TeiErrorType type);
int TeiErrorStatus(TeiErrorType type);  // 503, 424, 429, 413, 422, 400

struct ApiError {
  int status = 500;
  TeiErrorType type = TeiErrorType::kBackend;
  std::string message;
};
ApiError MakeError(TeiErrorType type, std::string message);
// A request a field of which is malformed or not what the route takes: 422, as TEI's JSON
// extractor answers a body that does not fit the route's shape.
ApiError MalformedRequest(std::string message);
// The request path's refusal as TEI would class it: INVALID_ARGUMENT 422 (Validation: too long,
// not UTF-8, the plan's bounds), FAILED_PRECONDITION 424 (Backend: the job cannot do that),
// RESOURCE_EXHAUSTED 429 (Overloaded), NOT_FOUND 422 (no such model), UNAVAILABLE 503 (Unhealthy:
// the job failed or is recovering), the rest 424 (Backend).
ApiError FromStatus(const absl::Status& status);

HttpResponse TeiError(const ApiError& error);
// OpenAI's error JSON: {"error": {"message", "type", "param": null, "code"}}; `code` null when empty.
HttpResponse OpenAiError(int status, const std::string& type, const std::string& message, const std::string& code);
HttpResponse OpenAiError(const ApiError& error);

// One of max_concurrent_requests: `acquired()` false when that many inference requests are in
// flight already (TEI's try_acquire_permit: 429 Overloaded).
class InferencePermit {
 public:
  InferencePermit(std::atomic<int>* in_flight, int limit);
  ~InferencePermit();
  InferencePermit(const InferencePermit&) = delete;
  InferencePermit& operator=(const InferencePermit&) = delete;
  bool acquired() const { return acquired_; }

 private:
  std::atomic<int>* const in_flight_;
  bool acquired_ = false;
};

// The seconds TEI's headers report, summed over a route's calls.
struct CallTimes {
  double tokenization = 0;
  double queue = 0;
  double inference = 0;
  void Add(const v1::BatchInfo& batch);
};
// x-compute-type, x-compute-time, x-compute-characters, x-compute-tokens, x-total-time,
// x-tokenization-time, x-queue-time, x-inference-time (milliseconds, as TEI writes them).
std::vector<std::pair<std::string, std::string>> TimingHeaders(absl::Time start, const CallTimes& times,
                                                               int64_t characters, int64_t tokens);

// TEI's checks of an input list before any work: empty -> 400 Empty; more than `max_batch` -> 413
// Validation ("batch size N > maximum allowed batch size M"); an empty text or id list -> 400 Empty.
absl::StatusOr<int64_t> CheckInputs(const ParsedInputs& inputs, int max_batch, ApiError* error);

// Unicode characters (UTF-8 code points) of the texts, ids of the id lists: TEI's
// x-compute-characters.
int64_t CountCharacters(const std::vector<InputItem>& items);

// `items` grouped by kind into the requests they need: the texts as one TextInput, the id lists as
// one TokenInputs padded to the longest (padding masked out). `index` maps each group's rows back
// to the items' order.
struct InputGroup {
  bool is_ids = false;
  v1::TextInput text;
  v1::TokenInputs tokens;
  std::vector<size_t> index;
};
// INVALID_ARGUMENT, before anything is copied, when the padded id lists would hold more than
// `max_padded_ids` (CallContext::max_padded_ids).
absl::StatusOr<std::vector<InputGroup>> GroupInputs(const std::vector<InputItem>& items, int64_t max_padded_ids);

// Pooled embeddings of `items` in their order: one Embed per group, each `base` with the group's
// input and `job_id`. The first refusal is returned.
struct EmbedOutcome {
  std::vector<std::vector<float>> vectors;
  std::vector<std::vector<int32_t>> indices;  // sparse embeddings (EmbedRequest.sparse): vectors' ids
  int64_t tokens = 0;
  CallTimes times;
};
absl::StatusOr<EmbedOutcome> EmbedItems(InferenceBackend* backend, const std::string& job_id,
                                        const std::vector<InputItem>& items, const v1::EmbedRequest& base,
                                        const CallContext& call);

// The job a request means: `model` (an id or a job's name), else `default_job`, else the only
// serving job. Its refusals (no such job, none or several serving) are 422 Validation.
absl::StatusOr<std::string> ResolveModel(InferenceBackend* backend, const std::string& model,
                                         const std::string& default_job, ApiError* error);

// Puts the job's prompt `prompt_name` ("": its default, if any; InferenceBackend::Prompt) before
// each text of `items`, as Embed does, for the routes that send text on as it is (/embed_all,
// /tokenize). False with `error` set (422 Validation) for a name the job lacks or a name with token
// ids; the backend's other refusals as FromStatus maps them.
bool PromptInputs(InferenceBackend* backend, const std::string& prompt_name, const std::string& job,
                  std::vector<InputItem>* items, ApiError* error);

// A response with a JSON body.
HttpResponse JsonResponse(std::string body, std::vector<std::pair<std::string, std::string>> headers = {});

}  // namespace bertshard::http

#endif  // BERTSHARD_HTTP_API_SUPPORT_H_
