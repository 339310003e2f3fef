// embed_load: closed-loop load on one READY job through the coordinator, with persistent gRPC
// clients. Each client is a thread with its own channel (its own connection: a local subchannel
// pool), created and connected once, then reused for every request. Each request carries ONE
// sentence; client i cycles through the sentences starting at offset i and sends its next request
// as soon as the previous one is answered.
//
//   embed_load --server=127.0.0.1:50051 --job=JOB --sentences=sentences.txt --clients=16
//       --duration_s=10 [--rpc=embed|infer] [--predictions_only] [--texts_per_request=1] [--warmup=2] [--json]
//
// Prints requests/s, latency percentiles, and what the coordinator's dynamic batcher reported
// (BatchInfo: requests merged per forward, queue time, the bytes the workers sent back for each
// forward; for Infer also the forward time) and the client's own CPU time. A client stops at its first failed request,
// and any failure makes the exit status 1. With --json the last line is one JSON object (for scripts).
#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/barrier.h"
#include "absl/synchronization/mutex.h"
#include "bertshard/v1/coordinator.grpc.pb.h"
#include "grpcpp/grpcpp.h"

ABSL_FLAG(std::string, server, "", "coordinator host:port (default: $BERTSHARD_SERVER, else 127.0.0.1:50051)");
ABSL_FLAG(std::string, job, "", "the READY job to load (required)");
ABSL_FLAG(int, clients, 1, "concurrent clients (threads, one channel and connection each)");
ABSL_FLAG(double, duration_s, 10, "measured seconds (ignored when --requests_per_client is set)");
ABSL_FLAG(int, requests_per_client, 0, "measured requests per client instead of a duration (0: use --duration_s)");
ABSL_FLAG(int, warmup, 2, "unmeasured requests per client before the measured window");
ABSL_FLAG(std::string, sentences, "", "file with one sentence per line (required)");
ABSL_FLAG(std::string, rpc, "embed", "embed or infer");
ABSL_FLAG(bool, predictions_only, false, "Infer: ask for the predictions only (InferRequest.predictions_only)");
ABSL_FLAG(int, texts_per_request, 1, "sentences per request (consecutive ones, from the client's place in the file)");
ABSL_FLAG(double, timeout_s, 60, "deadline of each request, seconds");
ABSL_FLAG(bool, json, false, "also print one JSON line with the figures");

namespace v1 = bertshard::v1;
using Clock = std::chrono::steady_clock;

namespace {

// CPU seconds (user + system) this process has used so far, all threads.
double ProcessCpuSeconds() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  auto seconds = [](const timeval& t) { return static_cast<double>(t.tv_sec) + 1e-6 * static_cast<double>(t.tv_usec); };
  return seconds(usage.ru_utime) + seconds(usage.ru_stime);
}

struct Sample {
  double latency = 0;           // client-side, seconds
  int batch_requests = 0;       // BatchInfo.requests
  int64_t batch_rows = 0;       // BatchInfo.rows
  int64_t batch_tokens = 0;     // BatchInfo.padded_tokens
  double queue_seconds = 0;     // BatchInfo.queue_seconds
  double forward_seconds = -1;  // InferResponse.forward_seconds (Infer only)
  int64_t response_bytes = 0;   // BatchInfo.response_bytes: workers -> coordinator for the forward
};

struct ClientResult {
  std::vector<Sample> samples;
  int errors = 0;
  std::string first_error;
  Clock::time_point last_done;
};

struct Options {
  std::string server, job, rpc;
  int warmup = 0, requests_per_client = 0, texts_per_request = 1;
  bool predictions_only = false;
  double duration_s = 0, timeout_s = 60;
};

