#include "common/grpc_serving.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdio>
#include <string>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "common/metrics.h"
#include "common/status_macros.h"
#include "google/protobuf/descriptor.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/resource_quota.h"
#include "grpcpp/support/server_interceptor.h"

namespace bertshard::common {
namespace {

struct RpcMetrics {
  CounterFamily* requests = nullptr;
  HistogramFamily* seconds = nullptr;
};

// Seconds, from a health check (~1 ms) to the longest call the coordinator allows (Infer's 10 min).
const std::vector<double>& RpcSecondsBounds() {
  static const auto* bounds = new std::vector<double>{0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                                                      1,     2.5,    5,     10,   30,    60,   120, 300,  600};
  return *bounds;
}

absl::StatusOr<RpcMetrics> RegisterRpcMetrics(MetricsRegistry* registry) {
  RpcMetrics metrics;
  ASSIGN_OR_RETURN(metrics.requests,
                   registry->AddCounter("bertshard_grpc_requests_total",
                                        "gRPC calls this server answered, by full method name and status code.",
                                        {"method", "code"}));
  ASSIGN_OR_RETURN(metrics.seconds,
                   registry->AddHistogram("bertshard_grpc_request_duration_seconds",
                                          "Time from a gRPC call's arrival to its status, by full method name "
                                          "(streams: the whole stream).",
                                          {"method"}, RpcSecondsBounds()));
  return metrics;
}

// One per call: counts and times it when its status goes out. Recording before Proceed() means
// the figures are in the registry before the client can see the answer.
class RpcMetricsInterceptor final : public grpc::experimental::Interceptor {
 public:
  RpcMetricsInterceptor(const RpcMetrics& metrics, std::string method)
      : metrics_(metrics), method_(std::move(method)), start_(std::chrono::steady_clock::now()) {}

  ~RpcMetricsInterceptor() override {
    // The call ended without a status of ours (the client went away before the handler answered).
    if (!recorded_) Record(grpc::StatusCode::CANCELLED);
  }

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (!recorded_ &&
        methods->QueryInterceptionHookPoint(grpc::experimental::InterceptionHookPoints::PRE_SEND_STATUS)) {
      Record(methods->GetSendStatus().error_code());
    }
    methods->Proceed();
  }

 private:
  void Record(grpc::StatusCode code) {
    recorded_ = true;
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    // FromGrpcStatus maps codes a newer peer might use to UNKNOWN, so the label set stays bounded.
    const std::string code_name = absl::StatusCodeToString(FromGrpcStatus(grpc::Status(code, "")).code());
    // The label counts are fixed above, so these cannot fail.
    if (auto counter = metrics_.requests->WithLabels({method_, code_name}); counter.ok()) (*counter)->Increment();
    if (auto histogram = metrics_.seconds->WithLabels({method_}); histogram.ok()) (*histogram)->Observe(seconds);
  }

  const RpcMetrics metrics_;
  const std::string method_;
  const std::chrono::steady_clock::time_point start_;
  bool recorded_ = false;  // gRPC runs one call's interceptions one at a time
};

// gRPC hands interceptors the path the client asked for, served or not: a scanner would mint a
// label value per made-up name. Methods of the protos linked into this binary (ours, health,
// reflection) keep their name; anything else is "unknown".
std::string MethodLabel(const char* path) {
  constexpr char kUnknown[] = "unknown";
  if (path == nullptr || path[0] != '/') return kUnknown;
  std::string dotted(path + 1);  // "/pkg.Service/Method" -> "pkg.Service.Method"
  const size_t slash = dotted.rfind('/');
  if (slash == std::string::npos) return kUnknown;
  dotted[slash] = '.';
  if (google::protobuf::DescriptorPool::generated_pool()->FindMethodByName(dotted) == nullptr) return kUnknown;
  return path;
}

class RpcMetricsInterceptorFactory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit RpcMetricsInterceptorFactory(const RpcMetrics& metrics) : metrics_(metrics) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(grpc::experimental::ServerRpcInfo* info) override {
    return new RpcMetricsInterceptor(metrics_, MethodLabel(info->method()));
  }

