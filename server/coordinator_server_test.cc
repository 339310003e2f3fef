#include "server/coordinator_server.h"

#include <filesystem>
#include <fstream>
#include <limits>
#include <set>
#include <string>

#include "bertshard/v1/coordinator.grpc.pb.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpc/reflection/v1alpha/reflection.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "inference/grpc_service.grpc.pb.h"

namespace bertshard::server {
namespace {

class CoordinatorServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto server = CoordinatorServer::Start({.listen_address = "127.0.0.1:0"});
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    ASSERT_GT(server_->port(), 0);
    channel_ = grpc::CreateChannel("127.0.0.1:" + std::to_string(server_->port()), grpc::InsecureChannelCredentials());
  }

  static void SetDeadline(grpc::ClientContext* context) {
    context->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  }

  std::unique_ptr<CoordinatorServer> server_;
  std::shared_ptr<grpc::Channel> channel_;
};

TEST_F(CoordinatorServerTest, PlanReturnsThePlan) {
  auto stub = v1::Coordinator::NewStub(channel_);
  v1::PlanRequest request;
  request.set_variant(v1::BERT_FOR_MASKED_LM);
  request.mutable_parallel()->set_tp_size(2);
  request.mutable_parallel()->set_pp_size(2);
  grpc::ClientContext context;
  SetDeadline(&context);
  v1::ShardPlan plan;
  grpc::Status status = stub->Plan(&context, request, &plan);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(plan.ranks_size(), 4);
  EXPECT_EQ(plan.layers_per_stage_size(), 2);
  EXPECT_EQ(plan.stages(1).held_modules(plan.stages(1).held_modules_size() - 1), "cls");
}

TEST_F(CoordinatorServerTest, InvalidRequestIsInvalidArgumentWithValidSizes) {
  auto stub = v1::Coordinator::NewStub(channel_);
  v1::PlanRequest request;
  request.set_variant(v1::BERT_MODEL);
  request.mutable_parallel()->set_tp_size(5);
  grpc::ClientContext context;
  SetDeadline(&context);
  v1::ShardPlan plan;
  grpc::Status status = stub->Plan(&context, request, &plan);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(status.error_message(),
            "tp_size 5 does not divide num_attention_heads 12; valid tp_size values: 1, 2, 3, 4, 6, 12");
}

