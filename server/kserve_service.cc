#include "server/kserve_service.h"

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/grpc_status.h"
#include "http/kserve.h"

namespace bertshard::server {
namespace {

namespace kserve = http::kserve;

// A tensor's values from its typed contents (INT64, INT32, BYTES), when no raw contents came.
absl::Status FromContents(const inference::InferTensorContents& contents, kserve::Tensor* tensor) {
  if (tensor->datatype == "BYTES") {
    tensor->bytes.assign(contents.bytes_contents().begin(), contents.bytes_contents().end());
  } else if (tensor->datatype == "INT64") {
    tensor->ints.assign(contents.int64_contents().begin(), contents.int64_contents().end());
  } else if (tensor->datatype == "INT32") {
    tensor->ints.assign(contents.int_contents().begin(), contents.int_contents().end());
  } else {
    return absl::InvalidArgumentError(absl::StrCat("input '", tensor->name, "': datatype ", tensor->datatype,
                                                   " is not taken (INT64, INT32 or BYTES)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<kserve::InferRequest> ReadRequest(const inference::ModelInferRequest& request) {
  kserve::InferRequest out;
  out.model = request.model_name();
  out.version = request.model_version();
  out.id = request.id();
  if (const auto it = request.parameters().find("truncate"); it != request.parameters().end()) {
    if (it->second.parameter_choice_case() != inference::InferParameter::kBoolParam) {
      return absl::InvalidArgumentError("parameter 'truncate' must be a bool");
    }
    out.truncate = it->second.bool_param();
  }
  const bool raw = request.raw_input_contents_size() > 0;
  if (raw && request.raw_input_contents_size() != request.inputs_size()) {
    return absl::InvalidArgumentError(absl::StrCat(request.raw_input_contents_size(), " raw_input_contents for ",
                                                   request.inputs_size(), " inputs: one per input, in their order"));
  }
  for (int i = 0; i < request.inputs_size(); ++i) {
    const inference::ModelInferRequest::InferInputTensor& input = request.inputs(i);
    kserve::Tensor tensor{input.name(), input.datatype(), {input.shape().begin(), input.shape().end()}, {}, {}, {}};
    if (input.parameters().count("shared_memory_region") > 0) {
      return absl::InvalidArgumentError(absl::StrCat("input '", input.name(), "': shared memory is not supported"));
    }
    absl::Status read =
        raw ? kserve::DecodeRaw(request.raw_input_contents(i), &tensor) : FromContents(input.contents(), &tensor);
    if (!read.ok()) return read;
    out.inputs.push_back(std::move(tensor));
  }
  for (const auto& output : request.outputs()) {
    if (output.parameters().count("classification") > 0 || output.parameters().count("shared_memory_region") > 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "output '", output.name(), "': the classification and shared memory extensions are not supported"));
    }
    out.outputs.push_back(output.name());
  }
  return out;
}

}  // namespace

#define RETURN_IF_DENIED(context)                                                                                  \
  if (grpc::Status denied = common::CheckAccess(*(context), options_.auth, common::Access::kRead); !denied.ok()) { \
    return denied;                                                                                                 \
  }

grpc::Status KServeService::ServerLive(grpc::ServerContext*, const inference::ServerLiveRequest*,
                                       inference::ServerLiveResponse* response) {
  response->set_live(true);
  return grpc::Status::OK;
}

grpc::Status KServeService::ServerReady(grpc::ServerContext*, const inference::ServerReadyRequest*,
                                        inference::ServerReadyResponse* response) {
  response->set_ready(kserve::ServerReady(backend_, options_.default_job));
  return grpc::Status::OK;
}

grpc::Status KServeService::ModelReady(grpc::ServerContext* context, const inference::ModelReadyRequest* request,
                                       inference::ModelReadyResponse* response) {
  RETURN_IF_DENIED(context);
  const absl::Status serving =
      kserve::ServingModel(backend_, request->name(), request->version(), options_.default_job).status();
  // Not serving, or unknown (yet: a client polls before the job is submitted), is "not ready", as
  // Triton answers and as the HTTP route says; other failures are errors.
  if (!serving.ok() && serving.code() != absl::StatusCode::kUnavailable &&
      serving.code() != absl::StatusCode::kNotFound && serving.code() != absl::StatusCode::kFailedPrecondition) {
    return common::ToGrpcStatus(serving);
  }
  response->set_ready(serving.ok());
  return grpc::Status::OK;
}

grpc::Status KServeService::ServerMetadata(grpc::ServerContext* context, const inference::ServerMetadataRequest*,
                                           inference::ServerMetadataResponse* response) {
  RETURN_IF_DENIED(context);
  response->set_name(std::string(kserve::kServerName));
  response->set_version(options_.version);
  for (const std::string& e : kserve::ServerExtensions()) response->add_extensions(e);
  return grpc::Status::OK;
}

grpc::Status KServeService::ModelMetadata(grpc::ServerContext* context, const inference::ModelMetadataRequest* request,
                                          inference::ModelMetadataResponse* response) {
  RETURN_IF_DENIED(context);
  absl::StatusOr<http::ModelInfo> model =
      kserve::ServingModel(backend_, request->name(), request->version(), options_.default_job);
  if (!model.ok()) return common::ToGrpcStatus(model.status());
  const kserve::ModelMetadata metadata = kserve::MetadataOf(*model);
  response->set_name(request->name().empty() ? metadata.name : request->name());
  for (const std::string& v : metadata.versions) response->add_versions(v);
  response->set_platform(metadata.platform);
  for (const auto& [list, into] : {std::pair{&metadata.inputs, response->mutable_inputs()},
                                   std::pair{&metadata.outputs, response->mutable_outputs()}}) {
    for (const kserve::TensorMetadata& t : *list) {
      auto* tensor = into->Add();
      tensor->set_name(t.name);
      tensor->set_datatype(t.datatype);
      for (const int64_t d : t.shape) tensor->add_shape(d);
    }
  }
  return grpc::Status::OK;
}

grpc::Status KServeService::ModelInfer(grpc::ServerContext* context, const inference::ModelInferRequest* request,
                                       inference::ModelInferResponse* response) {
  RETURN_IF_DENIED(context);
  absl::StatusOr<kserve::InferRequest> infer = ReadRequest(*request);
  if (!infer.ok()) return common::ToGrpcStatus(infer.status());
  http::CallContext call;
  // The caller's deadline, capped as bertshard.v1 Infer's is.
  call.deadline = std::min(absl::FromChrono(context->deadline()), absl::Now() + absl::Minutes(10));
  call.client = options_.client_of ? options_.client_of(*context) : "peer:" + context->peer();
  call.connection = context->peer();
  call.max_padded_ids = options_.max_padded_ids;
  // A caller that went away (tritonclient's cancel, a deadline) drops its request if not yet sent.
  call.cancelled = [context] { return context->IsCancelled(); };
  absl::StatusOr<kserve::InferResult> result = kserve::Infer(backend_, *infer, options_.default_job, call);
  if (!result.ok()) return common::ToGrpcStatus(result.status());
  response->set_model_name(result->model_name);
  response->set_model_version(result->model_version);
  response->set_id(result->id);
  for (const kserve::Tensor& t : result->outputs) {
    auto* output = response->add_outputs();
    output->set_name(t.name);
    output->set_datatype(t.datatype);
    for (const int64_t d : t.shape) output->add_shape(d);
    response->add_raw_output_contents(kserve::EncodeRaw(t));
  }
  return grpc::Status::OK;
}

#undef RETURN_IF_DENIED

}  // namespace bertshard::server