 private:
  const RpcMetrics metrics_;
};

}  // namespace

absl::StatusOr<StartedServer> StartServer(const std::string& address, const std::vector<grpc::Service*>& services,
                                          int max_message_bytes, MetricsRegistry* metrics,
                                          std::shared_ptr<grpc::ServerCredentials> credentials,
                                          const ServerTransport& transport) {
  if (address.empty() || !absl::StrContains(address, ':')) {
    return absl::InvalidArgumentError(
        absl::StrCat("listen address '", address, "' is not host:port (e.g. 0.0.0.0:50051)"));
  }
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> interceptors;
  if (metrics != nullptr) {
    ASSIGN_OR_RETURN(const RpcMetrics rpc_metrics, RegisterRpcMetrics(metrics));
    interceptors.push_back(std::make_unique<RpcMetricsInterceptorFactory>(rpc_metrics));
  }
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  StartedServer started;
  // Null: plaintext (common/grpc_tls.h makes TLS credentials).
  builder.AddListeningPort(address, credentials != nullptr ? credentials : grpc::InsecureServerCredentials(),
                           &started.port);
  // gRPC sets SO_REUSEPORT by default: a second server would silently share the port.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.SetMaxReceiveMessageSize(
      transport.max_receive_bytes > 0 ? std::min(transport.max_receive_bytes, max_message_bytes) : max_message_bytes);
  builder.SetMaxSendMessageSize(max_message_bytes);
  if (transport.max_transport_memory_bytes > 0) {
    // The builder keeps its own reference to the quota's core object.
    grpc::ResourceQuota quota(absl::StrCat("server ", address));
    quota.Resize(static_cast<size_t>(transport.max_transport_memory_bytes));
    builder.SetResourceQuota(quota);
  }
  if (transport.keepalive_time > absl::ZeroDuration()) {
    // gRPC takes int milliseconds and falls back to its 2 h default on 0 or a negative value.
    const auto ms = [](absl::Duration d) {
      return static_cast<int>(std::clamp<int64_t>(absl::ToInt64Milliseconds(d), 1, INT_MAX));
    };
    builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, ms(transport.keepalive_time));
    builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, ms(transport.keepalive_timeout));
  }
  for (grpc::Service* service : services) builder.RegisterService(service);
  if (!interceptors.empty()) builder.experimental().SetInterceptorCreators(std::move(interceptors));
  started.server = builder.BuildAndStart();
  if (started.server == nullptr || started.port == 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", address, " (address in use, or not an address of this machine)"));
  }
  started.server->GetHealthCheckService()->SetServingStatus(true);
  return started;
}

void DrainAndShutdown(grpc::Server* server, absl::Duration drain) {
  server->GetHealthCheckService()->SetServingStatus(false);
  server->Shutdown(absl::ToChronoTime(absl::Now() + drain));
}

namespace {

// The handler only writes to this pipe (async-signal-safe); WaitForShutdownSignal reads it.
int signal_pipe[2] = {-1, -1};

void OnShutdownSignal(int signal) {
  const char byte = static_cast<char>(signal);
  const ssize_t ignored = write(signal_pipe[1], &byte, 1);
  (void)ignored;
}

}  // namespace

void InstallShutdownHandlers() {
  if (signal_pipe[0] < 0 && pipe(signal_pipe) != 0) return;
  struct sigaction action {};
  action.sa_handler = OnShutdownSignal;
  sigemptyset(&action.sa_mask);
  sigaction(SIGTERM, &action, nullptr);
  sigaction(SIGINT, &action, nullptr);
}

void WaitForShutdownSignal(const char* program) {
  char byte = 0;
  while (read(signal_pipe[0], &byte, 1) < 0 && errno == EINTR) {
  }
  std::fprintf(stderr, "%s: signal %d, draining\n", program, static_cast<int>(byte));
}

}  // namespace bertshard::common
