// http_load: closed-loop load on one of the coordinator's HTTP routes (TEI's /embed, OpenAI's
// /v1/embeddings, KServe's /v2/models/NAME/infer), the HTTP counterpart of embed_load. Each client
// is a thread with one keep-alive HTTP/1.1 connection, opened once and reused; each request carries
// ONE sentence, put into --body where it says {SENTENCE} (JSON-escaped); client i cycles through
// the sentences from offset i and sends its next request as soon as the previous one is answered.
// Plain sockets, no HTTP library: the client's own cost stays small and constant, so the figures
// are the server's.
//
//   http_load --address=127.0.0.1:8080 --path=/embed --body='{"inputs": {SENTENCE}}'
//       --sentences=sentences.txt --clients=16 --duration_s=10 [--token_file=F] [--warmup=2] [--json]
//
// Prints requests/s and latency percentiles; any answer other than 200 is an error (the first is
// printed) and makes the exit status 1. With --json the last line is one JSON object.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <fstream>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/proto_json.h"

ABSL_FLAG(std::string, address, "127.0.0.1:8080", "the coordinator's --http_listen address (IPv4)");
ABSL_FLAG(std::string, path, "/embed", "the route");
ABSL_FLAG(std::string, body, R"({"inputs": {SENTENCE}})", "the JSON body; {SENTENCE} is the sentence as a JSON string");
ABSL_FLAG(std::string, sentences, "", "one sentence per line");
ABSL_FLAG(std::string, token_file, "", "a bearer token to send (Authorization: Bearer)");
ABSL_FLAG(int, clients, 1, "concurrent closed-loop clients");
ABSL_FLAG(double, duration_s, 10, "measured seconds");
ABSL_FLAG(double, warmup, 2, "seconds of requests before measuring");
ABSL_FLAG(bool, json, false, "also print one JSON line with the figures");

