// TEI's routes of HttpApi (http_api.h), in the shapes of text-embeddings-inference's router
// (router/src/http/server.rs, types.rs): what each takes, what it answers, and its errors.
#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/proto_json.h"
#include "http/api_support.h"
#include "http/http_api.h"
#include "http/json_body.h"
#include "serving/rerank.h"

namespace bertshard::http {
namespace {

using google::protobuf::Struct;
using google::protobuf::Value;

// The options TEI's embedding routes share.
struct EncodeOptions {
  bool truncate = false;
  bool from_start = false;  // truncation_direction "Left"
  std::string model;
  // A sentence-transformers prompt of the model's (EmbedRequest.prompt_name): /embed and
  // /similarity take it.
  std::string prompt_name;
};

// `route_without_prompts`: the route, when it takes no prompt_name (refused, naming it).
absl::StatusOr<EncodeOptions> ReadEncodeOptions(const Struct& body, const char* route_without_prompts = nullptr) {
  EncodeOptions options;
  absl::StatusOr<bool> truncate = BoolField(body, "truncate", false);
  if (!truncate.ok()) return truncate.status();
  options.truncate = *truncate;
  absl::StatusOr<std::string> direction = StringField(body, "truncation_direction", "Right");
  if (!direction.ok()) return direction.status();
  options.from_start = *direction == "Left";
  if (*direction != "Right" && *direction != "Left") {
    return absl::InvalidArgumentError(
        absl::StrCat("truncation_direction: unknown variant `", *direction, "`, expected `Left` or `Right`"));
  }
  absl::StatusOr<std::string> prompt_name = StringField(body, "prompt_name", "");
  if (!prompt_name.ok()) return prompt_name.status();
  // Present, it names a prompt (an empty name is none of the model's); absent, the default applies.
  if (Field(body, "prompt_name") != nullptr && prompt_name->empty()) {
    return absl::InvalidArgumentError("prompt_name is empty: name one of the model's prompts, or leave it out");
  }
  if (route_without_prompts != nullptr && !prompt_name->empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("prompt_name is not supported on ", route_without_prompts,
                     " (it applies to /embed, /embed_all, /embed_sparse, /similarity and /tokenize)"));
  }
  options.prompt_name = *prompt_name;
  absl::StatusOr<std::string> model = StringField(body, "model", "");
  if (!model.ok()) return model.status();
  options.model = *model;
  return options;
}

// The job's model, refused with TEI's 424 when it is not of `variant` ("model is not ...").
absl::StatusOr<ModelInfo> ModelOfKind(InferenceBackend* backend, const std::string& job, v1::ModelVariant variant,
                                      const char* kind, ApiError* error) {
  absl::StatusOr<ModelInfo> model = backend->Model(job);
  if (!model.ok()) {
    *error = FromStatus(model.status());
    return model.status();
  }
  if (model->variant != variant) {
    *error = MakeError(TeiErrorType::kBackend, absl::StrCat("model is not ", kind, " model (job ", model->public_name(),
                                                            " runs ", model->architecture, ")"));
    return absl::FailedPreconditionError(error->message);
  }
  return model;
}

// One sequence of /predict: a text, or a pair.
struct Sequence {
  std::string text;
  std::string pair;
  bool is_pair = false;
};

absl::StatusOr<Sequence> SequenceOf(const google::protobuf::ListValue& list, const std::string& what) {
  constexpr absl::string_view kExpected =
      "expected a string, a pair of strings [string, string] or a batch of mixed strings and pairs "
      "[[string], [string, string], ...]";
  if (list.values_size() < 1 || list.values_size() > 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("`", what, "`: invalid length ", list.values_size(), ", ", kExpected));
  }
  Sequence sequence;
  for (int i = 0; i < list.values_size(); ++i) {
    if (list.values(i).kind_case() != Value::kStringValue) {
      return absl::InvalidArgumentError(absl::StrCat("`", what, "`: ", kExpected));
    }
  }
  sequence.text = list.values(0).string_value();
  if (list.values_size() == 2) {
    sequence.is_pair = true;
    sequence.pair = list.values(1).string_value();
  }
  return sequence;
}

