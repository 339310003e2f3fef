// KServeService over a real gRPC server (port 0) and a canned backend (http/fake_backend.h):
// what tritonclient.grpc sends (raw_input_contents) and reads (raw_output_contents), readiness,
// metadata, the read token, and bad input refused with INVALID_ARGUMENT and nothing run.
#include "server/kserve_service.h"

#include <atomic>
#include <cstring>
#include <memory>
#include <string>
#include <thread>

#include "absl/time/clock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "http/fake_backend.h"

namespace bertshard::server {
namespace {

class KServeServiceTest : public ::testing::Test {
 protected:
  void Start(KServeOptions options) {
    service_ = std::make_unique<KServeService>(&backend_, std::move(options));
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(service_.get());
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    stub_ = inference::GRPCInferenceService::NewStub(
        grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials()));
  }
  void TearDown() override {
    if (server_ != nullptr) server_->Shutdown();
  }
  static std::string Int64s(std::initializer_list<int64_t> values) {
    std::string raw;
    for (const int64_t v : values) raw.append(reinterpret_cast<const char*>(&v), 8);  // little-endian here
    return raw;
  }
  // An infer of `model` with one INT64 input_ids tensor [1, ids] in raw_input_contents, as
  // tritonclient.grpc sends it.
  static inference::ModelInferRequest IdsRequest(const std::string& model, std::initializer_list<int64_t> ids) {
    inference::ModelInferRequest request;
    request.set_model_name(model);
    auto* input = request.add_inputs();
    input->set_name("input_ids");
    input->set_datatype("INT64");
    input->add_shape(1);
    input->add_shape(static_cast<int64_t>(ids.size()));
    request.add_raw_input_contents(Int64s(ids));
    return request;
  }

