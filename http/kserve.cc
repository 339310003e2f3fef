#include "http/kserve.h"

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace bertshard::http::kserve {
namespace {

constexpr int64_t kMostElements = int64_t{1} << 40;

const char* const kIdInputs[] = {"input_ids", "attention_mask", "token_type_ids"};

constexpr absl::string_view kInputsTaken =
    "input_ids, attention_mask, token_type_ids (INT64 or INT32 [batch, seq]) or text, text_pair (BYTES [batch])";

bool IsIdInput(const std::string& name) {
  for (const char* id : kIdInputs) {
    if (name == id) return true;
  }
  return false;
}

std::string ShapeText(const std::vector<int64_t>& shape) { return absl::StrCat("[", absl::StrJoin(shape, ", "), "]"); }

// Per datatype, the bytes one element takes in raw form (0: BYTES, length-prefixed).
absl::StatusOr<size_t> RawWidth(const std::string& datatype, const std::string& tensor) {
  if (datatype == "INT64") return 8;
  if (datatype == "INT32") return 4;
  if (datatype == "BYTES") return 0;
  return absl::InvalidArgumentError(
      absl::StrCat("input '", tensor, "': datatype ", datatype, " is not taken (INT64, INT32 or BYTES)"));
}

uint32_t ReadU32(const char* p) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(p[i]);
  return v;
}

void AppendLittleEndian(uint64_t v, int bytes, std::string* out) {
  for (int i = 0; i < bytes; ++i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

// The [batch, seq] (or [batch, choices, seq]) id input `tensor`, checked.
absl::Status CheckIdTensor(const Tensor& tensor, int64_t elements) {
  if (tensor.datatype != "INT64" && tensor.datatype != "INT32") {
    return absl::InvalidArgumentError(
        absl::StrCat("input '", tensor.name, "' must be INT64 or INT32, not ", tensor.datatype));
  }
  if (tensor.shape.size() != 2 && tensor.shape.size() != 3) {
    return absl::InvalidArgumentError(absl::StrCat("input '", tensor.name, "' must have shape [batch, seq] (or ",
                                                   "[batch, choices, seq]), not ", ShapeText(tensor.shape)));
  }
  if (static_cast<int64_t>(tensor.ints.size()) != elements) {
    return absl::InvalidArgumentError(absl::StrCat("input '", tensor.name, "' has ", tensor.ints.size(),
                                                   " values for shape ", ShapeText(tensor.shape), " (", elements, ")"));
  }
  return absl::OkStatus();
}

absl::Status CheckTextTensor(const Tensor& tensor, int64_t elements) {
  if (tensor.datatype != "BYTES") {
    return absl::InvalidArgumentError(absl::StrCat("input '", tensor.name, "' must be BYTES, not ", tensor.datatype));
  }
  if (tensor.shape.empty() || tensor.shape.size() > 2 || (tensor.shape.size() == 2 && tensor.shape[1] != 1)) {
    return absl::InvalidArgumentError(absl::StrCat("input '", tensor.name, "' must have shape [batch] or [batch, 1], ",
                                                   "not ", ShapeText(tensor.shape)));
  }
  if (static_cast<int64_t>(tensor.bytes.size()) != elements) {
    return absl::InvalidArgumentError(absl::StrCat("input '", tensor.name, "' has ", tensor.bytes.size(),
                                                   " elements for shape ", ShapeText(tensor.shape)));
  }
  return absl::OkStatus();
}

// The model outputs an architecture returns (model/bert_shard_layers.cc's heads), with the
// dimensions `model` gives.
std::vector<TensorMetadata> OutputsOfVariant(const ModelInfo& model) {
  const int64_t hidden = model.hidden_size > 0 ? model.hidden_size : -1;
  const int64_t labels = model.labels.empty() ? -1 : static_cast<int64_t>(model.labels.size());
  switch (model.variant) {
    case v1::BERT_MODEL:
      return {{"last_hidden_state", "FP32", {-1, -1, hidden}}, {"pooler_output", "FP32", {-1, hidden}}};
    case v1::BERT_FOR_PRE_TRAINING:
      return {{"prediction_logits", "FP32", {-1, -1, -1}}, {"seq_relationship_logits", "FP32", {-1, 2}}};
    case v1::BERT_LM_HEAD_MODEL:
    case v1::BERT_FOR_MASKED_LM:
      return {{"logits", "FP32", {-1, -1, -1}}};
    case v1::BERT_FOR_NEXT_SENTENCE_PREDICTION:
      return {{"logits", "FP32", {-1, 2}}};
    case v1::BERT_FOR_SEQUENCE_CLASSIFICATION:
      return {{"logits", "FP32", {-1, labels}}};
    case v1::BERT_FOR_TOKEN_CLASSIFICATION:
      return {{"logits", "FP32", {-1, -1, labels}}};
    case v1::BERT_FOR_MULTIPLE_CHOICE:
      return {{"logits", "FP32", {-1, -1}}};
    case v1::BERT_FOR_QUESTION_ANSWERING:
      return {{"start_logits", "FP32", {-1, -1}}, {"end_logits", "FP32", {-1, -1}}};
    default:
      return {};
  }
}

// What the model ran on, as an INT64 output: [rows, seq], or [batch, choices, seq].
Tensor RanOn(const v1::TokenInputs& tokens, const std::string& name,
             const google::protobuf::RepeatedField<int64_t>& values) {
  Tensor t{name, "INT64", {tokens.rows(), tokens.seq()}, {values.begin(), values.end()}, {}, {}};
  if (tokens.choices() > 1) t.shape = {tokens.rows() / tokens.choices(), tokens.choices(), tokens.seq()};
  return t;
}

}  // namespace

std::vector<std::string> ServerExtensions() { return {"binary_tensor_data"}; }

absl::StatusOr<int64_t> ElementCount(const std::vector<int64_t>& shape, const std::string& tensor) {
  int64_t count = 1;
  for (const int64_t d : shape) {
    if (d < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", tensor, "': shape ", ShapeText(shape), " has a negative dimension"));
    }
    if (d != 0 && count > kMostElements / d) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", tensor, "': shape ", ShapeText(shape), " has more than 2^40 elements"));
    }
    count *= d;
  }
  return count;
}

absl::StatusOr<ModelInfo> ServingModel(InferenceBackend* backend, const std::string& model, const std::string& version,
                                       const std::string& default_job) {
  absl::StatusOr<std::string> job = backend->ResolveJob(model.empty() ? default_job : model);
  if (!job.ok()) {
    if (job.status().code() == absl::StatusCode::kNotFound) {
      return absl::NotFoundError(absl::StrCat("unknown model '", model, "': ", job.status().message()));
    }
    return job.status();
  }
  if (!version.empty() && version != "1") {
    return absl::NotFoundError(
        absl::StrCat("model '", model, "' has no version '", version, "' (a job has one version, 1)"));
  }
  absl::StatusOr<ModelInfo> info = backend->Model(*job);
  if (info.ok() || info.status().code() == absl::StatusCode::kNotFound) return info;
  // Ended (FAILED, CANCELLED): it will never serve, so not a retry's matter (400, FAILED_PRECONDITION).
  if (info.status().code() == absl::StatusCode::kFailedPrecondition) {
    return absl::FailedPreconditionError(
        absl::StrCat("model '", model, "' will not serve again: ", info.status().message()));
  }
  // The job exists but does not serve yet (pending, loading, recovering): not ready, retry (503).
  return absl::UnavailableError(absl::StrCat("model '", model, "' is not ready: ", info.status().message()));
}

bool ServerReady(InferenceBackend* backend, const std::string& default_job) {
  if (default_job.empty()) return !backend->ServingModels().empty();
  return ServingModel(backend, default_job, "", "").ok();
}

ModelMetadata MetadataOf(const ModelInfo& model) {
  ModelMetadata metadata;
  metadata.name = model.public_name();
  metadata.versions = {"1"};
  metadata.platform = absl::StrCat("bertshard_", model.architecture);
  const bool choices = model.variant == v1::BERT_FOR_MULTIPLE_CHOICE;
  const std::vector<int64_t> ids = choices ? std::vector<int64_t>{-1, -1, -1} : std::vector<int64_t>{-1, -1};
  for (const char* name : kIdInputs) metadata.inputs.push_back({name, "INT64", ids});
  metadata.inputs.push_back({"text", "BYTES", {-1}});
  metadata.inputs.push_back({"text_pair", "BYTES", {-1}});
  metadata.outputs = OutputsOfVariant(model);
  return metadata;
}

absl::StatusOr<v1::InferRequest> ToInferRequest(const InferRequest& request, const std::string& job_id,
                                                int64_t max_padded_ids) {
  const Tensor* by_name[5] = {};  // input_ids, attention_mask, token_type_ids, text, text_pair
  for (const Tensor& tensor : request.inputs) {
    int slot = -1;
    for (int i = 0; i < 3; ++i) {
      if (tensor.name == kIdInputs[i]) slot = i;
    }
    if (tensor.name == "text") slot = 3;
    if (tensor.name == "text_pair") slot = 4;
    if (slot < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown input '", tensor.name, "': the model takes ", kInputsTaken));
    }
    if (by_name[slot] != nullptr) return absl::InvalidArgumentError(absl::StrCat("input '", tensor.name, "' twice"));
    absl::StatusOr<int64_t> elements = ElementCount(tensor.shape, tensor.name);
    if (!elements.ok()) return elements.status();
    absl::Status ok = IsIdInput(tensor.name) ? CheckIdTensor(tensor, *elements) : CheckTextTensor(tensor, *elements);
    if (!ok.ok()) return ok;
    by_name[slot] = &tensor;
  }
  const Tensor* ids = by_name[0];
  const Tensor* text = by_name[3];
  if ((ids == nullptr) == (text == nullptr)) {
    return absl::InvalidArgumentError(
        absl::StrCat(ids == nullptr ? "no input: " : "both input_ids and text: ",
                     "the model takes input_ids (INT64 [batch, seq]) or text (BYTES [batch]), one of them"));
  }
  v1::InferRequest out;
  out.set_job_id(job_id);
  out.set_truncate(request.truncate);
  if (text != nullptr) {
    if (by_name[1] != nullptr || by_name[2] != nullptr) {
      return absl::InvalidArgumentError("attention_mask and token_type_ids go with input_ids, not with text");
    }
    const Tensor* pair = by_name[4];
    if (pair != nullptr && pair->shape != text->shape) {
      return absl::InvalidArgumentError(absl::StrCat("input 'text_pair' has shape ", ShapeText(pair->shape),
                                                     ", 'text' ", ShapeText(text->shape), ": they must match"));
    }
    if (text->bytes.empty()) return absl::InvalidArgumentError("input 'text' has no elements (batch 0)");
    v1::TextInput* texts = out.mutable_text();
    for (const std::string& t : text->bytes) texts->add_texts(t);
    if (pair != nullptr) {
      for (const std::string& t : pair->bytes) texts->add_text_pairs(t);
    }
    return out;
  }
  if (by_name[4] != nullptr) return absl::InvalidArgumentError("text_pair goes with text, not with input_ids");
  for (int i = 1; i < 3; ++i) {
    if (by_name[i] != nullptr && by_name[i]->shape != ids->shape) {
      return absl::InvalidArgumentError(absl::StrCat("input '", kIdInputs[i], "' has shape ",
                                                     ShapeText(by_name[i]->shape), ", input_ids ",
                                                     ShapeText(ids->shape), ": they must match"));
    }
  }
  const int64_t seq = ids->shape.back();
  const int64_t choices = ids->shape.size() == 3 ? ids->shape[1] : 1;
  const int64_t rows = ids->shape[0] * choices;
  if (rows < 1 || seq < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("input 'input_ids' has shape ", ShapeText(ids->shape), ": every dimension must be at least 1"));
  }
  if (max_padded_ids > 0 && rows * seq > max_padded_ids) {
    return absl::InvalidArgumentError(absl::StrCat("input 'input_ids' has ", rows * seq, " ids, more than the ",
                                                   max_padded_ids, " one batch takes (--max_batch_tokens)"));
  }
  v1::TokenInputs* tokens = out.mutable_tokens();
  tokens->set_rows(rows);
  tokens->set_seq(seq);
  if (ids->shape.size() == 3) tokens->set_choices(choices);
  tokens->mutable_input_ids()->Add(ids->ints.begin(), ids->ints.end());
  if (by_name[1] != nullptr) tokens->mutable_attention_mask()->Add(by_name[1]->ints.begin(), by_name[1]->ints.end());
  if (by_name[2] != nullptr) tokens->mutable_token_type_ids()->Add(by_name[2]->ints.begin(), by_name[2]->ints.end());
  return out;
}

