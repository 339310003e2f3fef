#include "common/metrics.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <future>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/grpc_serving.h"
#include "common/metrics_endpoint.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpc/reflection/v1alpha/reflection.grpc.pb.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"

namespace bertshard::common {
namespace {

TEST(MetricsRegistry, RendersEachTypeInTextFormat) {
  MetricsRegistry registry;
  auto requests = registry.AddCounter("app_requests_total", "Requests served.", {"method"});
  ASSERT_TRUE(requests.ok()) << requests.status();
  auto depth = registry.AddGauge("app_queue_depth", "Requests waiting.", {});
  ASSERT_TRUE(depth.ok()) << depth.status();
  auto seconds = registry.AddHistogram("app_seconds", "Latency.", {"method"}, {0.1, 1});
  ASSERT_TRUE(seconds.ok()) << seconds.status();

  (*(*requests)->WithLabels({"Plan"}))->Increment();
  (*(*requests)->WithLabels({"Plan"}))->Increment(2);
  (*(*requests)->WithLabels({"Infer"}))->Increment();
  (*(*depth)->WithLabels({}))->Set(4);
  Histogram* plan = *(*seconds)->WithLabels({"Plan"});
  plan->Observe(0.05);  // <= 0.1
  plan->Observe(0.1);   // le is inclusive: still the 0.1 bucket
  plan->Observe(0.5);   // <= 1
  plan->Observe(7);     // +Inf only

  // Families sorted by name, children by label values; buckets cumulative; 0.05+0.1+0.5+7 = 7.65.
  EXPECT_EQ(registry.Render(),
            "# HELP app_queue_depth Requests waiting.\n"
            "# TYPE app_queue_depth gauge\n"
            "app_queue_depth 4\n"
            "# HELP app_requests_total Requests served.\n"
            "# TYPE app_requests_total counter\n"
            "app_requests_total{method=\"Infer\"} 1\n"
            "app_requests_total{method=\"Plan\"} 3\n"
            "# HELP app_seconds Latency.\n"
            "# TYPE app_seconds histogram\n"
            "app_seconds_bucket{method=\"Plan\",le=\"0.1\"} 2\n"
            "app_seconds_bucket{method=\"Plan\",le=\"1\"} 3\n"
            "app_seconds_bucket{method=\"Plan\",le=\"+Inf\"} 4\n"
            "app_seconds_sum{method=\"Plan\"} 7.65\n"
            "app_seconds_count{method=\"Plan\"} 4\n");
}

TEST(MetricsRegistry, UnlabelledFamiliesShowZeroBeforeFirstUse) {
  MetricsRegistry registry;
  ASSERT_TRUE(registry.AddCounter("a_total", "A.", {}).ok());
  ASSERT_TRUE(registry.AddHistogram("b_seconds", "B.", {}, {1}).ok());
  EXPECT_EQ(registry.Render(),
            "# HELP a_total A.\n# TYPE a_total counter\na_total 0\n"
            "# HELP b_seconds B.\n# TYPE b_seconds histogram\n"
            "b_seconds_bucket{le=\"1\"} 0\nb_seconds_bucket{le=\"+Inf\"} 0\nb_seconds_sum 0\nb_seconds_count 0\n");
}

TEST(MetricsRegistry, EscapesLabelValuesAndHelp) {
  MetricsRegistry registry;
  auto family = registry.AddGauge("g", "Help with \\ and\nnewline.", {"path"});
  ASSERT_TRUE(family.ok());
  (*(*family)->WithLabels({"C:\\dir \"quoted\"\nnext"}))->Set(1);
  // Text format 0.0.4: label values escape \, " and newline; HELP escapes \ and newline.
  EXPECT_EQ(registry.Render(),
            "# HELP g Help with \\\\ and\\nnewline.\n"
            "# TYPE g gauge\n"
            "g{path=\"C:\\\\dir \\\"quoted\\\"\\nnext\"} 1\n");
}

TEST(MetricsRegistry, FormatsSpecialValues) {
  using metrics_internal::FormatValue;
  EXPECT_EQ(FormatValue(0), "0");
  EXPECT_EQ(FormatValue(3), "3");
  EXPECT_EQ(FormatValue(0.1), "0.1");
  EXPECT_EQ(FormatValue(-2.5), "-2.5");
  EXPECT_EQ(FormatValue(1e21), "1e+21");
  EXPECT_EQ(FormatValue(std::numeric_limits<double>::infinity()), "+Inf");
  EXPECT_EQ(FormatValue(-std::numeric_limits<double>::infinity()), "-Inf");
  EXPECT_EQ(FormatValue(std::nan("")), "NaN");
}

TEST(MetricsRegistry, CounterIgnoresNegativeAndNaN) {
  Counter counter;
  counter.Increment(2);
  counter.Increment(-1);
  counter.Increment(std::nan(""));
  EXPECT_EQ(counter.Value(), 2);
}

TEST(MetricsRegistry, RejectsBadNames) {
  MetricsRegistry registry;
  struct Case {
    const char* name;
    std::vector<std::string> labels;
    std::vector<double> bounds;
    bool counter;
  };
  const Case cases[] = {
      {"requests", {}, {}, true},                                      // counter without _total
      {"1abc_total", {}, {}, true},                                    // starts with a digit
      {"a-b_total", {}, {}, true},                                     // dash
      {"", {}, {}, false},                                             // empty
      {"g", {"bad-label"}, {}, false},                                 // label with a dash
      {"g", {"__reserved"}, {}, false},                                // reserved label prefix
      {"g", {"a", "a"}, {}, false},                                    // repeated label
      {"h", {"le"}, {1}, false},                                       // le on a histogram
      {"h", {}, {1, 1}, false},                                        // bounds not increasing
      {"h", {}, {1, std::numeric_limits<double>::infinity()}, false},  // +Inf is implicit
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    absl::Status status;
    if (c.counter) {
      status = registry.AddCounter(c.name, "x", c.labels).status();
    } else if (c.name[0] == 'h') {
      status = registry.AddHistogram(c.name, "x", c.labels, c.bounds).status();
    } else {
      status = registry.AddGauge(c.name, "x", c.labels).status();
    }
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  }
  EXPECT_EQ(registry.Render(), "");
}

TEST(MetricsRegistry, SameFamilyTwiceIsSharedDifferentIsRefused) {
  MetricsRegistry registry;
  auto first = registry.AddCounter("c_total", "C.", {"a"});
  auto again = registry.AddCounter("c_total", "C.", {"a"});
  ASSERT_TRUE(first.ok() && again.ok());
  EXPECT_EQ(*first, *again);
  EXPECT_EQ(registry.AddCounter("c_total", "C.", {"b"}).status().code(), absl::StatusCode::kAlreadyExists);
  ASSERT_TRUE(registry.AddHistogram("h", "H.", {}, {1, 2}).ok());
  EXPECT_EQ(registry.AddHistogram("h", "H.", {}, {1, 3}).status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(registry.AddGauge("h", "H.", {}).status().code(), absl::StatusCode::kAlreadyExists);
}

TEST(MetricsRegistry, WrongNumberOfLabelValuesIsInternal) {
  MetricsRegistry registry;
  auto family = registry.AddCounter("c_total", "C.", {"a", "b"});
  ASSERT_TRUE(family.ok());
  EXPECT_EQ((*family)->WithLabels({"x"}).status().code(), absl::StatusCode::kInternal);
  EXPECT_EQ((*family)->WithLabels({"x", "y", "z"}).status().code(), absl::StatusCode::kInternal);
}

TEST(MetricsRegistry, ConcurrentRecordingLosesNothing) {
  MetricsRegistry registry;
  auto counters = registry.AddCounter("c_total", "C.", {"thread"});
  auto histograms = registry.AddHistogram("h", "H.", {}, {0.5});
  ASSERT_TRUE(counters.ok() && histograms.ok());
  constexpr int kThreads = 4;
  constexpr int kEach = 10000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kEach; ++i) {
        (*(*counters)->WithLabels({std::to_string(t % 2)}))->Increment();
        (*(*histograms)->WithLabels({}))->Observe(1);
      }
    });
  }
  // Render concurrently with the writers: it must not crash or tear a histogram.
  for (int i = 0; i < 20; ++i) registry.Render();
  for (auto& t : threads) t.join();
  EXPECT_EQ((*(*counters)->WithLabels({"0"}))->Value(), 2 * kEach);
  EXPECT_EQ((*(*counters)->WithLabels({"1"}))->Value(), 2 * kEach);
  const Histogram::Snapshot snapshot = (*(*histograms)->WithLabels({}))->Read();
  EXPECT_EQ(snapshot.count, kThreads * kEach);
  EXPECT_EQ(snapshot.cumulative, (std::vector<uint64_t>{0, kThreads * kEach}));
  EXPECT_EQ(snapshot.sum, kThreads * kEach);
}

