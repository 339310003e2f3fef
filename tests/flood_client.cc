// flood_client: a client process that sends many full-size Infers at once and then reads the
// answers, for tests that stop it (SIGSTOP: it stops reading) or kill it while its calls are open
// (tests/stalled_client_test.cc, issue 21 item 6).
//
//   flood_client --server=127.0.0.1:50051 --job=JOB --requests=64 --connections=2 --rows=1024 --seq=16
//
// Every request asks for all outputs (the hidden states). The calls go out on --connections
// separate connections, round robin, with no deadline unless --deadline_s is given. Prints "sent N"
// once every call has started and "answered N" at the first answer (the test's cue to stop it),
// then one line per status code at the end. Exits 0 once every call has ended, 2 on bad flags.
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "bertshard/v1/coordinator.grpc.pb.h"
#include "grpcpp/grpcpp.h"

ABSL_FLAG(std::string, server, "", "the coordinator, host:port");
ABSL_FLAG(std::string, job, "", "the READY job to send to");
ABSL_FLAG(int, requests, 64, "Infer calls to send");
ABSL_FLAG(int, connections, 1, "separate connections the calls go out on");
ABSL_FLAG(int, rows, 1024, "rows of each request");
ABSL_FLAG(int, seq, 16, "tokens per row");
ABSL_FLAG(int, deadline_s, 0, "each call's deadline, seconds (0: none)");

namespace {

struct Call {
  grpc::ClientContext context;
  bertshard::v1::InferResponse response;
  grpc::Status status;
  std::unique_ptr<grpc::ClientAsyncResponseReader<bertshard::v1::InferResponse>> reader;
};

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const int requests = absl::GetFlag(FLAGS_requests), connections = absl::GetFlag(FLAGS_connections);
  const int rows = absl::GetFlag(FLAGS_rows), seq = absl::GetFlag(FLAGS_seq);
  if (absl::GetFlag(FLAGS_server).empty() || absl::GetFlag(FLAGS_job).empty() || requests < 1 || connections < 1 ||
      rows < 1 || seq < 1) {
    std::fprintf(stderr, "flood_client: --server and --job are needed, and the counts must be >= 1\n");
    return 2;
  }
  std::vector<std::unique_ptr<bertshard::v1::Coordinator::Stub>> stubs;
  for (int i = 0; i < connections; ++i) {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(-1);
    // Channels with equal arguments share one connection: this one differs per channel.
    args.SetInt("bertshard.flood_connection", i);
    stubs.push_back(bertshard::v1::Coordinator::NewStub(
        grpc::CreateCustomChannel(absl::GetFlag(FLAGS_server), grpc::InsecureChannelCredentials(), args)));
  }
  bertshard::v1::InferRequest request;
  request.set_job_id(absl::GetFlag(FLAGS_job));
  bertshard::v1::TokenInputs* tokens = request.mutable_tokens();
  tokens->set_rows(rows);
  tokens->set_seq(seq);
  for (int i = 0; i < rows * seq; ++i) tokens->add_input_ids(5 + i % 90);
  grpc::CompletionQueue cq;
  std::vector<std::unique_ptr<Call>> calls;
  for (int i = 0; i < requests; ++i) {
    auto call = std::make_unique<Call>();
    if (absl::GetFlag(FLAGS_deadline_s) > 0) {
      call->context.set_deadline(std::chrono::system_clock::now() +
                                 std::chrono::seconds(absl::GetFlag(FLAGS_deadline_s)));
    }
    call->reader = stubs[static_cast<size_t>(i % connections)]->AsyncInfer(&call->context, request, &cq);
    call->reader->Finish(&call->response, &call->status, call.get());
    calls.push_back(std::move(call));
  }
  std::printf("sent %d\n", requests);
  std::fflush(stdout);
  std::map<std::string, int> codes;
  int done = 0;
  void* tag = nullptr;
  bool ok = false;
  while (done < requests && cq.Next(&tag, &ok)) {
    const Call* call = static_cast<const Call*>(tag);
    ++done;
    if (call->status.ok()) {
      if (codes["OK"]++ == 0) {
        std::printf("answered %d\n", done);
        std::fflush(stdout);
      }
    } else {
      ++codes[std::to_string(call->status.error_code()) + " " + call->status.error_message()];
    }
  }
  for (const auto& [code, n] : codes) std::printf("%d x %s\n", n, code.c_str());
  return 0;
}