// One request on `stub` with o.texts_per_request sentences from `first` on (wrapping around);
// fills `sample` (but not its latency) or returns the error.
grpc::Status OneRequest(v1::Coordinator::Stub* stub, const Options& o, const std::vector<std::string>& sentences,
                        size_t first, Sample* sample) {
  v1::TextInput text;
  for (int i = 0; i < o.texts_per_request; ++i) text.add_texts(sentences[(first + i) % sentences.size()]);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::microseconds(static_cast<int64_t>(o.timeout_s * 1e6)));
  const v1::BatchInfo* batch = nullptr;
  grpc::Status status;
  v1::EmbedResponse embed_response;
  v1::InferResponse infer_response;
  if (o.rpc == "embed") {
    v1::EmbedRequest request;
    request.set_job_id(o.job);
    *request.mutable_text() = text;
    status = stub->Embed(&context, request, &embed_response);
    if (status.ok() &&
        (embed_response.embeddings_size() != o.texts_per_request || embed_response.embeddings(0).values_size() == 0)) {
      return grpc::Status(grpc::StatusCode::INTERNAL,
                          absl::StrCat("expected ", o.texts_per_request, " non-empty embeddings, got ",
                                       embed_response.embeddings_size()));
    }
    batch = &embed_response.batch();
  } else {
    v1::InferRequest request;
    request.set_job_id(o.job);
    *request.mutable_text() = text;
    request.set_predictions_only(o.predictions_only);
    status = stub->Infer(&context, request, &infer_response);
    if (status.ok() && !o.predictions_only && infer_response.outputs_size() == 0) {
      return grpc::Status(grpc::StatusCode::INTERNAL, "Infer answered without outputs");
    }
    batch = &infer_response.batch();
    sample->forward_seconds = infer_response.forward_seconds();
  }
  if (!status.ok()) return status;
  sample->batch_requests = batch->requests();
  sample->batch_rows = batch->rows();
  sample->batch_tokens = batch->padded_tokens();
  sample->queue_seconds = batch->queue_seconds();
  sample->response_bytes = batch->response_bytes();
  return status;
}

std::string Describe(const grpc::Status& status) {
  return absl::StrCat("code ", static_cast<int>(status.error_code()), ": ", status.error_message());
}

