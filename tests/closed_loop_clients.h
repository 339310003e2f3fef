// File: tests/closed_loop_clients.h
// -----------------------------------------------------------------------------
// Closed-loop clients for fault and scaling tests (issue 22): N threads that each send a request as
// soon as the last is answered, check every answer, and keep what went wrong with the time it was
// sent, so that a test can say "no error at all" or "only UNAVAILABLE, only during the gap", and
// time a fault from its moment to the first answer to a request sent after it.
//
// Example:
//   ClosedLoopClients clients(8, [&] { return SendOneAndCheck(); });  // starts them
//   ASSERT_TRUE(clients.WaitAnswers(8));
//   const absl::Time killed = clients.Mark();   // KillWorker(...) just before
//   ...
//   clients.Stop();
//   EXPECT_TRUE(clients.failures().empty());
//
// Thread safety: thread-safe; `send` runs on the clients' threads, concurrently.
#ifndef BERTSHARD_TESTS_CLOSED_LOOP_CLIENTS_H_
#define BERTSHARD_TESTS_CLOSED_LOOP_CLIENTS_H_

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <functional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"

namespace bertshard::testing {

class ClosedLoopClients {
 public:
  // What one request did: its status, and (when OK) whether the answer was the reference's.
  struct Outcome {
    grpc::Status status;
    bool right = true;
  };
  struct Failure {
    grpc::StatusCode code;
    std::string message;
    absl::Time sent;
  };

  ClosedLoopClients(int clients, std::function<Outcome()> send) : send_(std::move(send)) {
    for (int c = 0; c < clients; ++c) threads_.emplace_back([this] { Loop(); });
  }
  ~ClosedLoopClients() { Stop(); }
  ClosedLoopClients(const ClosedLoopClients&) = delete;
  ClosedLoopClients& operator=(const ClosedLoopClients&) = delete;

  // Ends every client after its request in flight. Idempotent.
  void Stop() {
    stop_ = true;
    for (std::thread& t : threads_) {
      if (t.joinable()) t.join();
    }
  }

  int64_t answered() const {
    absl::MutexLock lock(&mu_);
    return answered_;
  }
  // Waits (up to 30 s) until `n` requests in all were answered.
  bool WaitAnswers(int64_t n) const {
    absl::MutexLock lock(&mu_);
    const auto enough = [&] {
      mu_.AssertHeld();
      return answered_ >= n;
    };
    return mu_.AwaitWithTimeout(absl::Condition(&enough), absl::Seconds(30));
  }
  // Now is the fault's moment: first_answer_after() counts from it. Returns it.
  absl::Time Mark() {
    absl::MutexLock lock(&mu_);
    mark_ = absl::Now();
    first_after_mark_ = absl::InfiniteFuture();
    return mark_;
  }
  // When the first request sent after Mark() was answered (InfiniteFuture: none yet).
  absl::Time first_answer_after() const {
    absl::MutexLock lock(&mu_);
    return first_after_mark_;
  }
  std::vector<Failure> failures() const {
    absl::MutexLock lock(&mu_);
    return failures_;
  }
  int wrong() const {
    absl::MutexLock lock(&mu_);
    return wrong_;
  }
  // The `q` quantile (0..1) of the latencies of the requests answered that were sent in
  // [from, to); zero when there is none.
  absl::Duration Latency(double q, absl::Time from, absl::Time to = absl::InfiniteFuture()) const {
    std::vector<absl::Duration> took;
    {
      absl::MutexLock lock(&mu_);
      for (const auto& [sent, d] : latencies_) {
        if (sent >= from && sent < to) took.push_back(d);
      }
    }
    if (took.empty()) return absl::ZeroDuration();
    std::sort(took.begin(), took.end());
    return took[std::min(took.size() - 1, static_cast<size_t>(q * static_cast<double>(took.size())))];
  }

 private:
  void Loop() {
    while (!stop_) {
      const absl::Time sent = absl::Now();
      const Outcome outcome = send_();
      absl::MutexLock lock(&mu_);
      if (!outcome.status.ok()) {
        failures_.push_back({outcome.status.error_code(), outcome.status.error_message(), sent});
        continue;
      }
      ++answered_;
      wrong_ += outcome.right ? 0 : 1;
      latencies_.emplace_back(sent, absl::Now() - sent);
      if (sent > mark_) first_after_mark_ = std::min(first_after_mark_, absl::Now());
    }
  }

  const std::function<Outcome()> send_;
  std::atomic<bool> stop_{false};
  mutable absl::Mutex mu_;
  int64_t answered_ ABSL_GUARDED_BY(mu_) = 0;
  int wrong_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<Failure> failures_ ABSL_GUARDED_BY(mu_);
  std::vector<std::pair<absl::Time, absl::Duration>> latencies_ ABSL_GUARDED_BY(mu_);  // sent, took
  absl::Time mark_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();
  absl::Time first_after_mark_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();
  std::vector<std::thread> threads_;  // last: started once the rest is built
};

// Every answer was the reference's and no request failed; each failure is reported.
inline void ExpectNoFailure(const ClosedLoopClients& clients) {
  EXPECT_EQ(clients.wrong(), 0);
  for (const ClosedLoopClients::Failure& f : clients.failures()) {
    ADD_FAILURE() << "a client saw " << f.code << ": " << f.message;
  }
}

}  // namespace bertshard::testing

#endif  // BERTSHARD_TESTS_CLOSED_LOOP_CLIENTS_H_
