// File: client/load_progress.h
// -----------------------------------------------------------------------------
// How much of a job `shardctl watch` shows as loaded. The coordinator's JobEvents carry each
// rank's LoadProgress, and a rank's bytes_total is 0 until that rank first reports, so summing
// the events alone gives a total that grows as ranks start and a bar that goes back (65%, 100%,
// 55%, ... in the demo). Measured instead against the whole job's bytes, known from its plan (the
// ranks' param_bytes, what each rank reports as bytes_total) before any rank starts, and with
// each rank's loaded bytes never taken back, the share only moves forward.
//
// Example:
//   JobLoadProgress progress(PlanBytes(plan));  // 0 when the plan could not be had
//   for (const v1::JobEvent& event : events) {
//     LoadReading r = progress.Update(event);    // r.percent never decreases
//   }
//
// Failure model: none (pure arithmetic on what the events say; totals of 0 read as 0%).
// Thread safety: thread-compatible.
#ifndef BERTSHARD_CLIENT_LOAD_PROGRESS_H_
#define BERTSHARD_CLIENT_LOAD_PROGRESS_H_

#include <cstdint>
#include <map>
#include <utility>

#include "bertshard/v1/coordinator.pb.h"
#include "bertshard/v1/plan.pb.h"

namespace bertshard::client {

// The bytes of all of the plan's ranks.
int64_t PlanBytes(const v1::ShardPlan& plan);

struct LoadReading {
  int64_t loaded = 0;  // bytes placed so far, over all ranks
  int64_t total = 0;   // the job's bytes; 0 while unknown
  int percent = 0;     // 0..100, never less than an earlier reading's
};

class JobLoadProgress {
 public:
  // `plan_bytes`: the job's total from its plan, times its replicas (each loads the whole plan);
  // 0 when unknown, and the total is then the sum of what the ranks have reported (growing as they
  // start; the percent still never goes back).
  explicit JobLoadProgress(int64_t plan_bytes) : plan_bytes_(plan_bytes) {}

  LoadReading Update(const v1::JobEvent& event);

 private:
  const int64_t plan_bytes_;
  // Per rank of each replica ({replica, rank}: rank 0 of two replicas are two ranks), the most it
  // has reported, and its bytes_total.
  std::map<std::pair<int, int>, int64_t> loaded_;
  std::map<std::pair<int, int>, int64_t> reported_;
  int percent_ = 0;
};

}  // namespace bertshard::client

#endif  // BERTSHARD_CLIENT_LOAD_PROGRESS_H_
