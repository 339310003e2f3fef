// File: http/kserve.h
// -----------------------------------------------------------------------------
// The KServe v2 inference protocol's core, shared by its two transports: the HTTP/REST routes
// (http/kserve_routes.cc, under /v2 on the HTTP port) and the gRPC service
// inference.GRPCInferenceService (server/kserve_service.h). Each transport reads its own wire form
// into the plain values here and writes them back; this file maps them onto the request path
// (InferenceBackend::Infer, the same call as bertshard.v1 Infer) and back. docs/http.md lists the
// routes, tensors and errors.
//
// A model is a job, named by id or name as every other route names one; it has one version, "1".
// Inputs: `input_ids`, and optionally `attention_mask` and `token_type_ids`, as INT64 (or INT32)
// [batch, seq] ([batch, choices, seq] for a multiple-choice model); or `text` as BYTES [batch]
// (or [batch, 1]), with an optional `text_pair` of the same shape, tokenised by the job as
// Infer's text is. Outputs: the model's tensors as Infer returns them (FP32, Hugging Face's names
// and shapes: last_hidden_state, pooler_output, logits, ...), all of them or those the request
// lists, in its order; listed by name, `input_ids`, `attention_mask` and `token_type_ids` (INT64
// [rows, seq]) give what the model ran on (a text's tokens and padding).
//
// Example:
//   kserve::InferRequest request;
//   request.model = "minilm";
//   request.inputs.push_back({.name = "input_ids", .datatype = "INT64", .shape = {1, 3}, .ints = {101, 7592, 102}});
//   ASSIGN_OR_RETURN(kserve::InferResult result, kserve::Infer(&backend, request, "", call));
//   // result.outputs[0].name == "last_hidden_state", .shape == {1, 3, 384}, .floats.size() == 1152
//
// Failure model: every refusal is an absl::Status: INVALID_ARGUMENT for input that is not what
// the model takes (naming the tensor and what is valid; nothing is sent on), NOT_FOUND for an
// unknown model or version, UNAVAILABLE for a job that exists but does not serve, and the request
// path's own codes (RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED, ...). HttpStatusOf gives KServe's HTTP
// status for each. Nothing here aborts or throws on input.
//
// Thread safety: thread-safe (pure functions over a thread-safe backend).
#ifndef BERTSHARD_HTTP_KSERVE_H_
#define BERTSHARD_HTTP_KSERVE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "bertshard/v1/coordinator.pb.h"
#include "http/inference_backend.h"

namespace bertshard::http::kserve {

// A tensor as the protocol carries it; its elements, row-major, in the list of its datatype:
// `ints` for INT64 and INT32, `bytes` for BYTES, `floats` for FP32.
struct Tensor {
  std::string name;
  std::string datatype;
  std::vector<int64_t> shape;
  std::vector<int64_t> ints;
  std::vector<std::string> bytes;
  std::vector<float> floats;
};

struct InferRequest {
  std::string model;    // a job's id or name; empty: the default (or only) serving job
  std::string version;  // empty or "1"
  std::string id;       // echoed in the result
  std::vector<Tensor> inputs;
  std::vector<std::string> outputs;  // the names wanted, in order; empty: every model output
  bool truncate = false;             // parameters.truncate: cut texts to the model's length
};

struct InferResult {
  std::string model_name;  // as the request named it (the job's name, else its id, when it named none)
  std::string model_version = "1";
  std::string id;
  std::vector<Tensor> outputs;
};

struct TensorMetadata {
  std::string name;
  std::string datatype;
  std::vector<int64_t> shape;  // -1: any size
};

struct ModelMetadata {
  std::string name;
  std::vector<std::string> versions;  // {"1"}
  std::string platform;               // "bertshard_<architecture>", e.g. bertshard_BertModel
  std::vector<TensorMetadata> inputs;
  std::vector<TensorMetadata> outputs;
};

// What the server metadata says.
constexpr absl::string_view kServerName = "bertshard";
// The protocol extensions served: binary tensors (HTTP's Inference-Header-Content-Length).
std::vector<std::string> ServerExtensions();

// The serving job `model` names at `version`: NOT_FOUND for no such job or a version other than
// "" and "1"; UNAVAILABLE (saying why) for a job that exists but does not serve now.
absl::StatusOr<ModelInfo> ServingModel(InferenceBackend* backend, const std::string& model, const std::string& version,
                                       const std::string& default_job);

// Whether the server can serve inference: the default job serves, or (no default set) any job.
bool ServerReady(InferenceBackend* backend, const std::string& default_job);

// The inputs the job takes and the outputs its architecture returns (Hugging Face's names;
// dimensions the job's description does not give are -1).
ModelMetadata MetadataOf(const ModelInfo& model);

// The bertshard.v1 request for `request` on `job_id`, its inputs checked (names, datatypes,
// shapes, element counts, at most `max_padded_ids` ids) before anything is copied.
absl::StatusOr<v1::InferRequest> ToInferRequest(const InferRequest& request, const std::string& job_id,
                                                int64_t max_padded_ids);

// The outputs `wanted` (empty: every model output) of `response`, in that order.
// INVALID_ARGUMENT naming the outputs there are for an unknown one; INTERNAL for an answer
// whose tensors do not match their shapes.
absl::StatusOr<std::vector<Tensor>> OutputsOf(const v1::InferResponse& response,
                                              const std::vector<std::string>& wanted);

// ServingModel, ToInferRequest, the backend's Infer, OutputsOf.
absl::StatusOr<InferResult> Infer(InferenceBackend* backend, const InferRequest& request,
                                  const std::string& default_job, const CallContext& call);

// Raw tensor contents (gRPC's raw_input_contents, HTTP's binary extension): the elements of
// `tensor`'s datatype and shape read from `raw` into `tensor` (INT64, INT32 little-endian; BYTES
// as a 4-byte little-endian length and the bytes, per element). INVALID_ARGUMENT when `raw` is
// not exactly that many elements, or for another datatype.
absl::Status DecodeRaw(absl::string_view raw, Tensor* tensor);
// The raw form of an output (FP32, INT64 or BYTES).
std::string EncodeRaw(const Tensor& tensor);

// Elements of `shape`: INVALID_ARGUMENT for a negative dimension or more than 2^40 in all.
absl::StatusOr<int64_t> ElementCount(const std::vector<int64_t>& shape, const std::string& tensor);

// KServe's HTTP status for a refusal: 400 INVALID_ARGUMENT, OUT_OF_RANGE, FAILED_PRECONDITION;
// 404 NOT_FOUND; 429 RESOURCE_EXHAUSTED; 503 UNAVAILABLE; 504 DEADLINE_EXCEEDED; 401, 403 for
// the access codes; 500 otherwise.
int HttpStatusOf(const absl::Status& status);

}  // namespace bertshard::http::kserve

#endif  // BERTSHARD_HTTP_KSERVE_H_
