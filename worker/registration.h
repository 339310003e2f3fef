// File: worker/registration.h
// -----------------------------------------------------------------------------
// A worker daemon's membership in the coordinator's pool: registers (address, device, free
// memory), then heartbeats at the interval the coordinator asks for, registering again when the
// coordinator no longer knows it (it restarted). Runs on its own thread until destroyed.
//
// Thread safety: thread-safe; the destructor stops the thread.
#ifndef BERTSHARD_WORKER_REGISTRATION_H_
#define BERTSHARD_WORKER_REGISTRATION_H_

#include <string>
#include <thread>

#include "absl/synchronization/mutex.h"

namespace bertshard::worker {

class Registration {
 public:
  Registration(std::string coordinator, std::string advertise);
  ~Registration();
  Registration(const Registration&) = delete;
  Registration& operator=(const Registration&) = delete;

 private:
  void Run();
  const std::string coordinator_;
  const std::string advertise_;
  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace bertshard::worker

#endif  // BERTSHARD_WORKER_REGISTRATION_H_
