// Issue 21, item 4, through a live coordinator: an Infer of 2,000,000 x 16 token ids (96 MB on the
// wire) sent over gRPC to a running coordinator serving a READY job. JobServing refuses it from its
// counts before copying anything (server/job_serving_test), but gRPC parses the whole message first,
// up to the receive limit: 32 M ids per array become 256 MB each in protobuf's repeated int64. The
// coordinator now receives requests only up to --max_request_bytes (derived from the serving limits),
// so the message is refused before it is parsed, and gRPC's memory quota for reading
// (--max_transport_memory_bytes) bounds what a message of any size costs while it is read. The coordinator's peak
// memory is read from its /proc/PID/status (VmRSS sampled while the call runs, and VmHWM after), and printed.
//
// The request is written as protobuf wire bytes and sent with a generic stub, so the test process
// never holds the parsed 768 MB itself. BERTSHARD_HUGE_ROWS changes the first message's rows (default the issue's).
#include <signal.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bertshard/v1/coordinator.grpc.pb.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/cluster_fixture.h"
#include "tests/proc_status.h"
#include "tests/serving_fixture.h"
#include "tests/test_process.h"

namespace bertshard::testing {
namespace {

void PutVarint(uint64_t v, std::string* out) {
  while (v >= 0x80) {
    out->push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}

// A length-delimited field: tag, length, bytes.
void PutBytesField(int field, const std::string& bytes, std::string* out) {
  PutVarint(static_cast<uint64_t>(field) << 3 | 2, out);
  PutVarint(bytes.size(), out);
  out->append(bytes);
}

// InferRequest{job_id, tokens{rows, seq, input_ids = 5..., attention_mask = 1..., token_type_ids =
// 0...}} as wire bytes: every id a valid one-byte varint, so the message is 3 bytes per token.
std::string HugeInferBytes(const std::string& job, int64_t rows, int64_t seq) {
  const size_t n = static_cast<size_t>(rows * seq);
  std::string tokens;
  PutVarint(1 << 3, &tokens);
  PutVarint(static_cast<uint64_t>(rows), &tokens);
  PutVarint(2 << 3, &tokens);
  PutVarint(static_cast<uint64_t>(seq), &tokens);
  PutBytesField(4, std::string(n, '\x05'), &tokens);
  PutBytesField(5, std::string(n, '\x01'), &tokens);
  PutBytesField(6, std::string(n, '\x00'), &tokens);
  std::string request;
  PutBytesField(1, job, &request);
  PutBytesField(2, tokens, &request);
  return request;
}

// A unary call of `method` with `bytes` as the serialised request; its status.
grpc::Status RawUnary(const std::shared_ptr<grpc::Channel>& channel, const std::string& method,
                      const std::string& bytes) {
  grpc::GenericStub stub(channel);
  grpc::Slice slice(bytes);
  grpc::ByteBuffer request(&slice, 1);
  grpc::ByteBuffer response;
  grpc::CompletionQueue cq;
  auto context = Context(120);
  auto call = stub.PrepareUnaryCall(context.get(), method, request, &cq);
  call->StartCall();
  grpc::Status status;
  call->Finish(&response, &status, reinterpret_cast<void*>(1));
  void* tag = nullptr;
  bool ok = false;
  cq.Next(&tag, &ok);
  return status;
}

TEST(RequestLimits, AHugeInferThroughALiveCoordinatorIsRefusedWithBoundedMemory) {
  LocalCluster cluster("request-limits", {});
  ASSERT_EQ(cluster.Start(1), "");
  std::string error;
  const std::string job = SubmitTp(cluster, std::filesystem::absolute(kModel).string(), 1, &error);
  ASSERT_EQ(error, "");
  ASSERT_EQ(cluster.WaitReady(job), "");

  // A full-size request (the largest --max_batch_tokens allows at this model's 16 positions) is
  // answered: the receive limit leaves room for every request the serving limits accept.
  v1::InferRequest full;
  full.set_job_id(job);
  v1::TokenInputs* tokens = full.mutable_tokens();
  tokens->set_rows(1024);
  tokens->set_seq(16);
  tokens->mutable_input_ids()->Resize(1024 * 16, 5);
  full.set_predictions_only(true);
  v1::InferResponse answer;
  const grpc::Status served = cluster.stub().Infer(Context(120).get(), full, &answer);
  EXPECT_TRUE(served.ok()) << served.error_message();

  // So is the service's own refusal of text over --max_request_text_bytes (32 MiB by default):
  // the message is received and refused by its text cap, not by gRPC's size.
  v1::InferRequest text;
  text.set_job_id(job);
  text.mutable_text()->add_texts(std::string((32 << 20) + 1, 'a'));
  const grpc::Status long_text = cluster.stub().Infer(Context(120).get(), text, &answer);
  EXPECT_EQ(long_text.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << long_text.error_message();
  EXPECT_NE(long_text.error_message().find("--max_request_text_bytes"), std::string::npos) << long_text.error_message();

  grpc::ChannelArguments args;
  args.SetMaxSendMessageSize(-1);
  auto channel =
      grpc::CreateCustomChannel("127.0.0.1:" + std::to_string(cluster.port_), grpc::InsecureChannelCredentials(), args);
  const pid_t coordinator = cluster.coordinator_;
  const int64_t idle = StatusBytes(coordinator, "VmRSS");
  // The 96 MB, and 480 MB: gRPC reads a message whole before it refuses it by its size, so
  // without the transport's memory quota the second one costs its own size again.
  const char* rows_env = std::getenv("BERTSHARD_HUGE_ROWS");
  for (const int64_t rows : std::vector<int64_t>{rows_env != nullptr ? std::atoll(rows_env) : 2'000'000, 10'000'000}) {
    SCOPED_TRACE(rows);
    const std::string bytes = HugeInferBytes(job, rows, 16);
    const int64_t before = StatusBytes(coordinator, "VmRSS");
    RssSampler sampler(coordinator);
    const absl::Time start = absl::Now();
    const grpc::Status refused = RawUnary(channel, "/bertshard.v1.Coordinator/Infer", bytes);
    const absl::Duration took = absl::Now() - start;
    const int64_t sampled = sampler.Stop();
    std::printf(
        "Infer of %lld x 16 ids (%.1f MB on the wire): code %d in %.2f s; coordinator RSS %.1f MiB before, sampled "
        "peak %.1f MiB (+%.1f), VmHWM %.1f MiB, %.1f MiB after\n  refusal: %s\n",
        static_cast<long long>(rows), static_cast<double>(bytes.size()) / 1e6, refused.error_code(),
        absl::ToDoubleSeconds(took), MiB(before), MiB(sampled), MiB(sampled - before),
        MiB(StatusBytes(coordinator, "VmHWM")), MiB(StatusBytes(coordinator, "VmRSS")),
        refused.error_message().c_str());
    std::fflush(stdout);
    // RESOURCE_EXHAUSTED: larger than --max_request_bytes once read, or reset by the quota.
    EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << refused.error_message();
    EXPECT_FALSE(refused.error_message().empty());
    // Parsed, the arrays alone were 768 MB (844 MiB of growth); read whole, the messages
    // are 96 and 480 MB (458 MiB). The quota is 4 x the 33.6 MiB request limit (134 MiB), but gRPC
    // enforces it softly: its reclaimer closes the connection some time after the quota is
    // reached, and what arrives meanwhile is read too (+90 to +170 MiB seen idle and under three CPU
    // burners, +202 MiB at 288 MB in a loaded CI run). The bound leaves room for that and is still
    // far under the whole message.
#if !defined(__SANITIZE_ADDRESS__)  // ASan's quarantine holds freed memory (the coordinator is an ASan build too)
    EXPECT_LT(sampled - before, 288 << 20) << "the coordinator's RSS grew by " << MiB(sampled - before) << " MiB";
#endif
  }
#if !defined(__SANITIZE_ADDRESS__)
  EXPECT_LT(StatusBytes(coordinator, "VmHWM") - idle, 320 << 20)
      << "the coordinator's VmHWM is " << MiB(StatusBytes(coordinator, "VmHWM") - idle) << " MiB over its RSS";
#endif

  // The coordinator goes on serving.
  const grpc::Status again = cluster.stub().Infer(Context(120).get(), full, &answer);
  EXPECT_TRUE(again.ok()) << again.error_message();
  EXPECT_EQ(cluster.TerminateCoordinator(), 0);
}

}  // namespace
}  // namespace bertshard::testing