absl::StatusOr<std::vector<Tensor>> OutputsOf(const v1::InferResponse& response,
                                              const std::vector<std::string>& wanted) {
  std::vector<Tensor> all;
  for (const v1::NamedTensor& t : response.outputs()) {
    std::vector<int64_t> shape(t.shape().begin(), t.shape().end());
    absl::StatusOr<int64_t> elements = ElementCount(shape, t.name());
    if (!elements.ok() || *elements != t.values_size()) {
      return absl::InternalError(absl::StrCat("the job answered output '", t.name(), "' with ", t.values_size(),
                                              " values for shape ", ShapeText(shape)));
    }
    all.push_back({t.name(), "FP32", std::move(shape), {}, {}, {t.values().begin(), t.values().end()}});
  }
  if (wanted.empty()) return all;
  std::vector<Tensor> chosen;
  for (size_t i = 0; i < wanted.size(); ++i) {
    const std::string& name = wanted[i];
    for (size_t j = 0; j < i; ++j) {
      if (wanted[j] == name) return absl::InvalidArgumentError(absl::StrCat("output '", name, "' asked for twice"));
    }
    const v1::TokenInputs& ran = response.tokens();
    if (name == "input_ids") {
      chosen.push_back(RanOn(ran, name, ran.input_ids()));
    } else if (name == "attention_mask") {
      chosen.push_back(RanOn(ran, name, ran.attention_mask()));
    } else if (name == "token_type_ids") {
      chosen.push_back(RanOn(ran, name, ran.token_type_ids()));
    } else {
      bool found = false;
      for (const Tensor& t : all) {
        if (t.name == name) {
          chosen.push_back(t);  // once: the routes pair each chosen output with its own flags
          found = true;
          break;
        }
      }
      if (!found) {
        std::vector<std::string> names;
        for (const Tensor& t : all) names.push_back(t.name);
        return absl::InvalidArgumentError(absl::StrCat("unknown output '", name, "': the model returns ",
                                                       absl::StrJoin(names, ", "),
                                                       " (and input_ids, attention_mask, token_type_ids)"));
      }
    }
  }
  return chosen;
}