TEST(MetricsRegistry, CollectorsRunAtRenderUntilTheirHandleGoes) {
  MetricsRegistry registry;
  int calls = 0;
  {
    auto handle = registry.AddCollector(MetricType::kGauge, "jobs", "Jobs by state.", {"state"},
                                        [&calls]() -> absl::StatusOr<std::vector<Sample>> {
                                          ++calls;
                                          return std::vector<Sample>{{{"READY"}, 2}, {{"FAILED"}, 0}};
                                        });
    ASSERT_TRUE(handle.ok()) << handle.status();
    EXPECT_EQ(registry.AddGauge("jobs", "x", {}).status().code(), absl::StatusCode::kAlreadyExists);
    EXPECT_EQ(registry.Render(),
              "# HELP jobs Jobs by state.\n# TYPE jobs gauge\njobs{state=\"FAILED\"} 0\njobs{state=\"READY\"} 2\n");
    EXPECT_EQ(calls, 1);
  }
  EXPECT_EQ(registry.Render(), "");
  EXPECT_EQ(calls, 1);
}

TEST(MetricsRegistry, FailingCollectorShowsWhyInAComment) {
  MetricsRegistry registry;
  auto failing = registry.AddCollector(MetricType::kGauge, "a", "A.", {}, []() -> absl::StatusOr<std::vector<Sample>> {
    return absl::UnavailableError("database\nlocked");
  });
  auto wrong_labels =
      registry.AddCollector(MetricType::kCounter, "b_total", "B.", {"x"}, []() -> absl::StatusOr<std::vector<Sample>> {
        return std::vector<Sample>{{{}, 1}};
      });
  ASSERT_TRUE(failing.ok() && wrong_labels.ok());
  EXPECT_EQ(registry.Render(),
            "# HELP a A.\n# TYPE a gauge\n# collecting a failed: UNAVAILABLE: database locked\n"
            "# HELP b_total B.\n# TYPE b_total counter\n"
            "# collecting b_total failed: INTERNAL: a sample has 0 label values for 1 labels\n");
  EXPECT_EQ(registry
                .AddCollector(MetricType::kHistogram, "h", "H.", {},
                              []() -> absl::StatusOr<std::vector<Sample>> { return std::vector<Sample>{}; })
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

// A job's series go when it ends: removed children leave the exposition, others stay.
TEST(MetricsRegistry, RemovedSeriesLeaveTheExposition) {
  MetricsRegistry registry;
  auto family = registry.AddCounter("loads_total", "Loads.", {"job"});
  ASSERT_TRUE(family.ok());
  (*(*family)->WithLabels({"a"}))->Increment();
  (*(*family)->WithLabels({"b"}))->Increment(2);
  EXPECT_EQ((*family)->size(), 2u);
  EXPECT_TRUE((*family)->Remove({"a"}));
  EXPECT_FALSE((*family)->Remove({"a"}));
  EXPECT_EQ((*family)->size(), 1u);
  EXPECT_EQ(registry.Render(), "# HELP loads_total Loads.\n# TYPE loads_total counter\nloads_total{job=\"b\"} 2\n");
  auto histogram = registry.AddHistogram("h", "H.", {"job"}, {1});
  ASSERT_TRUE(histogram.ok());
  (*(*histogram)->WithLabels({"x"}))->Observe(0.5);
  EXPECT_TRUE((*histogram)->Remove({"x"}));
  EXPECT_FALSE(absl::StrContains(registry.Render(), "job=\"x\""));
}

// A minimal HTTP/1.1 client: sends `request` to 127.0.0.1:port and returns the whole answer.
std::string HttpExchange(int port, const std::string& request) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string answer;
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
      write(fd, request.data(), request.size()) == static_cast<ssize_t>(request.size())) {
    char buffer[4096];
    ssize_t n;
    while ((n = read(fd, buffer, sizeof(buffer))) > 0) answer.append(buffer, n);
  }
  close(fd);
  return answer;
}