// /predict's `inputs`: "text", ["text", "pair"], or a batch [["text"], ["text", "pair"], ...].
absl::StatusOr<std::vector<Sequence>> ParsePredictInputs(const Struct& body, bool* batch) {
  const Value* v = Field(body, "inputs");
  *batch = false;
  if (v == nullptr) return absl::InvalidArgumentError("`inputs` is missing");
  if (v->kind_case() == Value::kStringValue) return std::vector<Sequence>{{v->string_value(), "", false}};
  if (v->kind_case() != Value::kListValue) {
    return absl::InvalidArgumentError("`inputs` must be a string, a pair of strings or a batch of strings and pairs");
  }
  const google::protobuf::ListValue& list = v->list_value();
  if (list.values_size() > 0 && list.values(0).kind_case() == Value::kListValue) {
    *batch = true;
    std::vector<Sequence> sequences;
    for (int i = 0; i < list.values_size(); ++i) {
      if (list.values(i).kind_case() != Value::kListValue) {
        return absl::InvalidArgumentError(absl::StrCat("`inputs[", i, "]` must be [string] or [string, string]"));
      }
      absl::StatusOr<Sequence> s = SequenceOf(list.values(i).list_value(), absl::StrCat("inputs[", i, "]"));
      if (!s.ok()) return s.status();
      sequences.push_back(*std::move(s));
    }
    return sequences;
  }
  absl::StatusOr<Sequence> s = SequenceOf(list, "inputs");
  if (!s.ok()) return s.status();
  return std::vector<Sequence>{*std::move(s)};
}

void AppendPrediction(const std::vector<std::pair<float, std::string>>& scores, std::string* out) {
  out->push_back('[');
  for (size_t i = 0; i < scores.size(); ++i) {
    if (i > 0) out->push_back(',');
    out->append("{\"score\":");
    const float score = scores[i].first;
    std::string number;
    AppendFloatArray({&score, 1}, &number);
    out->append(number, 1, number.size() - 2);  // the float without its brackets
    out->append(",\"label\":");
    common::AppendJsonString(scores[i].second, out);
    out->push_back('}');
  }
  out->push_back(']');
}

}  // namespace

HttpResponse HttpApi::TeiEmbed(const Struct& body, const CallContext& call) {
  const absl::Time start = absl::Now();
  ApiError error;
  absl::StatusOr<ParsedInputs> inputs = ParseInputs(body, "inputs");
  if (!inputs.ok()) return TeiError(MalformedRequest(std::string(inputs.status().message())));
  if (!CheckInputs(*inputs, options_.max_client_batch_size, &error).ok()) return TeiError(error);
  absl::StatusOr<EncodeOptions> encode = ReadEncodeOptions(body);
  absl::StatusOr<bool> normalize = BoolField(body, "normalize", true);
  absl::StatusOr<std::optional<int64_t>> dimensions = IntField(body, "dimensions", 1, 1 << 20);
  for (const absl::Status& s : {encode.status(), normalize.status(), dimensions.status()}) {
    if (!s.ok()) return TeiError(MalformedRequest(std::string(s.message())));
  }
  absl::StatusOr<std::string> job = ResolveModel(backend_, encode->model, options_.default_job, &error);
  if (!job.ok()) return TeiError(error);
  v1::EmbedRequest base;
  base.set_normalize(*normalize ? v1::NORMALIZE_ON : v1::NORMALIZE_OFF);
  base.set_truncate(encode->truncate);
  base.set_truncate_from_start(encode->from_start);
  base.set_dimensions(static_cast<int32_t>(dimensions->value_or(0)));
  base.set_prompt_name(encode->prompt_name);
  absl::StatusOr<EmbedOutcome> outcome = EmbedItems(backend_, *job, inputs->items, base, call);
  if (!outcome.ok()) return TeiError(FromStatus(outcome.status()));
  std::string out = "[";
  for (size_t i = 0; i < outcome->vectors.size(); ++i) {
    if (i > 0) out.push_back(',');
    AppendFloatArray(outcome->vectors[i], &out);
  }
  out.push_back(']');
  return JsonResponse(std::move(out),
                      TimingHeaders(start, outcome->times, CountCharacters(inputs->items), outcome->tokens));
}

