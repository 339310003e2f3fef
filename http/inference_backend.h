// File: http/inference_backend.h
// -----------------------------------------------------------------------------
// What the HTTP protocols (http/http_api.h: TEI's routes, OpenAI's) need from the coordinator: the
// same calls its gRPC service makes, on the same request path (server/cluster.h's Cluster:
// ResolveJob, Embed, Infer, the job's tokenizer). The protocol layer only converts JSON to these
// messages and back; the coordinator's adapter (server/http_backend.h) implements this over its
// Cluster, and tests implement it with canned answers. No gRPC here.
//
// Example:
//   class Canned : public InferenceBackend { ... };
//   Canned backend;
//   HttpApi api(&backend, options);
//
// Thread safety: implementations must be thread-safe (every HTTP thread calls in at once).
#ifndef BERTSHARD_HTTP_INFERENCE_BACKEND_H_
#define BERTSHARD_HTTP_INFERENCE_BACKEND_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "bertshard/v1/coordinator.pb.h"

namespace bertshard::http {

// A serving job, as /info and /v1/models describe it.
struct ModelInfo {
  std::string job_id;
  std::string name;  // SubmitJobRequest.name; may be empty
  v1::ModelVariant variant = v1::MODEL_VARIANT_UNSPECIFIED;
  std::string architecture;         // HF's class name ("BertModel", "BertForSequenceClassification")
  std::string pooling;              // "mean", "cls", ... for BertModel jobs; "" otherwise
  std::vector<std::string> labels;  // classification heads' id2label, by id
  int64_t max_input_length = 0;     // tokens, [CLS] and [SEP] included
  int64_t hidden_size = 0;
  std::string dtype;                 // "float32", "float16", "bfloat16"
  int64_t created_unix_seconds = 0;  // set by ServingModels only (it reads the job store)
  // What requests name it by: the name, else the id.
  const std::string& public_name() const { return name.empty() ? job_id : name; }
};

// One token of the job's tokenizer.
struct TokenInfo {
  int64_t id = 0;
  std::string text;  // the vocabulary entry (word pieces keep their "##")
  bool special = false;
};

// Who asks, and until when.
struct CallContext {
  absl::Time deadline = absl::InfiniteFuture();
  std::string client;      // as the gRPC side names callers ("host:...", "cn:...")
  std::string connection;  // the caller's address and port
  // Token-id inputs are padded to their longest into one rectangle before they go on: more than
  // this many ids in it (the batcher's --max_batch_tokens, which would refuse it later) is refused
  // before the rectangle is made (a few long rows and many short ones would cost rows x longest).
  int64_t max_padded_ids = 16384;
  // Whether the caller went away (may be empty: never): a request it holds that has not been sent
  // to the workers yet is dropped (Cluster::Infer's `cancelled`).
  std::function<bool()> cancelled;
};

class InferenceBackend {
 public:
  virtual ~InferenceBackend() = default;
  // The job id a request's `model` means (Cluster::ResolveJob: an id, a name, or "" for the
  // default or only serving job).
  virtual absl::StatusOr<std::string> ResolveJob(const std::string& model) = 0;
  // The serving job `job_id` (no store read: cheap enough per request); FAILED_PRECONDITION /
  // NOT_FOUND when it does not serve.
  virtual absl::StatusOr<ModelInfo> Model(const std::string& job_id) = 0;
  // Every serving job, with its creation time.
  virtual std::vector<ModelInfo> ServingModels() = 0;
  virtual absl::StatusOr<v1::EmbedResponse> Embed(const v1::EmbedRequest& request, const CallContext& context) = 0;
  virtual absl::StatusOr<v1::InferResponse> Infer(const v1::InferRequest& request, const CallContext& context) = 0;
  virtual absl::StatusOr<std::vector<TokenInfo>> Tokenize(const std::string& job_id, const std::string& text,
                                                          bool add_special_tokens) = 0;
  virtual absl::StatusOr<std::string> Decode(const std::string& job_id, const std::vector<int64_t>& ids) = 0;
  // The text of the job's sentence-transformers prompt `prompt_name` (serving::PromptFor; "": the
  // checkpoint's default prompt), put before each input text by the routes that run text as given
  // (/embed_all, /tokenize); "" when none applies. INVALID_ARGUMENT for a name the job lacks.
  virtual absl::StatusOr<std::string> Prompt(const std::string& job_id, const std::string& prompt_name) = 0;
};

}  // namespace bertshard::http

#endif  // BERTSHARD_HTTP_INFERENCE_BACKEND_H_
