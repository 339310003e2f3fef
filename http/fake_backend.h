// File: http/fake_backend.h
// -----------------------------------------------------------------------------
// Test-only InferenceBackend with canned answers: it records every request it is given and
// answers Embed with vectors that encode which input (row) they are for, so a test can check
// both what the HTTP layer asked and that the answer went back in the right order.
//
// Thread safety: not thread-safe (tests call it from one thread).
#ifndef BERTSHARD_HTTP_FAKE_BACKEND_H_
#define BERTSHARD_HTTP_FAKE_BACKEND_H_

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "http/inference_backend.h"

namespace bertshard::http {

class FakeBackend : public InferenceBackend {
 public:
  FakeBackend() {
    embedding.job_id = "job-1";
    embedding.name = "minilm";
    embedding.variant = v1::BERT_MODEL;
    embedding.architecture = "BertModel";
    embedding.pooling = "mean";
    embedding.max_input_length = 256;
    embedding.hidden_size = 4;
    embedding.dtype = "float32";
    embedding.created_unix_seconds = 1700000000;
    classifier.job_id = "job-2";
    classifier.name = "sentiment";
    classifier.variant = v1::BERT_FOR_SEQUENCE_CLASSIFICATION;
    classifier.architecture = "BertForSequenceClassification";
    classifier.labels = {"NEG", "POS"};
    classifier.max_input_length = 512;
    classifier.hidden_size = 4;
    classifier.dtype = "float32";
    reranker = classifier;
    reranker.job_id = "job-3";
    reranker.name = "reranker";
    reranker.labels = {"LABEL_0"};
    splade.job_id = "job-4";
    splade.name = "splade";
    splade.variant = v1::BERT_FOR_MASKED_LM;
    splade.architecture = "BertForMaskedLM";
    splade.max_input_length = 512;
    splade.hidden_size = 4;
    splade.dtype = "float32";
  }

  absl::StatusOr<std::string> ResolveJob(const std::string& model) override {
    resolved.push_back(model);
    if (model.empty() || model == "minilm" || model == "job-1") return std::string("job-1");
    if (model == "sentiment" || model == "job-2") return std::string("job-2");
    if (model == "reranker" || model == "job-3") return std::string("job-3");
    if (model == "splade" || model == "job-4") return std::string("job-4");
    if (model == "ended") return std::string("job-9");    // a job that no longer serves
    if (model == "loading") return std::string("job-8");  // a job that does not serve yet
    return absl::NotFoundError(absl::StrCat("no job has the id or name '", model, "'"));
  }
  absl::StatusOr<ModelInfo> Model(const std::string& job_id) override {
    if (job_id == "job-1") return embedding;
    if (job_id == "job-2") return classifier;
    if (job_id == "job-3") return reranker;
    if (job_id == "job-4") return splade;
    if (job_id == "job-9") return absl::FailedPreconditionError("job job-9 is CANCELLED: cancelled by request");
    if (job_id == "job-8") return absl::UnavailableError("job job-8 is LOADING and does not serve yet; retry");
    return absl::NotFoundError("no such job");
  }
  std::vector<ModelInfo> ServingModels() override { return {embedding, classifier}; }  // not the reranker