// Nearest-rank percentile of sorted values.
double Percentile(const std::vector<double>& sorted, double p) {
  if (sorted.empty()) return 0;
  const size_t rank = static_cast<size_t>(std::ceil(p / 100.0 * static_cast<double>(sorted.size())));
  return sorted[std::min(sorted.size() - 1, rank == 0 ? 0 : rank - 1)];
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "closed-loop load on a job: embed_load --job=JOB --sentences=FILE [--clients=N] [--duration_s=S] "
      "[--rpc=embed|infer]");
  absl::ParseCommandLine(argc, argv);
  Options o;
  o.server = absl::GetFlag(FLAGS_server);
  if (o.server.empty()) {
    const char* env = std::getenv("BERTSHARD_SERVER");
    o.server = env != nullptr ? env : "127.0.0.1:50051";
  }
  o.job = absl::GetFlag(FLAGS_job);
  o.rpc = absl::GetFlag(FLAGS_rpc);
  o.warmup = std::max(0, absl::GetFlag(FLAGS_warmup));
  o.texts_per_request = absl::GetFlag(FLAGS_texts_per_request);
  o.predictions_only = absl::GetFlag(FLAGS_predictions_only);
  o.requests_per_client = absl::GetFlag(FLAGS_requests_per_client);
  o.duration_s = absl::GetFlag(FLAGS_duration_s);
  o.timeout_s = absl::GetFlag(FLAGS_timeout_s);
  const int clients = absl::GetFlag(FLAGS_clients);
  if (o.job.empty() || absl::GetFlag(FLAGS_sentences).empty()) {
    std::fprintf(stderr, "embed_load: --job and --sentences are required\n");
    return 2;
  }
  if (o.rpc != "embed" && o.rpc != "infer") {
    std::fprintf(stderr, "embed_load: --rpc must be embed or infer, got '%s'\n", o.rpc.c_str());
    return 2;
  }
  if (o.texts_per_request < 1) {
    std::fprintf(stderr, "embed_load: --texts_per_request must be >= 1, got %d\n", o.texts_per_request);
    return 2;
  }
  if (clients < 1 || o.requests_per_client < 0 || (o.requests_per_client == 0 && !(o.duration_s > 0))) {
    std::fprintf(stderr, "embed_load: need --clients >= 1 and --duration_s > 0 or --requests_per_client > 0\n");
    return 2;
  }
  std::vector<std::string> sentences;
  {
    std::ifstream in(absl::GetFlag(FLAGS_sentences));
    if (!in) {
      std::fprintf(stderr, "embed_load: cannot read %s\n", absl::GetFlag(FLAGS_sentences).c_str());
      return 2;
    }
    for (std::string line; std::getline(in, line);) {
      std::string s(absl::StripAsciiWhitespace(line));
      if (!s.empty()) sentences.push_back(std::move(s));
    }
  }
  if (sentences.empty()) {
    std::fprintf(stderr, "embed_load: no sentences in %s\n", absl::GetFlag(FLAGS_sentences).c_str());
    return 2;
  }

  // Every client connects (and warms up) before the measured window opens for all at once.
  absl::Barrier* ready = new absl::Barrier(clients + 1);
  absl::Barrier* go = new absl::Barrier(clients + 1);
  Clock::time_point start, stop;
  std::vector<ClientResult> results(static_cast<size_t>(clients));
  std::atomic<int> setup_failures{0};
  std::vector<std::thread> threads;
  for (int c = 0; c < clients; ++c) {
    threads.emplace_back([&, c] {
      ClientResult& result = results[static_cast<size_t>(c)];
      grpc::ChannelArguments args;
      args.SetMaxReceiveMessageSize(1 << 30);
      // A channel of its own, not a subchannel shared with the other clients' channels: one
      // connection per client, as separate client processes would have.
      args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
      args.SetInt("bertshard.embed_load.client", c);
      auto channel = grpc::CreateCustomChannel(o.server, grpc::InsecureChannelCredentials(), args);
      auto stub = v1::Coordinator::NewStub(channel);
      size_t next = static_cast<size_t>(c) % sentences.size();
      bool ok = channel->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(10));
      if (!ok) {
        result.first_error = absl::StrCat("cannot connect to ", o.server);
        ++result.errors;
      }
      for (int i = 0; ok && i < o.warmup; ++i) {
        Sample sample;
        const grpc::Status status = OneRequest(stub.get(), o, sentences, next, &sample);
        next = (next + 1) % sentences.size();
        if (!status.ok()) {
          result.first_error = absl::StrCat("warm-up: ", Describe(status));
          ++result.errors;
          ok = false;
        }
      }
      if (!ok) setup_failures.fetch_add(1);
      ready->Block();
      go->Block();
      if (setup_failures.load() > 0) return;
      const Clock::time_point end = start + std::chrono::microseconds(static_cast<int64_t>(o.duration_s * 1e6));
      for (int i = 0;; ++i) {
        if (o.requests_per_client > 0 ? i >= o.requests_per_client : Clock::now() >= end) break;
        Sample sample;
        const Clock::time_point t0 = Clock::now();
        const grpc::Status status = OneRequest(stub.get(), o, sentences, next, &sample);
        const Clock::time_point t1 = Clock::now();
        next = (next + 1) % sentences.size();
        if (!status.ok()) {
          // The figures are void now; stop this client rather than spin on a failing job.
          ++result.errors;
          result.first_error = Describe(status);
          break;
        }
        sample.latency = std::chrono::duration<double>(t1 - t0).count();
        result.samples.push_back(sample);
        result.last_done = t1;
      }
    });
  }
  ready->Block();
  const double cpu_start = ProcessCpuSeconds();
  start = Clock::now();
  go->Block();
  for (auto& t : threads) t.join();
  stop = Clock::now();
  const double client_cpu = ProcessCpuSeconds() - cpu_start;

  int errors = 0;
  std::string first_error;
  std::vector<Sample> all;
  for (const ClientResult& r : results) {
    errors += r.errors;
    if (first_error.empty()) first_error = r.first_error;
    all.insert(all.end(), r.samples.begin(), r.samples.end());
  }
  const double wall = std::chrono::duration<double>(stop - start).count();
  std::vector<double> latencies;
  for (const Sample& s : all) latencies.push_back(s.latency);
  std::sort(latencies.begin(), latencies.end());
  const double n = static_cast<double>(all.size());
  auto mean_of = [&](auto field) {
    double sum = 0;
    for (const Sample& s : all) sum += field(s);
    return all.empty() ? 0.0 : sum / n;
  };
  const double rps = wall > 0 ? n / wall : 0;
  const double mean = mean_of([](const Sample& s) { return s.latency; });
  // Request-weighted: the batch size an average request found itself in.
  const double mean_batch = mean_of([](const Sample& s) { return static_cast<double>(s.batch_requests); });
  // Forwards the requests ran in (each forward of k requests is counted 1/k by each of them).
  double forwards = 0;
  for (const Sample& s : all) forwards += s.batch_requests > 0 ? 1.0 / s.batch_requests : 0.0;
  const double requests_per_forward = forwards > 0 ? n / forwards : 0;
  // Per forward (each forward counted once): its rows, its padded tokens (rows x padded length)
  // and the bytes its ranks sent back to the coordinator.
  double rows_sum = 0, tokens_sum = 0, bytes_sum = 0;
  for (const Sample& s : all) {
    if (s.batch_requests <= 0) continue;
    rows_sum += static_cast<double>(s.batch_rows) / s.batch_requests;
    tokens_sum += static_cast<double>(s.batch_tokens) / s.batch_requests;
    bytes_sum += static_cast<double>(s.response_bytes) / s.batch_requests;
  }
  const double bytes_per_forward = forwards > 0 ? bytes_sum / forwards : 0;
  const double bytes_per_request = n > 0 ? bytes_sum / n : 0;
  double forward_time_sum = 0;  // Infer: seconds the job spent in forwards (each counted once)
  for (const Sample& s : all) {
    if (s.batch_requests > 0 && s.forward_seconds > 0) forward_time_sum += s.forward_seconds / s.batch_requests;
  }
  const double rows_per_forward = forwards > 0 ? rows_sum / forwards : 0;
  const double tokens_per_forward = forwards > 0 ? tokens_sum / forwards : 0;
  const double mean_queue = mean_of([](const Sample& s) { return s.queue_seconds; });
  const bool has_forward = o.rpc == "infer";
  const double mean_forward = has_forward ? mean_of([](const Sample& s) { return s.forward_seconds; }) : -1;
  const double p50 = Percentile(latencies, 50), p90 = Percentile(latencies, 90), p99 = Percentile(latencies, 99);
  // Infer: medians of the ranks' forward time and of what the rest of the path added to each request.
  std::vector<double> forwards_sorted, overheads;
  for (const Sample& s : all) {
    forwards_sorted.push_back(s.forward_seconds);
    overheads.push_back(s.latency - s.queue_seconds - s.forward_seconds);
  }
  std::sort(forwards_sorted.begin(), forwards_sorted.end());
  std::sort(overheads.begin(), overheads.end());
  const double p50_forward = has_forward ? Percentile(forwards_sorted, 50) : -1;
  const double p50_overhead = has_forward ? Percentile(overheads, 50) : -1;
  const double lmin = latencies.empty() ? 0 : latencies.front(), lmax = latencies.empty() ? 0 : latencies.back();

  std::printf("%s on job %s at %s: %d client%s, %zu requests in %.2f s, %d error%s\n", o.rpc.c_str(), o.job.c_str(),
              o.server.c_str(), clients, clients == 1 ? "" : "s", all.size(), wall, errors, errors == 1 ? "" : "s");
  std::printf("  throughput      %8.2f requests/s\n", rps);
  std::printf("  latency ms      p50 %.2f  p90 %.2f  p99 %.2f  mean %.2f  min %.2f  max %.2f\n", 1e3 * p50, 1e3 * p90,
              1e3 * p99, 1e3 * mean, 1e3 * lmin, 1e3 * lmax);
  std::printf(
      "  batching        mean BatchInfo.requests %.2f (per request), %.2f requests per forward, %.1f forwards/s\n",
      mean_batch, requests_per_forward, wall > 0 ? forwards / wall : 0.0);
  std::printf("                  per forward: %.2f rows, %.1f padded tokens\n", rows_per_forward, tokens_per_forward);
  std::printf(
      "  network         workers -> coordinator: %.0f bytes per forward, %.0f per request (BatchInfo.response_bytes)\n",
      bytes_per_forward, bytes_per_request);
  std::printf("  in coordinator  mean queue %.2f ms", 1e3 * mean_queue);
  if (has_forward) {
    std::printf(", mean forward %.2f ms (ranks), rest %.2f ms (client latency - queue - forward)", 1e3 * mean_forward,
                1e3 * (mean - mean_queue - mean_forward));
    std::printf("\n                  median forward %.2f ms, median rest %.2f ms", 1e3 * p50_forward,
                1e3 * p50_overhead);
    std::printf("\n                  per forward %.2f ms; the ranks were in a forward %.0f%% of the time",
                forwards > 0 ? 1e3 * forward_time_sum / forwards : 0.0, wall > 0 ? 100 * forward_time_sum / wall : 0.0);
  }
  std::printf("\n");
  std::printf("  client CPU      %.2f ms per request (this process, all clients)\n",
              all.empty() ? 0.0 : 1e3 * client_cpu / n);
  if (errors > 0) std::printf("  first error: %s\n", first_error.c_str());
  if (absl::GetFlag(FLAGS_json)) {
    // -1: not known for this rpc (Embed reports no forward time).
    const double forward_ms = has_forward ? 1e3 * mean_forward : -1.0;
    const double p50_forward_ms = has_forward ? 1e3 * p50_forward : -1.0;
    const double p50_rest_ms = has_forward ? 1e3 * p50_overhead : -1.0;
    const double per_forward_ms = has_forward && forwards > 0 ? 1e3 * forward_time_sum / forwards : -1.0;
    const double busy = has_forward && wall > 0 ? forward_time_sum / wall : -1.0;
    std::printf(
        "{\"rpc\": \"%s\", \"clients\": %d, \"requests\": %zu, \"errors\": %d, \"seconds\": %.6f, "
        "\"requests_per_second\": %.6f, \"p50_ms\": %.4f, \"p90_ms\": %.4f, \"p99_ms\": %.4f, \"mean_ms\": %.4f, "
        "\"min_ms\": %.4f, \"max_ms\": %.4f, \"mean_batch_requests\": %.4f, \"requests_per_forward\": %.4f, "
        "\"rows_per_forward\": %.4f, \"tokens_per_forward\": %.4f, \"mean_queue_ms\": %.4f, "
        "\"mean_forward_ms\": %.4f, \"p50_forward_ms\": %.4f, \"p50_rest_ms\": %.4f, "
        "\"forward_ms_per_forward\": %.4f, \"forward_busy\": %.4f, \"client_cpu_s\": %.4f, "
        "\"texts_per_request\": %d, \"response_bytes_per_forward\": %.1f, \"response_bytes_per_request\": %.1f}\n",
        o.rpc.c_str(), clients, all.size(), errors, wall, rps, 1e3 * p50, 1e3 * p90, 1e3 * p99, 1e3 * mean, 1e3 * lmin,
        1e3 * lmax, mean_batch, requests_per_forward, rows_per_forward, tokens_per_forward, 1e3 * mean_queue,
        forward_ms, p50_forward_ms, p50_rest_ms, per_forward_ms, busy, client_cpu, o.texts_per_request,
        bytes_per_forward, bytes_per_request);
  }
  std::fflush(stdout);
  delete ready;
  delete go;
  return errors > 0 || all.empty() ? 1 : 0;
}
