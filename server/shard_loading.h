// File: server/shard_loading.h
// -----------------------------------------------------------------------------
// The gRPC calls the scheduler makes to workers, without its locks. To load a job: rank 0's worker
// reserves the rendezvous port, then every rank streams LoadShard at once, reporting progress as
// it comes, and a rank that fails is blamed truthfully (the worker that no longer answers, when
// ranks fail together because one died); the scheduler decides what a failure does to the job.
// When a job ends: its surviving workers are told to unload, in the background.
//
// Example:
//   ASSIGN_OR_RETURN(std::string secret, common::SecureRandomBytes(32));  // per load attempt
//   ASSIGN_OR_RETURN(int32_t port, ReserveRendezvousPort(ranks[0], job_id, secret));
//   bool loaded = LoadShardsOnRanks(ranks, request, contexts, on_progress, on_failure);
//
// Failure model: every call has a deadline (10 s for the port, the contexts' own for the loads).
// A rank's failure is said at once through `on_failure`, from that rank's thread, so that the
// caller can cancel the other ranks' loads (through their contexts) instead of waiting for them.
//
// Thread safety: thread-safe; the callbacks run on the ranks' threads, concurrently.
#ifndef BERTSHARD_SERVER_SHARD_LOADING_H_
#define BERTSHARD_SERVER_SHARD_LOADING_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "bertshard/v1/worker.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "server/rank_fanout.h"

namespace bertshard::server {

// Rank 0's worker hosts the job's rendezvous store on a port of its choosing and keeps it for rank
// 0's load (no port is found free and bound later); only ranks that know `secret` (the load
// attempt's, sent again in every LoadShardRequest) may use it. The error's message is the failure
// cause: "worker ID (rank 0): why".
absl::StatusOr<int32_t> ReserveRendezvousPort(const RankStub& rank0, const std::string& job_id,
                                              const std::string& secret);

// Streams LoadShard(`request` with each rank's number) on every rank in parallel, each under its
// context of `contexts` (deadline and token set, cancellable by the caller), until all have ended.
// `on_progress(rank, progress)` for every message; `on_failure(rank, failure)` once per failed rank,
// the failure's message naming the worker and rank ("... cancelled" when its context was
// cancelled), its code the worker's (UNAVAILABLE when a worker of the job does not answer its
// health check: then that worker is named, Blame, and its id is the failure's
// kUnreachableWorkerPayload). True when every rank loaded.
inline constexpr char kUnreachableWorkerPayload[] = "bertshard.dev/unreachable-worker";
bool LoadShardsOnRanks(const std::vector<RankStub>& ranks, const v1::LoadShardRequest& request,
                       const std::vector<std::shared_ptr<grpc::ClientContext>>& contexts,
                       const std::function<void(size_t rank, const v1::LoadProgress&)>& on_progress,
                       const std::function<void(size_t rank, const absl::Status& failure)>& on_failure);

// Whether a load that failed with `failure` would fail again on any workers: the request or the
// checkpoint is wrong (INVALID_ARGUMENT, NOT_FOUND, UNIMPLEMENTED, DATA_LOSS), not a worker lost or
// out of memory, nor a rendezvous refusing a rank's proof (PERMISSION_DENIED: that attempt's
// mix-up). These codes can also come from one worker's own view (its volume not mounted): such a
// job ends rather than trying other workers.
bool LoadCanNeverSucceed(const absl::Status& failure);

// Tells a worker to drop job `job_id`'s shard and waits for its answer (10 s at most).
grpc::Status UnloadShard(v1::Worker::Stub& stub, const std::string& job_id, const std::string& token);

// Tells a worker to drop job `job_id`'s shard, on a detached thread: the call owns what it uses
// (the stub keeps its channel) and ends by its deadline (10 s); its outcome changes nothing.
void UnloadInBackground(std::shared_ptr<v1::Worker::Stub> stub, const std::string& job_id, const std::string& token);

}  // namespace bertshard::server

#endif  // BERTSHARD_SERVER_SHARD_LOADING_H_