HttpResponse HttpApi::TeiEmbedSparse(const Struct& body, const CallContext& call) {
  const absl::Time start = absl::Now();
  ApiError error;
  absl::StatusOr<ParsedInputs> inputs = ParseInputs(body, "inputs");
  if (!inputs.ok()) return TeiError(MalformedRequest(std::string(inputs.status().message())));
  if (!CheckInputs(*inputs, options_.max_client_batch_size, &error).ok()) return TeiError(error);
  absl::StatusOr<EncodeOptions> encode = ReadEncodeOptions(body);
  if (!encode.ok()) return TeiError(MalformedRequest(std::string(encode.status().message())));
  absl::StatusOr<std::string> job = ResolveModel(backend_, encode->model, options_.default_job, &error);
  if (!job.ok()) return TeiError(error);
  if (!ModelOfKind(backend_, *job, v1::BERT_FOR_MASKED_LM, "a SPLADE", &error).ok()) return TeiError(error);
  v1::EmbedRequest base;
  base.set_sparse(true);
  base.set_truncate(encode->truncate);
  base.set_truncate_from_start(encode->from_start);
  base.set_prompt_name(encode->prompt_name);
  absl::StatusOr<EmbedOutcome> outcome = EmbedItems(backend_, *job, inputs->items, base, call);
  if (!outcome.ok()) return TeiError(FromStatus(outcome.status()));
  std::string out = "[";
  for (size_t i = 0; i < outcome->vectors.size(); ++i) {
    if (i > 0) out.push_back(',');
    AppendSparseVector(outcome->indices[i], outcome->vectors[i], &out);
  }
  out.push_back(']');
  return JsonResponse(std::move(out),
                      TimingHeaders(start, outcome->times, CountCharacters(inputs->items), outcome->tokens));
}

