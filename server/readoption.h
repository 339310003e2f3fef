// File: server/readoption.h
// -----------------------------------------------------------------------------
// How a restarted coordinator decides whether it can take back a job its workers still hold.
// Pure: the Cluster gathers what the re-registering workers report and applies the decision. A
// "fail" here ends the taking back, not the job: the scheduler then places and loads the job again
// with the cause as the reason (issue 22), as for any lost group.
//
// The rules, in order:
//   1. A report that does not fit the job (rank outside the plan, another world size), a broken
//      rank (a forward failed there), a rank still running a forward (cut off by the restart), or
//      a rank held by two workers: fail now, naming it.
//   2. Every rank reported once: the same next sequence number everywhere -> adopt (rank ->
//      worker, that sequence); otherwise fail: a forward was cut off when the coordinator stopped.
//   3. Ranks missing: fail as soon as one rank's previous worker has registered again without it
//      (that rank cannot come back), else once the grace period is over; the cause names those
//      ranks and where they were. A job that was LOADING fails with that said (its missing ranks
//      had not finished loading).
//   4. Otherwise wait.
//
// Example:
//   ReadoptionInput in{.world_size = 2, .previous = job.ranks(), .reports = {r0, r1}};
//   ReadoptionDecision d = DecideReadoption(in);  // d.outcome == kAdopt, d.next_sequence == 7
//
// Thread safety: thread-safe (no state).
#ifndef BERTSHARD_SERVER_READOPTION_H_
#define BERTSHARD_SERVER_READOPTION_H_

#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "bertshard/v1/job.pb.h"
#include "bertshard/v1/worker.pb.h"

namespace bertshard::server {

// One held shard of the job, as a re-registering worker reported it.
struct RankReport {
  std::string worker_id;  // the id this coordinator gave the worker
  std::string address;
  v1::HeldShard shard;
};

struct ReadoptionInput {
  int world_size = 0;        // of the job's plan
  bool was_loading = false;  // the job was LOADING (not READY) when the coordinator stopped
  // Where each rank was before the restart (Job.ranks), for causes; may be empty.
  std::vector<v1::RankAssignment> previous;
  std::vector<RankReport> reports;  // in arrival order
  std::set<int> lost;               // ranks whose previous worker registered again without them
  bool grace_over = false;
  absl::Duration grace;  // for the cause
};

struct ReadoptionDecision {
  enum class Outcome { kWait, kAdopt, kFail };
  Outcome outcome = Outcome::kWait;
  std::string cause;                      // kFail: the failure cause to store
  std::string waiting_for;                // kWait: which ranks, e.g. "ranks 1, 3"
  std::vector<std::string> rank_workers;  // kAdopt: the worker id of each rank
  int64_t next_sequence = 0;              // kAdopt: the sequence number of the next forward
};

ReadoptionDecision DecideReadoption(const ReadoptionInput& input);

}  // namespace bertshard::server

#endif  // BERTSHARD_SERVER_READOPTION_H_
