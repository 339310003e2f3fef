// File: server/replica_autoscaler.h
// -----------------------------------------------------------------------------
// When a job with replica bounds (SubmitJobRequest.min_replicas/max_replicas, issue 22 item 3)
// should run one replica more or one fewer, from how busy its serving replicas have been: the
// fraction of the time each ran a forward (a replica runs one merged forward at a time, so a busy
// fraction near 1 means batches wait for it). The signal is the replicas' own utilisation, not the
// queue's length: under dynamic batching a long queue merges into the next forward and costs no
// more than one, while a replica that never rests is what makes requests wait.
//
// The rule, an HPA's with a target utilisation: one more replica once the utilisation over the
// last `up_after` stayed above `target`; one fewer once, over the last `down_after`, the remaining
// replicas would have stayed below `target` with the same work (utilisation x n / (n - 1) <
// target: no scaling down into a scale up); one step at a time, each measured anew, and only
// within [min, max]. `up_after` is short (a burst of load is served soon), `down_after` long (a
// lull between bursts keeps its replicas). Pure: the caller samples and applies.
//
// Example:
//   ReplicaAutoscaler autoscaler(policy);
//   // every monitor pass, with the busy time the serving replicas added since the last pass:
//   int wanted = autoscaler.Observe(now, busy, serving, replicas, min, max);
//
// Thread safety: none; the Scheduler calls it under its lock.
#ifndef BERTSHARD_SERVER_REPLICA_AUTOSCALER_H_
#define BERTSHARD_SERVER_REPLICA_AUTOSCALER_H_

#include <deque>

#include "absl/time/time.h"

namespace bertshard::server {

struct AutoscalePolicy {
  double target = 0.7;                            // the busy fraction aimed at (--autoscale_target)
  absl::Duration up_after = absl::Seconds(3);     // --autoscale_up_after
  absl::Duration down_after = absl::Seconds(60);  // --autoscale_down_after
};

class ReplicaAutoscaler {
 public:
  explicit ReplicaAutoscaler(const AutoscalePolicy& policy) : policy_(policy) {}

  // One sample at `now`: the serving replicas (`serving` of them) were busy `busy` in all since the
  // previous sample. Returns the replica count wanted: `current`, or one more or fewer within
  // [min, max] (a change starts the measuring again). A first sample only starts it.
  int Observe(absl::Time now, absl::Duration busy, int serving, int current, int min, int max);
  // Forgets what was measured (the job's replicas changed for another reason: a scale by hand, a
  // loss, an update): the next sample only starts the measuring again.
  void Reset() {
    samples_.clear();
    last_ = absl::InfinitePast();
  }
  // The utilisation over the last `window` (0 when nothing was measured), for Job and metrics.
  double Utilisation(absl::Duration window) const;

 private:
  struct Sample {
    absl::Time end;
    absl::Duration span;  // since the previous sample
    absl::Duration busy;
    int serving = 0;
  };
  // Whether the samples cover the last `window` before `now`.
  bool Covers(absl::Time now, absl::Duration window) const;

  const AutoscalePolicy policy_;
  absl::Time last_ = absl::InfinitePast();
  std::deque<Sample> samples_;  // the last down_after (or up_after, if longer)
};

}  // namespace bertshard::server

#endif  // BERTSHARD_SERVER_REPLICA_AUTOSCALER_H_
