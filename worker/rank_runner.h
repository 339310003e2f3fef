// File: worker/rank_runner.h
// -----------------------------------------------------------------------------
// One rank process of `shardctl run --local`: loads its shard of the checkpoint as its plan says
// and joins its backend's groups (worker/shard_loader.h, as a worker's rank does), runs one forward
// over the inputs, and writes the outputs (the head stage's TP rank 0) and a report of what it cost
// (timings, peak RSS, checkpoint bytes read).
//
// Thread safety: not thread-safe (one run per process).
#ifndef BERTSHARD_WORKER_RANK_RUNNER_H_
#define BERTSHARD_WORKER_RANK_RUNNER_H_

#include <optional>
#include <string>

#include "absl/status/status.h"
#include "model/gemm_flag.h"

namespace bertshard::worker {

struct RankOptions {
  std::string plan_path;  // ShardPlan, binary protobuf
  int rank = -1;
  std::string master_addr = "127.0.0.1";
  // 0 (rank 0 only, with port_file): host the rendezvous on a port the system picks, bound before
  // anyone learns it, so that nothing can take it before the other ranks arrive.
  int master_port = 0;
  // With master_port 0: where rank 0 writes the port it bound (decimal, then a newline), once bound
  // and before it loads its shard, for the launcher to start the other ranks with. The file appears
  // whole (renamed into place).
  std::string port_file;
  // The run's rendezvous secret, in a 0600 file the launcher made (common/secure_random.h): what
  // every rank proves to rank 0's store. Required.
  std::string secret_file;
  std::string checkpoint;   // HF model directory
  std::string inputs_path;  // normalised inputs written by shardctl (see run_command.h)
  int micro_batches = 1;
  std::string output_path;    // safetensors written by the head stage's TP rank 0
  std::string report_path;    // JSON report of this rank
  int threads = 1;            // LibTorch intra-op threads
  int timeout_seconds = 120;  // rendezvous and collectives
  // Forwards to run (benchmarks), each started by all ranks together; the outputs are the last one's.
  int iterations = 1;
  std::string backend = "gloo";  // "gloo" (CPU) or "nccl" (CUDA; a --config=cuda build)
  // How the linears multiply on CPU; nullopt ("auto"): the faster on this machine, measured at
  // start with `threads` (model::PickGemmPathForPlan). CUDA ignores it.
  std::optional<model::GemmPath> gemm;
  // Gloo backend: TP collectives through shared memory where a stage's ranks share a host.
  bool shared_memory = true;
};

// Errors name what failed; a collective failure is UNAVAILABLE.
absl::Status RunRank(const RankOptions& options);

}  // namespace bertshard::worker

#endif  // BERTSHARD_WORKER_RANK_RUNNER_H_