absl::StatusOr<InferResult> Infer(InferenceBackend* backend, const InferRequest& request,
                                  const std::string& default_job, const CallContext& call) {
  absl::StatusOr<ModelInfo> model = ServingModel(backend, request.model, request.version, default_job);
  if (!model.ok()) return model.status();
  absl::StatusOr<v1::InferRequest> infer = ToInferRequest(request, model->job_id, call.max_padded_ids);
  if (!infer.ok()) return infer.status();
  // An output the architecture has not is refused before the forward runs for it.
  const std::vector<TensorMetadata> known = OutputsOfVariant(*model);
  for (const std::string& name : request.outputs) {
    bool found = IsIdInput(name);
    for (const TensorMetadata& t : known) found = found || t.name == name;
    if (!found) {
      std::vector<std::string> names;
      for (const TensorMetadata& t : known) names.push_back(t.name);
      return absl::InvalidArgumentError(absl::StrCat("unknown output '", name, "': the model returns ",
                                                     absl::StrJoin(names, ", "),
                                                     " (and input_ids, attention_mask, token_type_ids)"));
    }
  }
  absl::StatusOr<v1::InferResponse> response = backend->Infer(*infer, call);
  if (!response.ok()) return response.status();
  absl::StatusOr<std::vector<Tensor>> outputs = OutputsOf(*response, request.outputs);
  if (!outputs.ok()) return outputs.status();
  InferResult result;
  result.model_name = request.model.empty() ? model->public_name() : request.model;
  result.id = request.id;
  result.outputs = *std::move(outputs);
  return result;
}

