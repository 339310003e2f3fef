// A Registration against a small in-process coordinator (the Coordinator gRPC service's
// RegisterWorker and Heartbeat, answered as the test says) on loopback: what it sends, how it
// follows the coordinator's answers, and how it leaves.
#include "worker/registration.h"

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "bertshard/v1/coordinator.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"

namespace bertshard::worker {
namespace {

TEST(AdvertisedHost, TakesHostPortAndRefusesPortZero) {
  EXPECT_EQ(AdvertisedHost("10.0.0.7:50061").value(), "10.0.0.7");
  EXPECT_EQ(AdvertisedHost("[::1]:50061").value(), "::1");
  EXPECT_EQ(AdvertisedHost("worker-3.cluster:1").value(), "worker-3.cluster");
  EXPECT_EQ(AdvertisedHost("").value(), "");  // none given: 127.0.0.1 and the port served
  // Port 0 was accepted, and two such workers knocked each other's registration out (issue 21).
  const absl::Status zero = AdvertisedHost("127.0.0.1:0").status();
  EXPECT_EQ(zero.code(), absl::StatusCode::kInvalidArgument) << zero;
  EXPECT_NE(zero.message().find("--advertise '127.0.0.1:0': the port must be 1 to 65535"), std::string::npos) << zero;
  for (const std::string bad : {"127.0.0.1", "127.0.0.1:", ":50061", "host:port", "host:70000", "host:-1", "[::1:5"}) {
    EXPECT_EQ(AdvertisedHost(bad).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

class FakeCoordinator final : public v1::Coordinator::Service {
 public:
  struct Call {
    std::string authorization;  // the metadata sent, "" for none
    v1::RegisterWorkerRequest registration;
    v1::HeartbeatRequest heartbeat;
  };

  grpc::Status RegisterWorker(grpc::ServerContext* context, const v1::RegisterWorkerRequest* request,
                              v1::RegisterWorkerResponse* response) override {
    absl::MutexLock lock(&mu_);
    registrations_.push_back({Authorization(*context), *request, {}});
    if (refuse_registrations_ > 0) {
      --refuse_registrations_;
      return {grpc::StatusCode::UNAUTHENTICATED, "not yet"};
    }
    response->set_worker_id("w" + std::to_string(registrations_.size()));
    response->set_heartbeat_interval_ms(50);
    for (const std::string& job : unload_on_registration_) response->add_unload_job_ids(job);
    return grpc::Status::OK;
  }

  grpc::Status Heartbeat(grpc::ServerContext* context, const v1::HeartbeatRequest* request,
                         v1::HeartbeatResponse* response) override {
    absl::MutexLock lock(&mu_);
    heartbeats_.push_back({Authorization(*context), {}, *request});
    if (forget_next_heartbeat_) {
      forget_next_heartbeat_ = false;
      return {grpc::StatusCode::NOT_FOUND, "unknown worker"};  // as after a restart
    }
    for (const std::string& job : unload_on_heartbeat_) response->add_unload_job_ids(job);
    return grpc::Status::OK;
  }

  // Returns once `done` holds of the calls so far, or false after `timeout`.
  bool WaitFor(
      const std::function<bool(const std::vector<Call>& registrations, const std::vector<Call>& heartbeats)>& done,
      absl::Duration timeout = absl::Seconds(20)) {
    absl::MutexLock lock(&mu_);
    auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return done(registrations_, heartbeats_); };
    return mu_.AwaitWithTimeout(absl::Condition(&ready), timeout);
  }
  std::vector<Call> heartbeats() {
    absl::MutexLock lock(&mu_);
    return heartbeats_;
  }
  std::vector<Call> registrations() {
    absl::MutexLock lock(&mu_);
    return registrations_;
  }

  absl::Mutex mu_;
  int refuse_registrations_ ABSL_GUARDED_BY(mu_) = 0;
  bool forget_next_heartbeat_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::string> unload_on_registration_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> unload_on_heartbeat_ ABSL_GUARDED_BY(mu_);

 private:
  static std::string Authorization(const grpc::ServerContext& context) {
    auto it = context.client_metadata().find("authorization");
    return it == context.client_metadata().end() ? "" : std::string(it->second.data(), it->second.size());
  }
  std::vector<Call> registrations_ ABSL_GUARDED_BY(mu_);
  std::vector<Call> heartbeats_ ABSL_GUARDED_BY(mu_);
};

struct Served {
  std::unique_ptr<FakeCoordinator> coordinator = std::make_unique<FakeCoordinator>();
  std::unique_ptr<grpc::Server> server;
  std::string address;
};

Served Serve() {
  Served s;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(s.coordinator.get());
  s.server = builder.BuildAndStart();
  s.address = "127.0.0.1:" + std::to_string(port);
  return s;
}

v1::HeldShard Held(const std::string& job, int rank) {
  v1::HeldShard h;
  h.set_job_id(job);
  h.set_rank(rank);
  return h;
}

TEST(Registration, RegistersThenHeartbeatsWithWhatItHoldsAndSaysWhenItLeaves) {
  Served served = Serve();
  auto registration = std::make_unique<Registration>(
      RegistrationOptions{.coordinator = served.address,
                          .advertise = "10.0.0.7:50061",
                          .device = "cuda:1",
                          .gpu_bus_id = "0000:3B:00.0",
                          .held_shards = [] { return std::vector<v1::HeldShard>{Held("job-a", 1)}; },
                          .token = "secret-1"});
  ASSERT_TRUE(served.coordinator->WaitFor([](const auto& registrations, const auto& heartbeats) {
    return !registrations.empty() && heartbeats.size() >= 3;
  }));
  registration.reset();  // leaves: one last heartbeat saying so
  const auto heartbeats = served.coordinator->heartbeats();
  ASSERT_GE(heartbeats.size(), 4u);
  for (size_t i = 0; i + 1 < heartbeats.size(); ++i) {
    EXPECT_EQ(heartbeats[i].authorization, "Bearer secret-1");
    EXPECT_EQ(heartbeats[i].heartbeat.worker_id(), "w1");
    EXPECT_FALSE(heartbeats[i].heartbeat.leaving());
    ASSERT_EQ(heartbeats[i].heartbeat.held_size(), 1);
    EXPECT_EQ(heartbeats[i].heartbeat.held(0).job_id(), "job-a");
  }
  EXPECT_TRUE(heartbeats.back().heartbeat.leaving());
  EXPECT_EQ(heartbeats.back().heartbeat.worker_id(), "w1");
  const auto registrations = served.coordinator->registrations();
  ASSERT_EQ(registrations.size(), 1u);
  const v1::RegisterWorkerRequest& r = registrations[0].registration;
  EXPECT_EQ(registrations[0].authorization, "Bearer secret-1");
  EXPECT_EQ(r.address(), "10.0.0.7:50061");
  EXPECT_EQ(r.device(), "cuda:1");
  EXPECT_EQ(r.gpu_bus_id(), "0000:3B:00.0");
  EXPECT_GT(r.free_memory_bytes(), 0);
  ASSERT_EQ(r.held_size(), 1);
  EXPECT_EQ(r.held(0).rank(), 1);
}

// Jobs the coordinator lists as not to be kept, at registration or in a heartbeat's answer, are
// unloaded through the callback.
TEST(Registration, UnloadsTheJobsTheCoordinatorDoesNotKeep) {
  Served served = Serve();
  {
    absl::MutexLock lock(&served.coordinator->mu_);
    served.coordinator->unload_on_registration_ = {"gone-at-registration"};
    served.coordinator->unload_on_heartbeat_ = {"gone-at-heartbeat"};
  }
  absl::Mutex mu;
  std::vector<std::string> unloaded;
  Registration registration(
      {.coordinator = served.address, .advertise = "127.0.0.1:1", .unload = [&](const std::string& job) {
         absl::MutexLock lock(&mu);
         unloaded.push_back(job);
       }});
  absl::MutexLock lock(&mu);
  auto both = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return unloaded.size() >= 2; };
  ASSERT_TRUE(mu.AwaitWithTimeout(absl::Condition(&both), absl::Seconds(20)));
  EXPECT_EQ(unloaded[0], "gone-at-registration");
  EXPECT_EQ(unloaded[1], "gone-at-heartbeat");
}

// A coordinator that refuses the first registration, and later no longer knows the worker (a
// heartbeat answered NOT_FOUND, as after its restart): the worker registers again each time.
TEST(Registration, RegistersAgainAfterARefusalAndWhenTheCoordinatorForgetsIt) {
  Served served = Serve();
  {
    absl::MutexLock lock(&served.coordinator->mu_);
    served.coordinator->refuse_registrations_ = 1;
  }
  Registration registration({.coordinator = served.address, .advertise = "127.0.0.1:1"});
  ASSERT_TRUE(served.coordinator->WaitFor([](const auto& registrations, const auto& heartbeats) {
    return registrations.size() == 2 && !heartbeats.empty();
  }));
  {
    absl::MutexLock lock(&served.coordinator->mu_);
    served.coordinator->forget_next_heartbeat_ = true;
  }
  ASSERT_TRUE(served.coordinator->WaitFor([](const auto& registrations, const auto& heartbeats) {
    // Registered a third time, and heartbeats go on under the new id.
    return registrations.size() == 3 && heartbeats.back().heartbeat.worker_id() == "w3";
  }));
}

}  // namespace
}  // namespace bertshard::worker