std::string Get(int port, const std::string& path, const std::string& method = "GET") {
  return HttpExchange(port, absl::StrCat(method, " ", path, " HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n",
                                         method == "POST" ? "Content-Length: 0\r\n" : "", "\r\n"));
}

TEST(MetricsEndpoint, ServesMetricsAndOnlyMetrics) {
  MetricsRegistry registry;
  auto counter = registry.AddCounter("scrapes_total", "Scrapes.", {});
  ASSERT_TRUE(counter.ok());
  (*(*counter)->WithLabels({}))->Increment(5);
  auto endpoint = MetricsEndpoint::Start("127.0.0.1:0", &registry);
  ASSERT_TRUE(endpoint.ok()) << endpoint.status();
  const int port = (*endpoint)->port();
  ASSERT_GT(port, 0);

  const std::string ok = Get(port, "/metrics");
  EXPECT_TRUE(absl::StartsWith(ok, "HTTP/1.1 200 OK\r\n")) << ok;
  EXPECT_TRUE(absl::StrContains(ok, "\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n")) << ok;
  EXPECT_TRUE(absl::EndsWith(ok, "\r\n\r\n" + registry.Render())) << ok;
  EXPECT_TRUE(absl::StrContains(ok, "scrapes_total 5\n")) << ok;
  EXPECT_TRUE(absl::StartsWith(Get(port, "/metrics?x=1"), "HTTP/1.1 200 OK\r\n"));

  EXPECT_TRUE(absl::StartsWith(Get(port, "/"), "HTTP/1.1 404 ")) << Get(port, "/");
  EXPECT_TRUE(absl::StartsWith(Get(port, "/metrics/x"), "HTTP/1.1 404 "));
  EXPECT_TRUE(absl::StartsWith(Get(port, "/etc/passwd"), "HTTP/1.1 404 "));
  const std::string post = Get(port, "/metrics", "POST");
  EXPECT_TRUE(absl::StartsWith(post, "HTTP/1.1 405 ")) << post;
  EXPECT_TRUE(absl::StrContains(post, "\r\nAllow: GET\r\n")) << post;
  EXPECT_TRUE(absl::StartsWith(Get(port, "/metrics", "DELETE"), "HTTP/1.1 405 "));

  endpoint->reset();
  EXPECT_EQ(Get(port, "/metrics"), "");  // stopped: nothing listens there any more
}

