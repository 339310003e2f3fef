#include "worker/shard_loader.h"

#include <algorithm>
#include <utility>

#include "checkpoint/checkpoint.h"
#include "common/checkpoint_dir.h"
#include "common/status_macros.h"

namespace bertshard::worker {

absl::StatusOr<LoadedShard> LoadAndConnect(const v1::ShardPlan& plan, int rank, const ShardLoadOptions& options) {
  RETURN_IF_ERROR(CheckBackend(options.collectives.backend));  // before anything is read
  // Opened once (confined to the model root) and read only through that descriptor: the weights
  // mapped are the files that were checked (common/checkpoint_dir.h).
  ASSIGN_OR_RETURN(const std::shared_ptr<const common::CheckpointDir> directory,
                   common::CheckpointDir::Open(options.model_root, options.checkpoint));
  auto checkpoint = checkpoint::Checkpoint::Open(*directory);
  if (!checkpoint.ok()) {
    const absl::Status& s = checkpoint.status();
    // A path the rank cannot see is the request's fault.
    return s.code() == absl::StatusCode::kNotFound ? absl::InvalidArgumentError(s.message()) : s;
  }
  LoadedShard loaded;
  ASSIGN_OR_RETURN(loaded.shard, model::BertShard::Load(plan, rank, **checkpoint, options.load));
  loaded.checkpoint_bytes_read = (*checkpoint)->bytes_read();
  if (options.loaded) options.loaded(*loaded.shard);

  CollectivesOptions collectives = options.collectives;
  collectives.rendezvous.rank = rank;
  collectives.rendezvous.world_size = plan.world_size();
  collectives.tp_size = std::max(1, plan.shard_config().tensor_parallel_size());
  ASSIGN_OR_RETURN(loaded.collectives, ConnectCollectives(collectives));
  return loaded;
}

}  // namespace bertshard::worker
