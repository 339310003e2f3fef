// File: tests/proc_status.h
// -----------------------------------------------------------------------------
// What the memory tests read of another process: fields of /proc/PID/status (VmRSS, VmHWM,
// Threads), its open descriptors, and a sampler that keeps the highest VmRSS seen while a call runs.
//
// Example:
//   RssSampler sampler(pid);
//   ... the call ...
//   const int64_t peak = sampler.Stop();   // bytes
//
// Failure model: an unreadable /proc gives 0. Thread safety: StatusValue is thread-safe; a sampler
// is driven from one thread.
#ifndef BERTSHARD_TESTS_PROC_STATUS_H_
#define BERTSHARD_TESTS_PROC_STATUS_H_

#include <sys/types.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

namespace bertshard::testing {

// The number of field `name` of /proc/`pid`/status (kB for the Vm* fields); 0 if unreadable.
inline int64_t StatusValue(pid_t pid, const std::string& name) {
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind(name + ":", 0) == 0) return std::atoll(line.c_str() + name.size() + 1);
  }
  return 0;
}

// A Vm* field in bytes.
inline int64_t StatusBytes(pid_t pid, const std::string& name) { return StatusValue(pid, name) * 1024; }

// The descriptors `pid` has open (sockets included); -1 if unreadable.
inline int OpenDescriptors(pid_t pid) {
  std::error_code error;
  int n = 0;
  for (std::filesystem::directory_iterator it("/proc/" + std::to_string(pid) + "/fd", error), end; !error && it != end;
       it.increment(error)) {
    ++n;
  }
  return error ? -1 : n;
}

inline double MiB(int64_t bytes) { return static_cast<double>(bytes) / (1 << 20); }

// The highest VmRSS of `pid`, sampled every 2 ms from construction until Stop.
class RssSampler {
 public:
  explicit RssSampler(pid_t pid)
      : pid_(pid), thread_([this] {
          while (!stop_.load()) {
            const int64_t rss = StatusBytes(pid_, "VmRSS");
            if (rss > peak_.load()) peak_.store(rss);
            usleep(2000);
          }
        }) {}
  ~RssSampler() {
    if (thread_.joinable()) Stop();
  }
  RssSampler(const RssSampler&) = delete;
  RssSampler& operator=(const RssSampler&) = delete;

  int64_t Stop() {
    stop_.store(true);
    if (thread_.joinable()) thread_.join();
    return peak_.load();
  }

 private:
  const pid_t pid_;
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> peak_{0};
  std::thread thread_;
};

}  // namespace bertshard::testing

#endif  // BERTSHARD_TESTS_PROC_STATUS_H_