  http::FakeBackend backend_;
  std::unique_ptr<KServeService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<inference::GRPCInferenceService::Stub> stub_;
};

TEST_F(KServeServiceTest, InferWithRawContentsAsTritonclientSends) {
  Start({});
  inference::ModelInferRequest request = IdsRequest("minilm", {101, 7592, 102});
  request.set_id("r1");
  grpc::ClientContext context;
  inference::ModelInferResponse response;
  const grpc::Status status = stub_->ModelInfer(&context, request, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  ASSERT_EQ(backend_.infers.size(), 1u);
  EXPECT_EQ(backend_.infers[0].job_id(), "job-1");
  EXPECT_EQ(backend_.infers[0].tokens().input_ids(1), 7592);
  EXPECT_EQ(response.model_name(), "minilm");
  EXPECT_EQ(response.model_version(), "1");
  EXPECT_EQ(response.id(), "r1");
  ASSERT_EQ(response.outputs_size(), 1);
  EXPECT_EQ(response.outputs(0).name(), "last_hidden_state");
  EXPECT_EQ(response.outputs(0).datatype(), "FP32");
  ASSERT_EQ(response.raw_output_contents_size(), 1);
  ASSERT_EQ(response.raw_output_contents(0).size(), 1u * 4 * 2 * 4);
  float last = 0;
  std::memcpy(&last, response.raw_output_contents(0).data() + 7 * 4, 4);
  EXPECT_EQ(last, 3.0f);  // row 0, position 3
}

TEST_F(KServeServiceTest, InferWithTypedBytesContents) {
  Start({});
  inference::ModelInferRequest request;
  request.set_model_name("sentiment");
  auto* text = request.add_inputs();
  text->set_name("text");
  text->set_datatype("BYTES");
  text->add_shape(1);
  text->mutable_contents()->add_bytes_contents("hello");
  (*request.mutable_parameters())["truncate"].set_bool_param(true);
  request.add_outputs()->set_name("logits");
  grpc::ClientContext context;
  inference::ModelInferResponse response;
  ASSERT_TRUE(stub_->ModelInfer(&context, request, &response).ok());
  ASSERT_EQ(backend_.infers.size(), 1u);
  EXPECT_EQ(backend_.infers[0].text().texts(0), "hello");
  EXPECT_TRUE(backend_.infers[0].truncate());
  ASSERT_EQ(response.outputs_size(), 1);
  EXPECT_EQ(response.outputs(0).shape(1), 2);
}

TEST_F(KServeServiceTest, BadInputIsInvalidArgumentAndNothingRuns) {
  Start({});
  const auto refuse = [&](inference::ModelInferRequest request, grpc::StatusCode code, const std::string& part) {
    grpc::ClientContext context;
    inference::ModelInferResponse response;
    const grpc::Status status = stub_->ModelInfer(&context, request, &response);
    EXPECT_EQ(status.error_code(), code) << status.error_message();
    EXPECT_NE(status.error_message().find(part), std::string::npos) << status.error_message();
  };
  inference::ModelInferRequest request;
  request.set_model_name("minilm");
  auto* ids = request.add_inputs();
  ids->set_name("input_ids");
  ids->set_datatype("INT64");
  ids->add_shape(1);
  ids->add_shape(2);
  inference::ModelInferRequest short_raw = request;
  short_raw.add_raw_input_contents(std::string(15, '\0'));
  refuse(short_raw, grpc::StatusCode::INVALID_ARGUMENT, "15 raw bytes");
  inference::ModelInferRequest two_raw = short_raw;
  two_raw.add_raw_input_contents("");
  refuse(two_raw, grpc::StatusCode::INVALID_ARGUMENT, "one per input");
  inference::ModelInferRequest floats = request;
  floats.mutable_inputs(0)->set_datatype("FP32");
  refuse(floats, grpc::StatusCode::INVALID_ARGUMENT, "not taken");
  inference::ModelInferRequest unknown = request;
  unknown.set_model_name("gpt-4");
  unknown.add_raw_input_contents(Int64s({1, 2}));
  refuse(unknown, grpc::StatusCode::NOT_FOUND, "unknown model");
  EXPECT_TRUE(backend_.infers.empty());
}

// The caller going away reaches the backend (which drops a request not yet sent): tritonclient's
// cancel, or its deadline.
TEST_F(KServeServiceTest, ACallerThatGoesAwayIsSeenAsCancelled) {
  Start({.default_job = "job-1"});
  std::atomic<bool> live{false}, seen{false};
  std::atomic<bool> in_backend{false};
  backend_.on_infer = [&](const http::CallContext& call) {
    live = call.cancelled && !call.cancelled();
    in_backend = true;
    for (int i = 0; i < 1000 && call.cancelled && !seen; ++i) {
      seen = call.cancelled();
      absl::SleepFor(absl::Milliseconds(10));
    }
  };
  const inference::ModelInferRequest request = IdsRequest("job-1", {101, 7, 102});
  grpc::ClientContext context;
  inference::ModelInferResponse response;
  std::thread cancel([&] {
    while (!in_backend) absl::SleepFor(absl::Milliseconds(1));
    context.TryCancel();
  });
  const grpc::Status status = stub_->ModelInfer(&context, request, &response);
  cancel.join();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::CANCELLED);
  server_->Shutdown();  // the handler has returned: what it saw is final
  server_.reset();
  EXPECT_TRUE(live) << "the backend was given no live cancellation check";
  EXPECT_TRUE(seen) << "the backend never saw the caller go away";
}

TEST_F(KServeServiceTest, HealthMetadataAndTheReadToken) {
  Start({.default_job = "", .auth = {.admin_token = "admin", .read_token = "secret"}, .version = "v9"});
  {
    grpc::ClientContext context;  // health needs no token
    inference::ServerReadyResponse ready;
    ASSERT_TRUE(stub_->ServerReady(&context, {}, &ready).ok());
    EXPECT_TRUE(ready.ready());
  }
  {
    grpc::ClientContext context;
    inference::ServerMetadataResponse metadata;
    EXPECT_EQ(stub_->ServerMetadata(&context, {}, &metadata).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  }
  const auto authed = [](grpc::ClientContext* context) { context->AddMetadata("authorization", "Bearer secret"); };
  {
    grpc::ClientContext context;
    authed(&context);
    inference::ServerMetadataResponse metadata;
    ASSERT_TRUE(stub_->ServerMetadata(&context, {}, &metadata).ok());
    EXPECT_EQ(metadata.name(), "bertshard");
    EXPECT_EQ(metadata.version(), "v9");
  }
  {
    grpc::ClientContext context;
    authed(&context);
    inference::ModelMetadataRequest request;
    request.set_name("sentiment");
    inference::ModelMetadataResponse metadata;
    ASSERT_TRUE(stub_->ModelMetadata(&context, request, &metadata).ok());
    EXPECT_EQ(metadata.platform(), "bertshard_BertForSequenceClassification");
    ASSERT_EQ(metadata.outputs_size(), 1);
    EXPECT_EQ(metadata.outputs(0).name(), "logits");
    EXPECT_EQ(metadata.inputs(0).name(), "input_ids");
  }
  for (const auto& [name, ready, code] :
       {std::tuple{"minilm", true, grpc::StatusCode::OK}, std::tuple{"ended", false, grpc::StatusCode::OK},
        std::tuple{"loading", false, grpc::StatusCode::OK},
        std::tuple{"gpt-4", false, grpc::StatusCode::OK}}) {  // unknown: not ready, as Triton says
    SCOPED_TRACE(name);
    grpc::ClientContext context;
    authed(&context);
    inference::ModelReadyRequest request;
    request.set_name(name);
    inference::ModelReadyResponse response;
    EXPECT_EQ(stub_->ModelReady(&context, request, &response).error_code(), code);
    EXPECT_EQ(response.ready(), ready);
  }
}

}  // namespace
}  // namespace bertshard::server