  // Row r of a call gets {call, r, 0.5, -1} (dimensions: the first that many), unless `embed_error`;
  // sparse: ids {r, 100 + call} with weights {0.5, call}.
  absl::StatusOr<v1::EmbedResponse> Embed(const v1::EmbedRequest& request, const CallContext& context) override {
    embeds.push_back(request);
    contexts.push_back(context);
    // Moved out first: a hook may set on_embed again (or clear it) while it runs.
    if (std::function<void()> hook = std::exchange(on_embed, nullptr)) hook();
    if (!embed_error.ok()) return embed_error;
    // As JobServing: a cut wider than the vectors is refused (found by the fuzzer: it threw here).
    if (request.dimensions() < 0 || request.dimensions() > 4) {
      return absl::InvalidArgumentError(absl::StrCat("dimensions must be in 1..4, not ", request.dimensions()));
    }
    v1::EmbedResponse response;
    const int64_t rows = request.has_text() ? request.text().texts_size() : request.tokens().rows();
    for (int64_t r = 0; r < rows && request.sparse(); ++r) {
      v1::Embedding* e = response.add_embeddings();
      e->add_indices(static_cast<int32_t>(r));
      e->add_indices(100 + static_cast<int32_t>(embeds.size()));
      e->add_values(0.5f);
      e->add_values(static_cast<float>(embeds.size()));
      response.add_token_counts(3);
    }
    for (int64_t r = 0; r < rows && !request.sparse(); ++r) {
      auto* values = response.add_embeddings()->mutable_values();
      for (const float v : {static_cast<float>(embeds.size()), static_cast<float>(r), 0.5f, -1.0f}) values->Add(v);
      if (request.dimensions() > 0) values->Truncate(request.dimensions());
      response.add_token_counts(5);
    }
    response.mutable_batch()->set_queue_seconds(0.25);
    response.mutable_batch()->set_forward_seconds(0.5);
    response.mutable_batch()->set_tokenization_seconds(0.125);
    return response;
  }
  // Classification: labels best first from `scores` (or logits when not predictions_only);
  // BertModel: last_hidden_state of width 2 whose values are (row, position).
  absl::StatusOr<v1::InferResponse> Infer(const v1::InferRequest& request, const CallContext& context) override {
    infers.push_back(request);
    contexts.push_back(context);
    if (std::function<void(const CallContext&)> hook = std::exchange(on_infer, nullptr)) hook(context);
    if (!infer_error.ok()) return infer_error;
    v1::InferResponse response;
    const int64_t rows = request.has_text() ? request.text().texts_size() : request.tokens().rows();
    if (request.job_id() == "job-1") {
      const int64_t seq = 4;  // rows have 3 real tokens and 1 pad
      v1::TokenInputs* tokens = response.mutable_tokens();
      tokens->set_rows(rows);
      tokens->set_seq(seq);
      v1::NamedTensor* hidden = response.add_outputs();
      hidden->set_name("last_hidden_state");
      for (const int64_t d : {rows, seq, int64_t{2}}) hidden->add_shape(d);
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t k = 0; k < seq; ++k) {
          tokens->add_attention_mask(k < 3 ? 1 : 0);
          hidden->add_values(static_cast<float>(r));
          hidden->add_values(static_cast<float>(k));
        }
      }
      return response;
    }
    if (request.job_id() == "job-3") {  // one logit per pair: 0, 1, -1, 2, ...
      v1::NamedTensor* logit = response.add_outputs();
      logit->set_name("logits");
      logit->add_shape(rows);
      logit->add_shape(1);
      for (int64_t r = 0; r < rows; ++r) logit->add_values(r % 2 == 0 ? static_cast<float>(-r / 2) : (r + 1) / 2.0f);
      return response;
    }
    v1::NamedTensor* logits = response.add_outputs();
    logits->set_name("logits");
    logits->add_shape(rows);
    logits->add_shape(2);
    for (int64_t r = 0; r < rows; ++r) {
      logits->add_values(-1.0f);
      logits->add_values(2.0f);
      v1::Prediction* p = response.add_predictions();
      auto* best = p->add_labels();
      best->set_id(1);
      best->set_label("POS");
      best->set_score(0.75f);
      auto* other = p->add_labels();
      other->set_id(0);
      other->set_label("NEG");
      other->set_score(0.25f);
      response.mutable_tokens()->add_attention_mask(1);
    }
    if (request.predictions_only()) response.clear_outputs();
    return response;
  }
  absl::StatusOr<std::vector<TokenInfo>> Tokenize(const std::string& job_id, const std::string& text,
                                                  bool add_special_tokens) override {
    tokenized.push_back(text);
    if (text == "\xff") return absl::InvalidArgumentError("text is not UTF-8");
    std::vector<TokenInfo> tokens;
    if (add_special_tokens) tokens.push_back({101, "[CLS]", true});
    tokens.push_back({7592, text, false});
    if (add_special_tokens) tokens.push_back({102, "[SEP]", true});
    return tokens;
  }
  absl::StatusOr<std::string> Decode(const std::string& job_id, const std::vector<int64_t>& ids) override {
    for (const int64_t id : ids) {
      if (id > 30521) return absl::InvalidArgumentError("token id outside the vocabulary");
    }
    return absl::StrCat("decoded ", ids.size());
  }

  // The embedding job's prompts: "query" ("query: "), and `default_prompt` for no name.
  absl::StatusOr<std::string> Prompt(const std::string& job_id, const std::string& prompt_name) override {
    prompts_asked.push_back(prompt_name);
    if (prompt_name.empty()) return job_id == "job-1" ? default_prompt : std::string();
    if (job_id == "job-1" && prompt_name == "query") return std::string("query: ");
    return absl::InvalidArgumentError(absl::StrCat("the model has no prompt named '", prompt_name, "'"));
  }
  std::string default_prompt;  // the embedding job's default prompt's text ("": none)
  std::vector<std::string> prompts_asked;

  ModelInfo embedding, classifier, reranker, splade;
  std::vector<std::string> resolved;
  std::vector<std::string> tokenized;
  std::vector<v1::EmbedRequest> embeds;
  std::vector<v1::InferRequest> infers;
  std::vector<CallContext> contexts;
  absl::Status embed_error;
  absl::Status infer_error;
  std::function<void()> on_embed;  // called once, inside the next Embed (a second request while one is in flight)
  std::function<void(const CallContext&)> on_infer;  // called once, inside the next Infer, with its context
};

}  // namespace bertshard::http

#endif  // BERTSHARD_HTTP_FAKE_BACKEND_H_