// Debian's civetweb asks for 100 KiB thread stacks, too small once LibTorch's static TLS is carved
// out of them (the worker could not start its endpoint): its threads get 1 MiB, nobody else's change.
TEST(MetricsEndpoint, ScrapesRunOnRoomyStacksOthersUnchanged) {
  MetricsRegistry registry;
  size_t scrape_stack = 0;
  auto handle = registry.AddCollector(MetricType::kGauge, "g", "G.", {},
                                      [&scrape_stack]() -> absl::StatusOr<std::vector<Sample>> {
                                        pthread_attr_t attr;
                                        pthread_getattr_np(pthread_self(), &attr);
                                        pthread_attr_getstacksize(&attr, &scrape_stack);
                                        pthread_attr_destroy(&attr);
                                        return std::vector<Sample>{};
                                      });
  ASSERT_TRUE(handle.ok());
  auto endpoint = MetricsEndpoint::Start("127.0.0.1:0", &registry);
  ASSERT_TRUE(endpoint.ok()) << endpoint.status();
  ASSERT_TRUE(absl::StartsWith(Get((*endpoint)->port(), "/metrics"), "HTTP/1.1 200 OK\r\n"));
  EXPECT_GE(scrape_stack, size_t{1} << 20);

  pthread_attr_t attr;
  pthread_attr_init(&attr);
  ASSERT_EQ(pthread_attr_setstacksize(&attr, 64 << 10), 0);
  size_t size = 0;
  pthread_attr_getstacksize(&attr, &size);
  EXPECT_EQ(size, size_t{64} << 10);
  pthread_attr_destroy(&attr);
}

// A socket connected to 127.0.0.1:port that sends `bytes` (maybe none) and then stays silent.
int HalfOpen(int port, const std::string& bytes) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return -1;
  }
  if (!bytes.empty() && write(fd, bytes.data(), bytes.size()) < 0) {
    close(fd);
    return -1;
  }
  return fd;
}