HttpResponse HttpApi::TeiEmbedAll(const Struct& body, const CallContext& call) {
  const absl::Time start = absl::Now();
  ApiError error;
  absl::StatusOr<ParsedInputs> inputs = ParseInputs(body, "inputs");
  if (!inputs.ok()) return TeiError(MalformedRequest(std::string(inputs.status().message())));
  if (!CheckInputs(*inputs, options_.max_client_batch_size, &error).ok()) return TeiError(error);
  absl::StatusOr<EncodeOptions> encode = ReadEncodeOptions(body);
  if (!encode.ok()) return TeiError(MalformedRequest(std::string(encode.status().message())));
  absl::StatusOr<std::string> job = ResolveModel(backend_, encode->model, options_.default_job, &error);
  if (!job.ok()) return TeiError(error);
  if (!ModelOfKind(backend_, *job, v1::BERT_MODEL, "an embedding", &error).ok()) return TeiError(error);
  // The prompt goes before each text, as /embed puts it (the model's default when none is named);
  // token ids are the caller's own.
  if (!PromptInputs(backend_, encode->prompt_name, *job, &inputs->items, &error)) return TeiError(error);
  // Per input, its tokens' hidden states ([CLS] and [SEP] included, padding not).
  std::vector<std::string> rendered(inputs->items.size());
  CallTimes times;
  int64_t tokens = 0;
  absl::StatusOr<std::vector<InputGroup>> groups = GroupInputs(inputs->items, call.max_padded_ids);
  if (!groups.ok()) return TeiError(FromStatus(groups.status()));
  for (InputGroup& group : *groups) {
    v1::InferRequest request;
    request.set_job_id(*job);
    request.set_truncate(encode->truncate);
    request.set_truncate_from_start(encode->from_start);
    if (group.is_ids) {
      *request.mutable_tokens() = std::move(group.tokens);
    } else {
      *request.mutable_text() = std::move(group.text);
    }
    absl::StatusOr<v1::InferResponse> response = backend_->Infer(request, call);
    if (!response.ok()) return TeiError(FromStatus(response.status()));
    times.Add(response->batch());
    const v1::NamedTensor* hidden = nullptr;
    for (const v1::NamedTensor& t : response->outputs()) {
      if (t.name() == "last_hidden_state") hidden = &t;
    }
    const v1::TokenInputs& ran = response->tokens();
    const int64_t rows = ran.rows(), seq = ran.seq();
    if (hidden == nullptr || hidden->shape_size() != 3 || hidden->shape(0) != rows || hidden->shape(1) != seq ||
        rows != static_cast<int64_t>(group.index.size()) || hidden->values_size() != rows * seq * hidden->shape(2) ||
        ran.attention_mask_size() != rows * seq) {
      return TeiError(MakeError(TeiErrorType::kBackend, "the job answered without per-token hidden states"));
    }
    const int64_t width = hidden->shape(2);
    for (int64_t r = 0; r < rows; ++r) {
      std::string& out = rendered[group.index[static_cast<size_t>(r)]];
      out.push_back('[');
      int64_t written = 0;
      for (int64_t k = 0; k < seq; ++k) {
        if (ran.attention_mask(static_cast<int>(r * seq + k)) == 0) continue;
        if (written++ > 0) out.push_back(',');
        AppendFloatArray({hidden->values().data() + (r * seq + k) * width, static_cast<size_t>(width)}, &out);
      }
      tokens += written;
      out.push_back(']');
    }
  }
  std::string out = "[";
  for (size_t i = 0; i < rendered.size(); ++i) absl::StrAppend(&out, i > 0 ? "," : "", rendered[i]);
  out.push_back(']');
  return JsonResponse(std::move(out), TimingHeaders(start, times, CountCharacters(inputs->items), tokens));
}