namespace {

// One keep-alive connection.
class Connection {
 public:
  ~Connection() {
    if (fd_ >= 0) close(fd_);
  }
  bool Open(const std::string& host, int port, std::string* error) {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port));
    if (fd_ < 0 || inet_pton(AF_INET, host.c_str(), &addr.sin_addr) != 1 ||
        connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
      *error = absl::StrCat("cannot connect to ", host, ":", port);
      return false;
    }
    const int one = 1;
    setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    return true;
  }
  // Sends `request` and reads one response; its status, or -1 with `error` set.
  int RoundTrip(const std::string& request, std::string* error) {
    for (size_t sent = 0; sent < request.size();) {
      const ssize_t n = send(fd_, request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
      if (n <= 0) {
        *error = "send failed";
        return -1;
      }
      sent += static_cast<size_t>(n);
    }
    size_t header_end;
    while ((header_end = buffer_.find("\r\n\r\n")) == std::string::npos) {
      if (!Fill(error)) return -1;
    }
    const std::string head = absl::AsciiStrToLower(buffer_.substr(0, header_end));
    int status = -1;
    if (head.size() < 12 || !absl::SimpleAtoi(head.substr(9, 3), &status)) {
      *error = "malformed status line";
      return -1;
    }
    size_t length = 0;
    const size_t at = head.find("\r\ncontent-length:");
    if (at == std::string::npos ||
        !absl::SimpleAtoi(absl::StripAsciiWhitespace(head.substr(at + 17, head.find("\r\n", at + 2) - at - 17)),
                          &length)) {
      *error = "no Content-Length";
      return -1;
    }
    while (buffer_.size() < header_end + 4 + length) {
      if (!Fill(error)) return -1;
    }
    if (status != 200)
      *error = absl::StrCat(status, ": ", buffer_.substr(header_end + 4, std::min<size_t>(length, 300)));
    buffer_.erase(0, header_end + 4 + length);
    return status;
  }

 private:
  bool Fill(std::string* error) {
    char chunk[65536];
    const ssize_t n = recv(fd_, chunk, sizeof(chunk), 0);
    if (n <= 0) {
      *error = "the server closed the connection";
      return false;
    }
    buffer_.append(chunk, static_cast<size_t>(n));
    return true;
  }
  int fd_ = -1;
  std::string buffer_;
};

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const std::string address = absl::GetFlag(FLAGS_address);
  const std::vector<std::string> host_port = absl::StrSplit(address, ':');
  int port = 0;
  if (host_port.size() != 2 || !absl::SimpleAtoi(host_port[1], &port)) {
    std::fprintf(stderr, "http_load: --address must be IPV4:PORT, got '%s'\n", address.c_str());
    return 2;
  }
  std::vector<std::string> sentences;
  {
    std::ifstream in(absl::GetFlag(FLAGS_sentences));
    for (std::string line; std::getline(in, line);) {
      if (!line.empty()) sentences.push_back(line);
    }
  }
  const int clients = absl::GetFlag(FLAGS_clients);
  if (sentences.empty() || clients < 1) {
    std::fprintf(stderr, "http_load: need --sentences with at least one line and --clients >= 1\n");
    return 2;
  }
  std::string auth;
  if (const std::string file = absl::GetFlag(FLAGS_token_file); !file.empty()) {
    std::ifstream in(file);
    std::string token;
    std::getline(in, token);
    auth = absl::StrCat("Authorization: Bearer ", absl::StripAsciiWhitespace(token), "\r\n");
  }
  std::vector<std::string> requests;
  for (const std::string& s : sentences) {
    std::string sentence;
    bertshard::common::AppendJsonString(s, &sentence);
    const std::string body = absl::StrReplaceAll(absl::GetFlag(FLAGS_body), {{"{SENTENCE}", sentence}});
    requests.push_back(absl::StrCat("POST ", absl::GetFlag(FLAGS_path), " HTTP/1.1\r\nHost: ", address,
                                    "\r\nContent-Type: application/json\r\n", auth, "Content-Length: ", body.size(),
                                    "\r\n\r\n", body));
  }
  const absl::Time start = absl::Now() + absl::Seconds(absl::GetFlag(FLAGS_warmup));
  const absl::Time end = start + absl::Seconds(absl::GetFlag(FLAGS_duration_s));
  std::mutex mu;
  std::vector<double> latencies;
  std::atomic<int> errors{0};
  std::string first_error;
  std::vector<std::thread> threads;
  for (int c = 0; c < clients; ++c) {
    threads.emplace_back([&, c] {
      Connection connection;
      std::string error;
      std::vector<double> mine;
      if (!connection.Open(host_port[0], port, &error)) {
        ++errors;
      } else {
        for (size_t i = static_cast<size_t>(c);; ++i) {
          const absl::Time sent = absl::Now();
          if (sent >= end) break;
          const int status = connection.RoundTrip(requests[i % requests.size()], &error);
          const absl::Time answered = absl::Now();
          if (status != 200) {
            ++errors;
            break;  // a client stops at its first failure, as embed_load's do
          }
          if (sent >= start && answered <= end) mine.push_back(absl::ToDoubleSeconds(answered - sent));
        }
      }
      std::lock_guard<std::mutex> lock(mu);
      latencies.insert(latencies.end(), mine.begin(), mine.end());
      if (!error.empty() && first_error.empty()) first_error = error;
    });
  }
  for (std::thread& t : threads) t.join();
  std::sort(latencies.begin(), latencies.end());
  const double seconds = absl::GetFlag(FLAGS_duration_s);
  const double rps = static_cast<double>(latencies.size()) / seconds;
  auto pct = [&](double p) {
    return latencies.empty()
               ? 0.0
               : 1e3 * latencies[std::min(latencies.size() - 1, static_cast<size_t>(p * latencies.size()))];
  };
  std::printf("%s at %s: %d client%s, %zu requests in %.2f s, %d error%s\n", absl::GetFlag(FLAGS_path).c_str(),
              address.c_str(), clients, clients == 1 ? "" : "s", latencies.size(), seconds, errors.load(),
              errors.load() == 1 ? "" : "s");
  std::printf("  throughput      %8.2f requests/s\n", rps);
  std::printf("  latency ms      p50 %.2f  p90 %.2f  p99 %.2f\n", pct(0.5), pct(0.9), pct(0.99));
  if (errors.load() > 0) std::printf("  first error: %s\n", first_error.c_str());
  if (absl::GetFlag(FLAGS_json)) {
    std::printf(
        "{\"path\": \"%s\", \"clients\": %d, \"requests\": %zu, \"errors\": %d, \"requests_per_second\": %.6f, "
        "\"p50_ms\": %.4f, \"p90_ms\": %.4f, \"p99_ms\": %.4f}\n",
        absl::GetFlag(FLAGS_path).c_str(), clients, latencies.size(), errors.load(), rps, pct(0.5), pct(0.9),
        pct(0.99));
  }
  return errors.load() > 0 ? 1 : 0;
}