// Silent and half-sent connections held every civetweb thread (two), and a scrape behind them
// waited for the 10 s request timeout (9.7 s measured). Now they hold a few of many threads, and
// each is dropped after kRequestTimeoutMs.
TEST(MetricsEndpoint, HalfOpenConnectionsDoNotStallAScrape) {
  MetricsRegistry registry;
  auto endpoint = MetricsEndpoint::Start("127.0.0.1:0", &registry);
  ASSERT_TRUE(endpoint.ok()) << endpoint.status();
  const int port = (*endpoint)->port();
  std::vector<int> idle;
  for (int i = 0; i < 4; ++i) idle.push_back(HalfOpen(port, i % 2 == 0 ? "" : "GET /metr"));
  for (int fd : idle) ASSERT_GE(fd, 0);
  absl::SleepFor(absl::Milliseconds(100));  // accepted and parked on the server's threads
  const absl::Time start = absl::Now();
  const std::string answer = Get(port, "/metrics");
  const absl::Duration took = absl::Now() - start;
  EXPECT_TRUE(absl::StartsWith(answer, "HTTP/1.1 200 OK\r\n")) << answer;
  EXPECT_LT(took, absl::Seconds(2)) << "a scrape behind 4 silent connections";  // loose: ~1 ms idle
  // A silent connection is dropped by the server within the request timeout (plus slack).
  char buffer[512];
  timeval wait{static_cast<time_t>(MetricsEndpoint::kRequestTimeoutMs / 1000 + 5), 0};
  setsockopt(idle[0], SOL_SOCKET, SO_RCVTIMEO, &wait, sizeof(wait));
  ssize_t n;
  while ((n = read(idle[0], buffer, sizeof(buffer))) > 0) {
  }
  EXPECT_EQ(n, 0) << "the server kept a silent connection past " << wait.tv_sec << " s";  // -1: our timeout
  for (int fd : idle) close(fd);
}

// With tokens, a scrape needs one of them as a bearer token: the series name jobs, which the RPCs
// show only to holders of the read token.
TEST(MetricsEndpoint, WithTokensAScrapeNeedsOne) {
  MetricsRegistry registry;
  auto gauge = registry.AddGauge("queue", "Queue.", {"job"});
  ASSERT_TRUE(gauge.ok());
  (*(*gauge)->WithLabels({"job-secret-1"}))->Set(1);
  auto endpoint = MetricsEndpoint::Start("127.0.0.1:0", &registry, {"read-token", "admin-token", ""});
  ASSERT_TRUE(endpoint.ok()) << endpoint.status();
  const int port = (*endpoint)->port();
  const auto scrape = [port](const std::string& header) {
    return HttpExchange(
        port, absl::StrCat("GET /metrics HTTP/1.1\r\nHost: localhost\r\n", header, "Connection: close\r\n\r\n"));
  };
  for (const char* refused : {"", "Authorization: Bearer wrong\r\n", "Authorization: Bearer \r\n",
                              "Authorization: Basic cmVhZC10b2tlbg==\r\n", "Authorization: Bearer read-toke\r\n"}) {
    SCOPED_TRACE(refused);
    const std::string answer = scrape(refused);
    EXPECT_TRUE(absl::StartsWith(answer, "HTTP/1.1 401 ")) << answer;
    EXPECT_FALSE(absl::StrContains(answer, "job-secret-1"));
    EXPECT_FALSE(absl::StrContains(answer, "read-token"));
  }
  for (const char* accepted : {"Authorization: Bearer read-token\r\n", "Authorization: bearer admin-token\r\n"}) {
    SCOPED_TRACE(accepted);
    const std::string answer = scrape(accepted);
    EXPECT_TRUE(absl::StartsWith(answer, "HTTP/1.1 200 OK\r\n")) << answer;
    EXPECT_TRUE(absl::StrContains(answer, "job-secret-1"));
  }
}

TEST(MetricsEndpoint, BadAddressIsInvalidArgument) {
  MetricsRegistry registry;
  for (const char* address :
       {"", "9090", ":9090", "host:", "host:port", "1.2.3.4:65536", "a,b:1", "127.0.0.1:80s", "127.0.0.1:-1"}) {
    SCOPED_TRACE(address);
    EXPECT_EQ(MetricsEndpoint::Start(address, &registry).status().code(), absl::StatusCode::kInvalidArgument);
  }
}