HttpResponse HttpApi::TeiPredict(const Struct& body, const CallContext& call) {
  const absl::Time start = absl::Now();
  ApiError error;
  bool batch = false;
  absl::StatusOr<std::vector<Sequence>> sequences = ParsePredictInputs(body, &batch);
  if (!sequences.ok()) return TeiError(MalformedRequest(std::string(sequences.status().message())));
  if (static_cast<int64_t>(sequences->size()) > options_.max_client_batch_size) {
    return TeiError(MakeError(TeiErrorType::kValidation,
                              absl::StrCat("batch size ", sequences->size(), " > maximum allowed batch size ",
                                           options_.max_client_batch_size)));
  }
  int64_t characters = 0;
  for (const Sequence& s : *sequences) {
    if (s.text.empty() || (s.is_pair && s.pair.empty())) {
      return TeiError(MakeError(TeiErrorType::kEmpty, "Input validation error: `inputs` cannot be empty"));
    }
    characters += CountCharacters({{false, s.text, {}}, {false, s.pair, {}}});
  }
  absl::StatusOr<EncodeOptions> encode = ReadEncodeOptions(body, "/predict");
  absl::StatusOr<bool> raw_scores = BoolField(body, "raw_scores", false);
  for (const absl::Status& s : {encode.status(), raw_scores.status()}) {
    if (!s.ok()) return TeiError(MalformedRequest(std::string(s.message())));
  }
  absl::StatusOr<std::string> job = ResolveModel(backend_, encode->model, options_.default_job, &error);
  if (!job.ok()) return TeiError(error);
  absl::StatusOr<ModelInfo> model =
      ModelOfKind(backend_, *job, v1::BERT_FOR_SEQUENCE_CLASSIFICATION, "a classifier", &error);
  if (!model.ok()) return TeiError(error);
  // Singles and pairs go as one request each (a TextInput's pairs are all or none).
  std::vector<std::vector<std::pair<float, std::string>>> scores(sequences->size());
  CallTimes times;
  int64_t tokens = 0;
  for (const bool pairs : {false, true}) {
    std::vector<size_t> index;
    v1::InferRequest request;
    request.set_job_id(*job);
    request.set_truncate(encode->truncate);
    request.set_truncate_from_start(encode->from_start);
    request.set_predictions_only(!*raw_scores);
    for (size_t i = 0; i < sequences->size(); ++i) {
      const Sequence& s = (*sequences)[i];
      if (s.is_pair != pairs) continue;
      index.push_back(i);
      request.mutable_text()->add_texts(s.text);
      if (pairs) request.mutable_text()->add_text_pairs(s.pair);
    }
    if (index.empty()) continue;
    absl::StatusOr<v1::InferResponse> response = backend_->Infer(request, call);
    if (!response.ok()) return TeiError(FromStatus(response.status()));
    times.Add(response->batch());
    for (const int64_t m : response->tokens().attention_mask()) tokens += m;
    if (response->predictions_size() != static_cast<int>(index.size())) {
      return TeiError(MakeError(TeiErrorType::kBackend, "the job answered a prediction per input it was not asked"));
    }
    const v1::NamedTensor* logits = nullptr;
    for (const v1::NamedTensor& t : response->outputs()) {
      if (t.name() == "logits") logits = &t;
    }
    for (size_t r = 0; r < index.size(); ++r) {
      auto& row = scores[index[r]];
      if (*raw_scores) {
        if (logits == nullptr || logits->shape_size() != 2 ||
            logits->values_size() != static_cast<int>(index.size() * logits->shape(1))) {
          return TeiError(MakeError(TeiErrorType::kBackend, "the job answered without its logits"));
        }
        const int64_t labels = logits->shape(1);
        for (int64_t k = 0; k < labels; ++k) {
          const std::string label =
              k < static_cast<int64_t>(model->labels.size()) ? model->labels[k] : absl::StrCat("LABEL_", k);
          row.push_back({logits->values(static_cast<int>(r * labels + k)), label});
        }
        std::stable_sort(row.begin(), row.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
      } else {
        for (const v1::LabelScore& l : response->predictions(static_cast<int>(r)).labels()) {
          row.push_back({l.score(), l.label()});  // best first already
        }
      }
    }
  }
  std::string out;
  if (batch) out.push_back('[');
  for (size_t i = 0; i < scores.size(); ++i) {
    if (i > 0) out.push_back(',');
    AppendPrediction(scores[i], &out);
  }
  if (batch) out.push_back(']');
  return JsonResponse(std::move(out), TimingHeaders(start, times, characters, tokens));
}

HttpResponse HttpApi::TeiSimilarity(const Struct& body, const CallContext& call) {
  const absl::Time start = absl::Now();
  ApiError error;
  const Value* inputs = Field(body, "inputs");
  if (inputs == nullptr || inputs->kind_case() != Value::kStructValue) {
    return TeiError(MalformedRequest("`inputs` must be {\"source_sentence\": string, \"sentences\": [string, ...]}"));
  }
  absl::StatusOr<std::string> source = StringField(inputs->struct_value(), "source_sentence", "");
  if (!source.ok()) return TeiError(MalformedRequest(std::string(source.status().message())));
  absl::StatusOr<ParsedInputs> sentences = ParseInputs(inputs->struct_value(), "sentences");
  if (!sentences.ok()) return TeiError(MalformedRequest(std::string(sentences.status().message())));
  if (!sentences->batch || sentences->items.empty()) {
    return TeiError(MakeError(TeiErrorType::kEmpty, "`inputs.sentences` cannot be empty"));
  }
  // The source sentence counts against the batch, as in TEI.
  ParsedInputs all;
  all.batch = true;
  all.items.push_back({false, *source, {}});
  for (InputItem& item : sentences->items) {
    if (item.is_ids) return TeiError(MalformedRequest("`inputs.sentences` must be a list of strings"));
    all.items.push_back(std::move(item));
  }
  if (!CheckInputs(all, options_.max_client_batch_size, &error).ok()) return TeiError(error);
  Struct parameters;
  if (const Value* p = Field(body, "parameters"); p != nullptr) {
    if (p->kind_case() != Value::kStructValue) return TeiError(MalformedRequest("`parameters` must be an object"));
    parameters = p->struct_value();
  }
  absl::StatusOr<EncodeOptions> encode = ReadEncodeOptions(parameters);
  if (!encode.ok()) return TeiError(MalformedRequest(std::string(encode.status().message())));
  absl::StatusOr<std::string> model = StringField(body, "model", "");
  if (!model.ok()) return TeiError(MalformedRequest(std::string(model.status().message())));
  absl::StatusOr<std::string> job = ResolveModel(backend_, *model, options_.default_job, &error);
  if (!job.ok()) return TeiError(error);
  v1::EmbedRequest base;
  base.set_normalize(v1::NORMALIZE_ON);  // cosine similarity: dot products of unit vectors
  base.set_truncate(encode->truncate);
  base.set_truncate_from_start(encode->from_start);
  base.set_prompt_name(encode->prompt_name);
  absl::StatusOr<EmbedOutcome> outcome = EmbedItems(backend_, *job, all.items, base, call);
  if (!outcome.ok()) return TeiError(FromStatus(outcome.status()));
  std::vector<float> similarities;
  const std::vector<float>& a = outcome->vectors[0];
  for (size_t i = 1; i < outcome->vectors.size(); ++i) {
    const std::vector<float>& b = outcome->vectors[i];
    double dot = 0;
    for (size_t k = 0; k < std::min(a.size(), b.size()); ++k) dot += static_cast<double>(a[k]) * b[k];
    similarities.push_back(static_cast<float>(dot));
  }
  std::string out;
  AppendFloatArray(similarities, &out);
  return JsonResponse(std::move(out),
                      TimingHeaders(start, outcome->times, CountCharacters(all.items), outcome->tokens));
}

HttpResponse HttpApi::TeiRerank(const Struct& body, const CallContext& call) {
  const absl::Time start = absl::Now();
  ApiError error;
  absl::StatusOr<std::string> query = StringField(body, "query", "");
  if (!query.ok() || Field(body, "query") == nullptr) {
    return TeiError(MalformedRequest(query.ok() ? "`query` is missing" : std::string(query.status().message())));
  }
  absl::StatusOr<ParsedInputs> texts = ParseInputs(body, "texts");
  if (!texts.ok()) return TeiError(MalformedRequest(std::string(texts.status().message())));
  if (!texts->batch) return TeiError(MalformedRequest("`texts` must be a list of strings"));
  if (texts->items.empty()) return TeiError(MakeError(TeiErrorType::kEmpty, "`texts` cannot be empty"));
  for (const InputItem& item : texts->items) {
    if (item.is_ids) return TeiError(MalformedRequest("`texts` must be a list of strings"));
  }
  if (static_cast<int64_t>(texts->items.size()) > options_.max_client_batch_size) {
    return TeiError(MakeError(TeiErrorType::kValidation,
                              absl::StrCat("batch size ", texts->items.size(), " > maximum allowed batch size ",
                                           options_.max_client_batch_size)));
  }
  if (query->empty())
    return TeiError(MakeError(TeiErrorType::kEmpty, "Input validation error: `inputs` cannot be empty"));
  for (const InputItem& item : texts->items) {
    if (item.text.empty()) {
      return TeiError(MakeError(TeiErrorType::kEmpty, "Input validation error: `inputs` cannot be empty"));
    }
  }
  absl::StatusOr<EncodeOptions> encode = ReadEncodeOptions(body, "/rerank");
  absl::StatusOr<bool> raw_scores = BoolField(body, "raw_scores", false);
  absl::StatusOr<bool> return_text = BoolField(body, "return_text", false);
  for (const absl::Status& s : {encode.status(), raw_scores.status(), return_text.status()}) {
    if (!s.ok()) return TeiError(MalformedRequest(std::string(s.message())));
  }
  absl::StatusOr<std::string> job = ResolveModel(backend_, encode->model, options_.default_job, &error);
  if (!job.ok()) return TeiError(error);
  // TEI's re-ranker: a sequence classifier with one label (sentence-transformers' CrossEncoder).
  absl::StatusOr<ModelInfo> model =
      ModelOfKind(backend_, *job, v1::BERT_FOR_SEQUENCE_CLASSIFICATION, "a re-ranker", &error);
  if (!model.ok()) return TeiError(error);
  if (model->labels.size() != 1) {
    return TeiError(MakeError(TeiErrorType::kBackend,
                              absl::StrCat("model is not a re-ranker model (job ", model->public_name(), " has ",
                                           model->labels.size(), " labels; a re-ranker has one)")));
  }
  v1::InferRequest request;
  request.set_job_id(*job);
  request.set_truncate(encode->truncate);
  request.set_truncate_from_start(encode->from_start);
  for (const InputItem& item : texts->items) {
    request.mutable_text()->add_texts(*query);
    request.mutable_text()->add_text_pairs(item.text);
  }
  absl::StatusOr<v1::InferResponse> response = backend_->Infer(request, call);
  if (!response.ok()) return TeiError(FromStatus(response.status()));
  const v1::NamedTensor* logits = nullptr;
  for (const v1::NamedTensor& t : response->outputs()) {
    if (t.name() == "logits") logits = &t;
  }
  const int n = static_cast<int>(texts->items.size());
  if (logits == nullptr || logits->values_size() != n) {
    return TeiError(MakeError(TeiErrorType::kBackend, "the job answered without one logit per text"));
  }
  // TEI's scores: the logit itself with raw_scores, else its sigmoid (one label), as the gRPC
  // Rerank ranks them.
  const std::vector<serving::RankedText> ranks = serving::RankByScore(logits->values(), *raw_scores);
  std::string out = "[";
  for (size_t r = 0; r < ranks.size(); ++r) {
    absl::StrAppend(&out, r > 0 ? "," : "", "{\"index\":", ranks[r].index);
    if (*return_text) {
      out += ",\"text\":";
      common::AppendJsonString(texts->items[static_cast<size_t>(ranks[r].index)].text, &out);
    }
    std::string score;
    AppendFloatArray({&ranks[r].score, 1}, &score);
    absl::StrAppend(&out, ",\"score\":", score.substr(1, score.size() - 2), "}");
  }
  out.push_back(']');
  int64_t tokens = 0;
  for (const int64_t m : response->tokens().attention_mask()) tokens += m;
  CallTimes times;
  times.Add(response->batch());
  return JsonResponse(
      std::move(out),
      TimingHeaders(start, times, CountCharacters(texts->items) + n * CountCharacters({{false, *query, {}}}), tokens));
}

HttpResponse HttpApi::TeiDefaultRoute(const Struct& body, const CallContext& call) {
  ApiError error;
  absl::StatusOr<std::string> model = StringField(body, "model", "");
  if (!model.ok()) return TeiError(MalformedRequest(std::string(model.status().message())));
  absl::StatusOr<std::string> job = ResolveModel(backend_, *model, options_.default_job, &error);
  if (!job.ok()) return TeiError(error);
  absl::StatusOr<ModelInfo> info = backend_->Model(*job);
  if (!info.ok()) return TeiError(FromStatus(info.status()));
  if (info->variant == v1::BERT_FOR_SEQUENCE_CLASSIFICATION) {
    return info->labels.size() == 1 ? TeiRerank(body, call) : TeiPredict(body, call);
  }
  if (info->variant == v1::BERT_FOR_MASKED_LM) return TeiEmbedSparse(body, call);  // a SPLADE model's task
  return TeiEmbed(body, call);  // other heads are refused there, with TEI's 424
}

}  // namespace bertshard::http
