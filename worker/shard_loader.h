// File: worker/shard_loader.h
// -----------------------------------------------------------------------------
// How a rank becomes ready to forward, the same for a worker daemon's LoadShard (shard-worker)
// and a `shardctl run --local` rank process (shard-rank): open the checkpoint (confined to the
// model root), load the rank's shard of it as the plan says (model::BertShard::Load, reporting
// progress), then join the job's rendezvous and build its collectives for the backend
// (worker/collectives_backend.h).
//
// Example:
//   ASSIGN_OR_RETURN(LoadedShard loaded,
//                    LoadAndConnect(plan, /*rank=*/1,
//                                   {.checkpoint = "models/bert-base",
//                                    .collectives = {.rendezvous = {.master_addr = "10.0.0.7",
//                                                                   .master_port = 29500}}}));
//   ASSIGN_OR_RETURN(auto outputs, loaded.shard->Forward(inputs, 1, loaded.collectives.comm.get()));
//
// Errors: a backend this build cannot connect is refused first (CheckBackend); a checkpoint outside the model root, or
// one that is not there, is INVALID_ARGUMENT (the request's fault); the load's errors as BertShard::Load's (CANCELLED
// when `progress` says stop); the backend's as ConnectCollectives's (UNAVAILABLE when peers do not arrive in time).
//
// Thread safety: thread-safe; each call loads a shard of its own (LibTorch's thread count is the
// caller's to set, worker/math_threads.h).
#ifndef BERTSHARD_WORKER_SHARD_LOADER_H_
#define BERTSHARD_WORKER_SHARD_LOADER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "bertshard/v1/plan.pb.h"
#include "common/model_root.h"
#include "model/bert_shard.h"
#include "worker/collectives_backend.h"

namespace bertshard::worker {

struct ShardLoadOptions {
  std::string checkpoint;              // HuggingFace model directory, as the caller names it
  common::ModelRoot model_root;        // where it must lie (common/model_root.h); unconfined by default
  model::BertShard::LoadOptions load;  // device, GEMM path, progress callback
  // The backend and the rendezvous; the rank, world size and TP size are taken from the plan.
  CollectivesOptions collectives;
  // Called once the shard is loaded, before the rank joins its groups (a worker reports the
  // CONNECTING phase here).
  std::function<void(const model::BertShard&)> loaded;
};

struct LoadedShard {
  std::unique_ptr<model::BertShard> shard;
  ConnectedCollectives collectives;
  uint64_t checkpoint_bytes_read = 0;  // what the load read of the checkpoint's files
};

// Rank `rank` of `plan`, loaded and connected (see above).
absl::StatusOr<LoadedShard> LoadAndConnect(const v1::ShardPlan& plan, int rank, const ShardLoadOptions& options);

}  // namespace bertshard::worker

#endif  // BERTSHARD_WORKER_SHARD_LOADER_H_