TEST(MetricsEndpoint, PortInUseIsUnavailable) {
  MetricsRegistry registry;
  auto first = MetricsEndpoint::Start("127.0.0.1:0", &registry);
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = MetricsEndpoint::Start(absl::StrCat("127.0.0.1:", (*first)->port()), &registry);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable) << second.status();
  EXPECT_TRUE(absl::StrContains(second.status().message(), "cannot serve metrics on 127.0.0.1:"));
}

// The interceptor StartServer installs: exact counts by method and code, and a histogram sample
// per call, already recorded when the client has its answer.
TEST(GrpcServingMetrics, CountsEveryCallByMethodAndCode) {
  MetricsRegistry registry;
  auto started = StartServer("127.0.0.1:0", {}, 1 << 20, &registry);
  ASSERT_TRUE(started.ok()) << started.status();
  auto channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", started->port), grpc::InsecureChannelCredentials());
  auto health = grpc::health::v1::Health::NewStub(channel);
  for (const char* service : {"", "", "no.such.Service"}) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    grpc::health::v1::HealthCheckRequest request;
    request.set_service(service);
    grpc::health::v1::HealthCheckResponse response;
    health->Check(&context, request, &response);
  }
  const std::string text = registry.Render();
  EXPECT_TRUE(
      absl::StrContains(text, "bertshard_grpc_requests_total{method=\"/grpc.health.v1.Health/Check\",code=\"OK\"} 2\n"))
      << text;
  EXPECT_TRUE(absl::StrContains(
      text, "bertshard_grpc_requests_total{method=\"/grpc.health.v1.Health/Check\",code=\"NOT_FOUND\"} 1\n"))
      << text;
  EXPECT_TRUE(absl::StrContains(
      text, "bertshard_grpc_request_duration_seconds_count{method=\"/grpc.health.v1.Health/Check\"} 3\n"))
      << text;
  EXPECT_TRUE(absl::StrContains(
      text, "bertshard_grpc_request_duration_seconds_bucket{method=\"/grpc.health.v1.Health/Check\",le=\"+Inf\"} 3\n"))
      << text;

  // A stream of the synchronous reflection service counts once, when it ends.
  auto reflection = grpc::reflection::v1alpha::ServerReflection::NewStub(channel);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  auto stream = reflection->ServerReflectionInfo(&context);
  grpc::reflection::v1alpha::ServerReflectionRequest list;
  list.set_list_services("");
  grpc::reflection::v1alpha::ServerReflectionResponse listed;
  EXPECT_TRUE(stream->Write(list));
  EXPECT_TRUE(stream->Read(&listed));
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
  EXPECT_TRUE(absl::StrContains(registry.Render(),
                                "bertshard_grpc_requests_total{method=\"/grpc.reflection.v1alpha.ServerReflection/"
                                "ServerReflectionInfo\",code=\"OK\"} 1\n"))
      << registry.Render();
  DrainAndShutdown(started->server.get(), absl::ZeroDuration());
  started->server->Wait();
}

// Methods the server does not serve must not mint a label value per name a client makes up.
TEST(GrpcServingMetrics, UnknownMethodsShareOneLabel) {
  MetricsRegistry registry;
  auto started = StartServer("127.0.0.1:0", {}, 1 << 20, &registry);
  ASSERT_TRUE(started.ok()) << started.status();
  auto channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", started->port), grpc::InsecureChannelCredentials());
  grpc::GenericStub stub(channel);
  for (const char* method : {"/made.up.Service/One", "/made.up.Service/Two"}) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    grpc::Slice empty("");
    grpc::ByteBuffer request(&empty, 1);
    grpc::ByteBuffer response;
    std::promise<grpc::Status> done;
    stub.UnaryCall(&context, method, grpc::StubOptions(), &request, &response,
                   [&done](grpc::Status status) { done.set_value(status); });
    EXPECT_EQ(done.get_future().get().error_code(), grpc::StatusCode::UNIMPLEMENTED);
  }
  const std::string text = registry.Render();
  EXPECT_FALSE(absl::StrContains(text, "made.up")) << text;
  EXPECT_TRUE(absl::StrContains(text, "bertshard_grpc_requests_total{method=\"unknown\",code=\"UNIMPLEMENTED\"} 2\n"))
      << text;
  DrainAndShutdown(started->server.get(), absl::ZeroDuration());
  started->server->Wait();
}

}  // namespace
}  // namespace bertshard::common
