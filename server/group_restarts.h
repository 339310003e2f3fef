// File: server/group_restarts.h
// -----------------------------------------------------------------------------
// When a job's group of workers (one TP x PP replica) loses a worker, the job is not ended: the
// group is placed and loaded again. GroupRestarts is the bookkeeping of that for one group: how
// many times in a row it was lost, why each time, when the next placement may start (exponential
// backoff, so that a worker that dies at every load does not make the coordinator reload in a
// tight loop), and when to give up (--max_restarts). Pure: no locks, no gRPC, no clock of its own;
// the scheduler (scheduler.h) calls it under its lock and applies what it says.
//
// The rules:
//   - The k-th loss in a row (k = 1, 2, ...) is restart k. Restart 1 is placed at once (a spare is
//     usually waiting, and every second counts for the callers); restart k >= 2 waits
//     backoff_initial * 2^(k-2), at most backoff_max, from the loss.
//   - A group that served for at least `reset_after` before it was lost starts counting again at 1
//     (a loss a week after the last one is not a crash loop).
//   - More than `max_restarts` losses in a row: give up; the cause names the losses of the run (the
//     last 10, with their numbers, and how many earlier ones are not named).
//     max_restarts 0: the first loss ends the job (what every loss did before recovery existed).
//
// Example:
//   GroupRestarts restarts({.max_restarts = 3, .backoff_initial = absl::Seconds(1)});
//   GroupRestarts::Decision d = restarts.Lost("worker w-1 (rank 0) at h:1 stopped heartbeating", now);
//   // d.give_up == false, d.restart == 1, d.not_before == now
//   restarts.Served(later);  // the group is READY again
//
// Thread safety: none; guarded by its owner's lock.
#ifndef BERTSHARD_SERVER_GROUP_RESTARTS_H_
#define BERTSHARD_SERVER_GROUP_RESTARTS_H_

#include <optional>
#include <string>
#include <vector>

#include "absl/time/time.h"

namespace bertshard::server {

struct RestartPolicy {
  int max_restarts = 10;  // losses in a row that are placed again; one more ends the job
  absl::Duration backoff_initial = absl::Seconds(1);
  absl::Duration backoff_max = absl::Seconds(60);
  absl::Duration reset_after = absl::Minutes(10);  // served this long: the count starts again
};

class GroupRestarts {
 public:
  explicit GroupRestarts(RestartPolicy policy = {}) : policy_(policy) {}

  struct Decision {
    bool give_up = false;
    int restart = 0;        // which restart in a row this is (1 for the first)
    absl::Time not_before;  // !give_up: the group may be placed again from then
    std::string cause;      // give_up: the job's failure cause, every loss named
  };
  // The group lost a worker at `now` because of `cause` (it names the worker). Records it.
  Decision Lost(const std::string& cause, absl::Time now);
  // The group is loaded and serving again (or for the first time) at `now`.
  void Served(absl::Time now);
  // After a give-up (Lost said give_up) that the caller does not act on, because the job serves on
  // other replicas: the group keeps recovering, placed again every backoff_max from `now`.
  void KeepTrying(absl::Time now);

  // Losses in the current run (0 once served long enough, or never lost).
  int restarts() const { return losses_; }
  // The last loss's cause; empty when never lost.
  std::string last_cause() const { return causes_.empty() ? std::string() : causes_.back(); }
  // Whether the group is being placed and loaded again (lost, not served since).
  bool recovering() const { return recovering_; }
  absl::Time not_before() const { return not_before_; }
  // While recovering: "lost worker ... (restart 2 of at most 10)" (past the limit: "restart 12,
  // past --max_restarts=10; again every 60s while other replicas serve"); empty otherwise.
  std::string Describe() const;

  // The wait before restart `k` (1-based) under `policy`.
  static absl::Duration Backoff(const RestartPolicy& policy, int k);

 private:
  // The causes kept (and named in a give-up's cause): the last ones of the run.
  static constexpr size_t kCausesKept = 10;

  const RestartPolicy policy_;
  std::vector<std::string> causes_;         // the last kCausesKept losses of the current run, oldest first
  int losses_ = 0;                          // losses in the current run
  std::optional<absl::Time> served_since_;  // serving since, unless lost since
  bool recovering_ = false;
  absl::Time not_before_ = absl::InfinitePast();
};

}  // namespace bertshard::server

#endif  // BERTSHARD_SERVER_GROUP_RESTARTS_H_
