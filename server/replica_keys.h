// File: server/replica_keys.h
// -----------------------------------------------------------------------------
// The name a job's replica goes by on its workers. A worker holds shards by a key it never
// interprets (LoadShardRequest.job_id, HeldShard.job_id, its metrics' job label); the coordinator
// gives each replica of a job its own key, so that the workers, the rendezvous, the pool and the
// re-adoption after a restart tell the replicas apart without knowing of them: replica 0 is the
// job's id itself (what every worker held before replicas, so stored jobs and running workers
// keep their shards across an upgrade), replica k >= 1 is "<job id>/replica-<k>". Job ids never
// hold '/', so the two cannot meet.
//
// Example:
//   ReplicaKey("job-17-3", 2)        // "job-17-3/replica-2"
//   ParseReplicaKey("job-17-3/replica-2")  // {"job-17-3", 2}
//
// Thread safety: functions without state.
#ifndef BERTSHARD_SERVER_REPLICA_KEYS_H_
#define BERTSHARD_SERVER_REPLICA_KEYS_H_

#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"

namespace bertshard::server {

struct ReplicaOf {
  std::string job_id;
  int32_t replica = 0;
};

// The key of replica `replica` (>= 0) of job `job_id` on its workers.
std::string ReplicaKey(absl::string_view job_id, int32_t replica);
// The job and replica of a key ReplicaKey made; any other string is replica 0 of a job by that
// name (the caller looks it up and finds none).
ReplicaOf ParseReplicaKey(absl::string_view key);

}  // namespace bertshard::server

#endif  // BERTSHARD_SERVER_REPLICA_KEYS_H_
