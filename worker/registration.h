// File: worker/registration.h
// -----------------------------------------------------------------------------
// A worker daemon's membership in the coordinator's pool: registers (address, device, free
// memory, the shards it holds), then heartbeats at the interval the coordinator asks for, with
// the shards it holds, registering again when the coordinator no longer knows it (it restarted)
// or stops answering. Jobs the coordinator lists in a response as not to be kept are unloaded
// at once (the coordinator restarted without them, or ended them). Runs on its own thread until
// destroyed.
//
// Example:
//   Registration registration({.coordinator = "coord:50051", .advertise = "10.0.0.7:50061",
//                               .held_shards = [&] { return service.HeldShards(); },
//                               .unload = [&](const std::string& job) { service.UnloadJob(job); }});
//
// Thread safety: thread-safe; the destructor stops the thread. The callbacks run on that thread.
#ifndef BERTSHARD_WORKER_REGISTRATION_H_
#define BERTSHARD_WORKER_REGISTRATION_H_

#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "bertshard/v1/worker.pb.h"
#include "grpcpp/security/credentials.h"

namespace bertshard::worker {

// The host of an --advertise value, "HOST:PORT" or "[V6]:PORT" (brackets dropped); "" for "" (none
// given). INVALID_ARGUMENT naming the flag when it is not HOST:PORT with a port of 1 to 65535: port
// 0 would register a port nothing serves, and two workers advertising it would knock each other's
// registration out (the coordinator keys workers by address).
absl::StatusOr<std::string> AdvertisedHost(const std::string& advertise);

struct RegistrationOptions {
  std::string coordinator;     // host:port
  std::string advertise;       // host:port where the coordinator reaches this worker
  std::string device = "cpu";  // "cpu" or "cuda:N": what its jobs run on (--device)
  std::string gpu_bus_id;      // a GPU worker's PCI bus id (NcclCollectives::GpuBusId)
  // The shards held now; reported with every registration and heartbeat. None when unset.
  std::function<std::vector<v1::HeldShard>()> held_shards;
  // Unloads a job the coordinator said not to keep. Unset: such jobs stay loaded.
  std::function<void(const std::string& job_id)> unload;
  // The cluster's bearer token, sent with registrations and heartbeats; empty: none.
  std::string token;
  // The channel to the coordinator (TLS, common/grpc_tls.h); null: plaintext.
  std::shared_ptr<grpc::ChannelCredentials> credentials;
};

class Registration {
 public:
  explicit Registration(RegistrationOptions options);
  ~Registration();
  Registration(const Registration&) = delete;
  Registration& operator=(const Registration&) = delete;

 private:
  void Run();
  std::vector<v1::HeldShard> Held() const;
  void Unload(const google::protobuf::RepeatedPtrField<std::string>& job_ids) const;

  const RegistrationOptions options_;
  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace bertshard::worker

#endif  // BERTSHARD_WORKER_REGISTRATION_H_