// Placement trusts the devices workers report: one it cannot read is refused at registration.
TEST_F(CoordinatorServerTest, AWorkerReportingAnUnknownDeviceIsRefused) {
  auto stub = v1::Coordinator::NewStub(channel_);
  v1::RegisterWorkerRequest request;
  request.set_address("127.0.0.1:9");
  v1::RegisterWorkerResponse response;
  for (const char* device : {"gpu", "cuda:x"}) {
    grpc::ClientContext context;
    SetDeadline(&context);
    request.set_device(device);
    const grpc::Status status = stub->RegisterWorker(&context, request, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << device;
    EXPECT_NE(status.error_message().find("valid: cpu, cuda:N"), std::string::npos) << status.error_message();
  }
  grpc::ClientContext context;
  SetDeadline(&context);
  request.set_device("cuda:1");
  EXPECT_TRUE(stub->RegisterWorker(&context, request, &response).ok());
}

TEST_F(CoordinatorServerTest, HealthServesThenStopsServingOnShutdown) {
  auto health = grpc::health::v1::Health::NewStub(channel_);
  grpc::health::v1::HealthCheckRequest request;
  grpc::health::v1::HealthCheckResponse response;
  {
    grpc::ClientContext context;
    SetDeadline(&context);
    ASSERT_TRUE(health->Check(&context, request, &response).ok());
    EXPECT_EQ(response.status(), grpc::health::v1::HealthCheckResponse::SERVING);
  }
  server_->Shutdown(absl::Seconds(1));
  server_->Wait();
  grpc::ClientContext context;
  SetDeadline(&context);
  EXPECT_FALSE(health->Check(&context, request, &response).ok());
}

// Asks the reflection service one question on a fresh stream.
grpc::reflection::v1alpha::ServerReflectionResponse Reflect(
    grpc::Channel* channel, const grpc::reflection::v1alpha::ServerReflectionRequest& request) {
  auto stub = grpc::reflection::v1alpha::ServerReflection::NewStub(
      std::shared_ptr<grpc::Channel>(channel, [](grpc::Channel*) {}));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  auto stream = stub->ServerReflectionInfo(&context);
  grpc::reflection::v1alpha::ServerReflectionResponse response;
  EXPECT_TRUE(stream->Write(request));
  stream->WritesDone();
  EXPECT_TRUE(stream->Read(&response));
  EXPECT_TRUE(stream->Finish().ok());
  return response;
}

TEST_F(CoordinatorServerTest, ReflectionListsAndDescribesServices) {
  grpc::reflection::v1alpha::ServerReflectionRequest list;
  list.set_list_services("");
  auto listed = Reflect(channel_.get(), list);
  std::set<std::string> names;
  for (const auto& s : listed.list_services_response().service()) names.insert(s.name());
  EXPECT_TRUE(names.count("bertshard.v1.Coordinator"));
  EXPECT_TRUE(names.count("grpc.health.v1.Health"));
  EXPECT_TRUE(names.count("grpc.reflection.v1alpha.ServerReflection"));
  EXPECT_TRUE(names.count("inference.GRPCInferenceService"));

  for (const char* symbol : {"bertshard.v1.Coordinator", "grpc.health.v1.Health", "inference.GRPCInferenceService"}) {
    SCOPED_TRACE(symbol);
    grpc::reflection::v1alpha::ServerReflectionRequest describe;
    describe.set_file_containing_symbol(symbol);
    auto described = Reflect(channel_.get(), describe);
    EXPECT_FALSE(described.has_error_response()) << described.error_response().error_message();
    EXPECT_GT(described.file_descriptor_response().file_descriptor_proto_size(), 0);
  }
}

// KServe v2's gRPC service answers on the coordinator's own port, beside bertshard.v1, as
// tritonclient.grpc expects: live with no job, a model not (yet) served not ready.
TEST_F(CoordinatorServerTest, KServeAnswersOnTheSamePort) {
  auto stub = inference::GRPCInferenceService::NewStub(channel_);
  {
    grpc::ClientContext context;
    SetDeadline(&context);
    inference::ServerLiveResponse live;
    const grpc::Status status = stub->ServerLive(&context, inference::ServerLiveRequest(), &live);
    ASSERT_TRUE(status.ok()) << status.error_message();
    EXPECT_TRUE(live.live());
  }
  {
    grpc::ClientContext context;
    SetDeadline(&context);
    inference::ModelReadyRequest request;
    request.set_name("no-such-model");
    inference::ModelReadyResponse ready;
    ready.set_ready(true);
    const grpc::Status status = stub->ModelReady(&context, request, &ready);
    ASSERT_TRUE(status.ok()) << status.error_message();
    EXPECT_FALSE(ready.ready());  // not (yet) served: not ready, as Triton answers
  }
}

TEST(CoordinatorServerStart, RejectsMalformedAndBusyAddresses) {
  EXPECT_EQ(CoordinatorServer::Start({.listen_address = "no-port"}).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto first = CoordinatorServer::Start({.listen_address = "127.0.0.1:0"});
  ASSERT_TRUE(first.ok());
  auto second = CoordinatorServer::Start({.listen_address = "127.0.0.1:" + std::to_string((*first)->port())});
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace bertshard::server

namespace bertshard::server {
namespace {

TEST(CoordinatorServerLimits, OversizedMessagesAndUnknownJobsAreRefused) {
  auto server = CoordinatorServer::Start({.listen_address = "127.0.0.1:0", .max_message_bytes = 1 << 20});
  ASSERT_TRUE(server.ok()) << server.status();
  grpc::ChannelArguments args;
  args.SetMaxSendMessageSize(64 << 20);
  auto stub = v1::Coordinator::NewStub(grpc::CreateCustomChannel("127.0.0.1:" + std::to_string((*server)->port()),
                                                                 grpc::InsecureChannelCredentials(), args));
  v1::InferRequest infer;
  infer.set_job_id("job-x");
  infer.mutable_tokens()->mutable_input_ids()->Resize(1 << 21, 1);  // 2 MiB of varints > 1 MiB
  v1::InferResponse response;
  grpc::ClientContext big;
  big.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  EXPECT_EQ(stub->Infer(&big, infer, &response).error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  infer.mutable_tokens()->Clear();
  grpc::ClientContext small;
  small.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  EXPECT_EQ(stub->Infer(&small, infer, &response).error_code(), grpc::StatusCode::NOT_FOUND);
  v1::GetJobRequest get;
  get.set_job_id("job-x");
  v1::Job job;
  grpc::ClientContext get_context;
  EXPECT_EQ(stub->GetJob(&get_context, get, &job).error_code(), grpc::StatusCode::NOT_FOUND);
  v1::SubmitJobRequest submit;  // no checkpoint
  grpc::ClientContext submit_context;
  EXPECT_EQ(stub->SubmitJob(&submit_context, submit, &job).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
}

// Requests are received only up to what the serving limits admit, whatever the message limit
// answers may use (issue 21, item 4: gRPC parses a request whole before any handler sees it).
TEST(CoordinatorServerLimits, RequestsAreReceivedOnlyUpToWhatTheServingLimitsAdmit) {
  BatchLimits defaults;
  EXPECT_EQ(DefaultMaxRequestBytes(defaults), (32 << 20) + 16384 * 40 + (1 << 20));
  BatchLimits small{.max_batch_tokens = 512, .max_request_text_bytes = 1 << 20};
  EXPECT_EQ(DefaultMaxRequestBytes(small), 4 << 20);  // the floor
  BatchLimits uncapped{.max_request_text_bytes = 0};
  EXPECT_EQ(DefaultMaxRequestBytes(uncapped), 0);  // the message limit then
  BatchLimits huge{.max_batch_tokens = int64_t{1} << 40, .max_request_text_bytes = int64_t{1} << 40};
  EXPECT_EQ(DefaultMaxRequestBytes(huge), std::numeric_limits<int>::max());

  CoordinatorOptions options{.listen_address = "127.0.0.1:0", .max_message_bytes = 64 << 20};
  options.cluster.batching.max_batch_tokens = 512;
  options.cluster.batching.max_request_text_bytes = 1 << 20;  // receives up to 4 MiB
  auto server = CoordinatorServer::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  grpc::ChannelArguments args;
  args.SetMaxSendMessageSize(-1);
  auto stub = v1::Coordinator::NewStub(grpc::CreateCustomChannel("127.0.0.1:" + std::to_string((*server)->port()),
                                                                 grpc::InsecureChannelCredentials(), args));
  v1::InferRequest infer;
  infer.set_job_id("job-x");
  v1::InferResponse response;
  for (const int ids : {(4 << 20) + 1, (4 << 20) - 64}) {
    infer.mutable_tokens()->mutable_input_ids()->Resize(ids, 1);  // one byte each on the wire
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    const grpc::Status status = stub->Infer(&context, infer, &response);
    // Over the request limit: refused before parsing; under it: read, and the job is unknown.
    EXPECT_EQ(status.error_code(), ids > (4 << 20) ? grpc::StatusCode::RESOURCE_EXHAUSTED : grpc::StatusCode::NOT_FOUND)
        << ids << ": " << status.error_message();
  }
}

// With tokens: RPCs that change state need the cluster token, the others the read token (or the
// cluster's); missing or unknown is UNAUTHENTICATED, the read token where the cluster token is
// needed is PERMISSION_DENIED; health stays open; no refusal quotes what was sent.
TEST(CoordinatorServerAuth, TokensGateRpcsWithTheCodesGrpcDefines) {
  CoordinatorOptions options{.listen_address = "127.0.0.1:0"};
  options.auth = {"admin-secret-123", "read-secret-456"};
  auto server = CoordinatorServer::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  auto channel =
      grpc::CreateChannel("127.0.0.1:" + std::to_string((*server)->port()), grpc::InsecureChannelCredentials());
  auto stub = v1::Coordinator::NewStub(channel);
  const auto call = [&](const std::string& header, bool submit) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    if (!header.empty()) context.AddMetadata("authorization", header);
    if (submit) {
      v1::SubmitJobRequest request;  // no checkpoint: INVALID_ARGUMENT once past the token check
      v1::Job job;
      return stub->SubmitJob(&context, request, &job);
    }
    v1::ListJobsResponse jobs;
    return stub->ListJobs(&context, v1::ListJobsRequest(), &jobs);
  };
  for (const bool submit : {true, false}) {
    SCOPED_TRACE(submit ? "SubmitJob" : "ListJobs");
    grpc::Status s = call("", submit);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << s.error_message();
    s = call("Bearer wrong-token-789", submit);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED);
    EXPECT_EQ(s.error_message().find("wrong-token-789"), std::string::npos) << s.error_message();
    EXPECT_EQ(call("Basic admin-secret-123", submit).error_code(), grpc::StatusCode::UNAUTHENTICATED);
    EXPECT_EQ(call("Bearer admin-secret-12", submit).error_code(), grpc::StatusCode::UNAUTHENTICATED);
    s = call("Bearer read-secret-456", submit);
    EXPECT_EQ(s.error_code(), submit ? grpc::StatusCode::PERMISSION_DENIED : grpc::StatusCode::OK) << s.error_message();
    s = call("Bearer admin-secret-123", submit);
    EXPECT_EQ(s.error_code(), submit ? grpc::StatusCode::INVALID_ARGUMENT : grpc::StatusCode::OK) << s.error_message();
    EXPECT_EQ(s.error_message().find("secret"), std::string::npos) << s.error_message();
  }
  // Health needs no token.
  auto health = grpc::health::v1::Health::NewStub(channel);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  grpc::health::v1::HealthCheckResponse response;
  EXPECT_TRUE(health->Check(&context, grpc::health::v1::HealthCheckRequest(), &response).ok());
}

// Without a read token, only what changes state needs the cluster token.
TEST(CoordinatorServerAuth, WithoutAReadTokenReadsAreOpen) {
  CoordinatorOptions options{.listen_address = "127.0.0.1:0"};
  options.auth.admin_token = "admin-secret-123";
  auto server = CoordinatorServer::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  auto stub = v1::Coordinator::NewStub(
      grpc::CreateChannel("127.0.0.1:" + std::to_string((*server)->port()), grpc::InsecureChannelCredentials()));
  grpc::ClientContext list_context;
  v1::ListJobsResponse jobs;
  EXPECT_TRUE(stub->ListJobs(&list_context, v1::ListJobsRequest(), &jobs).ok());
  grpc::ClientContext cancel_context;
  v1::GetJobRequest cancel;
  cancel.set_job_id("job-1");
  v1::Job job;
  EXPECT_EQ(stub->CancelJob(&cancel_context, cancel, &job).error_code(), grpc::StatusCode::UNAUTHENTICATED);
}

// Limits seen through gRPC: a message over --max_message_bytes is RESOURCE_EXHAUSTED before any
// handler runs, and a job records who submitted it (the peer's host without TLS), which the
// per-client job limit counts.
TEST(CoordinatorServerLimits, OversizedMessagesAndTheSubmitter) {
  const std::string dir = testing::TempDir() + "/limits_model";
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/config.json") << R"({"architectures": ["BertForMaskedLM"]})";
  CoordinatorOptions options{.listen_address = "127.0.0.1:0", .max_message_bytes = 8192};
  options.cluster.max_jobs_per_client = 1;
  auto server = CoordinatorServer::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  auto stub = v1::Coordinator::NewStub(
      grpc::CreateChannel("127.0.0.1:" + std::to_string((*server)->port()), grpc::InsecureChannelCredentials()));
  v1::SubmitJobRequest submit;
  submit.mutable_request()->set_checkpoint(std::string(20000, 'x'));
  v1::Job job;
  grpc::ClientContext big;
  EXPECT_EQ(stub->SubmitJob(&big, submit, &job).error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  submit.mutable_request()->set_checkpoint(dir);
  grpc::ClientContext first;
  ASSERT_TRUE(stub->SubmitJob(&first, submit, &job).ok());
  EXPECT_EQ(job.submitted_by(), "host:127.0.0.1");
  grpc::ClientContext second;
  const grpc::Status s = stub->SubmitJob(&second, submit, &job);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
}

}  // namespace
}  // namespace bertshard::server
