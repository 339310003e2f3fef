// File: server/cluster_internal.h
// -----------------------------------------------------------------------------
// Cluster's private state, shared by its implementation files: cluster.cc (the worker pool,
// scheduling and loading, handing each READY job to its JobServing) and cluster_recovery.cc (taking jobs back
// after a restart). Not part of the library's interface.
//
// Thread safety: the fields are guarded by Cluster::mu_ unless marked otherwise.
#ifndef BERTSHARD_SERVER_CLUSTER_INTERNAL_H_
#define BERTSHARD_SERVER_CLUSTER_INTERNAL_H_

#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "bertshard/v1/job.pb.h"
#include "bertshard/v1/worker.grpc.pb.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "server/cluster.h"
#include "server/job_serving.h"
#include "server/rank_fanout.h"
#include "server/readoption.h"

namespace bertshard::server {

inline bool TerminalState(v1::JobState s) { return s == v1::FAILED || s == v1::CANCELLED; }

struct Cluster::Worker {
  v1::WorkerInfo info;
  std::shared_ptr<v1::Worker::Stub> stub;
  std::shared_ptr<grpc::health::v1::Health::Stub> health;  // the same channel
  absl::Time last_heartbeat;
};

// A READY or LOADING job from the database, waiting for its ranks after a restart.
struct Cluster::Recovery {
  absl::Time deadline;
  bool was_loading = false;
  std::vector<v1::RankAssignment> previous;  // the ranks as stored before the restart
  std::vector<RankReport> reports;           // held shards reported since
  std::set<int> lost;                        // ranks whose previous worker came back without them
};

// Guarded by Cluster::mu_.
struct Cluster::JobRuntime {
  v1::ShardPlan plan;
  std::string checkpoint;
  std::string backend = "gloo";  // "gloo" (CPU workers) or "nccl" (one rank per GPU)
  // Said before what a PENDING job waits for in its pending reason (why it is PENDING again).
  std::string pending_note;
  std::vector<std::string> rank_workers;
  std::vector<v1::RankProgress> progress;
  std::vector<std::shared_ptr<grpc::ClientContext>> load_contexts;
  std::unique_ptr<Recovery> recovery;  // set while recovering after a restart
  // The next forward's number. Advanced only by the batch queue's thread (one forward at a time, so
  // every rank sees one order), and set by recovery before the job serves again.
  int64_t next_sequence = 0;
  // READY and not recovering: what the stored job says, kept here so that serving a request needs
  // no database read. Set where the job becomes READY (loaded, or adopted after a restart), cleared
  // when it fails or is cancelled (FailJobLocked).
  bool serving = false;
  // Serves its Infer/Embed calls; made on the first call, closed (and released off the lock) when
  // the job ends.
  std::shared_ptr<JobServing> job_serving;
  // Ends the forward in flight when the job fails elsewhere (FailJobLocked), instead of letting it
  // wait for the surviving ranks' collective timeout.
  std::shared_ptr<ForwardAbort> forward_abort = std::make_shared<ForwardAbort>();
};

}  // namespace bertshard::server

#endif  // BERTSHARD_SERVER_CLUSTER_INTERNAL_H_