absl::Status DecodeRaw(absl::string_view raw, Tensor* tensor) {
  absl::StatusOr<size_t> width = RawWidth(tensor->datatype, tensor->name);
  if (!width.ok()) return width.status();
  absl::StatusOr<int64_t> elements = ElementCount(tensor->shape, tensor->name);
  if (!elements.ok()) return elements.status();
  if (tensor->datatype == "BYTES") {
    tensor->bytes.clear();
    size_t at = 0;
    while (at < raw.size()) {
      if (raw.size() - at < 4) {
        return absl::InvalidArgumentError(
            absl::StrCat("input '", tensor->name, "': raw BYTES end inside an element's 4-byte length"));
      }
      const uint32_t length = ReadU32(raw.data() + at);
      at += 4;
      if (length > raw.size() - at) {
        return absl::InvalidArgumentError(absl::StrCat("input '", tensor->name, "': a raw BYTES element of ", length,
                                                       " bytes runs past the end of the ", raw.size(), " given"));
      }
      if (static_cast<int64_t>(tensor->bytes.size()) == *elements) {
        return absl::InvalidArgumentError(absl::StrCat("input '", tensor->name, "': raw BYTES hold more than the ",
                                                       *elements, " elements of shape ", ShapeText(tensor->shape)));
      }
      tensor->bytes.emplace_back(raw.substr(at, length));
      at += length;
    }
    if (static_cast<int64_t>(tensor->bytes.size()) != *elements) {
      return absl::InvalidArgumentError(absl::StrCat("input '", tensor->name, "': raw BYTES hold ",
                                                     tensor->bytes.size(), " elements, shape ",
                                                     ShapeText(tensor->shape), " takes ", *elements));
    }
    return absl::OkStatus();
  }
  if (static_cast<uint64_t>(*elements) * *width != raw.size()) {
    return absl::InvalidArgumentError(absl::StrCat("input '", tensor->name, "': ", raw.size(), " raw bytes, but ",
                                                   tensor->datatype, " ", ShapeText(tensor->shape), " takes ",
                                                   *elements * static_cast<int64_t>(*width)));
  }
  tensor->ints.resize(static_cast<size_t>(*elements));
  for (size_t i = 0; i < tensor->ints.size(); ++i) {
    const char* p = raw.data() + i * *width;
    if (*width == 8) {
      uint64_t v = 0;
      for (int b = 7; b >= 0; --b) v = (v << 8) | static_cast<unsigned char>(p[b]);
      tensor->ints[i] = static_cast<int64_t>(v);
    } else {
      tensor->ints[i] = static_cast<int32_t>(ReadU32(p));
    }
  }
  return absl::OkStatus();
}

std::string EncodeRaw(const Tensor& tensor) {
  std::string out;
  if (tensor.datatype == "FP32") {
    out.reserve(tensor.floats.size() * 4);
    for (const float f : tensor.floats) {
      uint32_t bits = 0;
      std::memcpy(&bits, &f, sizeof(bits));
      AppendLittleEndian(bits, 4, &out);
    }
  } else if (tensor.datatype == "BYTES") {
    for (const std::string& b : tensor.bytes) {
      AppendLittleEndian(b.size(), 4, &out);
      out.append(b);
    }
  } else {
    out.reserve(tensor.ints.size() * 8);
    for (const int64_t v : tensor.ints) AppendLittleEndian(static_cast<uint64_t>(v), 8, &out);
  }
  return out;
}

int HttpStatusOf(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kOk:
      return 200;
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kOutOfRange:
    case absl::StatusCode::kFailedPrecondition:
      return 400;
    case absl::StatusCode::kUnauthenticated:
      return 401;
    case absl::StatusCode::kPermissionDenied:
      return 403;
    case absl::StatusCode::kNotFound:
      return 404;
    case absl::StatusCode::kResourceExhausted:
      return 429;
    case absl::StatusCode::kUnavailable:
      return 503;
    case absl::StatusCode::kDeadlineExceeded:
      return 504;
    default:
      return 500;
  }
}

}  // namespace bertshard::http::kserve
