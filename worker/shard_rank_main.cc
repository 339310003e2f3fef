// shard-rank: one rank process of a sharded BERT forward, started by `shardctl run --local`
// (spawn + exec, one per rank: rank 0 first, with --master_port=0 --port_file, and the others once
// it has written the port it bound). Exits 0 on success, 2 on a bad flag value; otherwise prints
// the error and exits 1, and the launcher stops the other ranks.
#include <cstdio>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "model/gemm_flag.h"
#include "worker/rank_runner.h"
#include "worker/shm_group.h"

ABSL_FLAG(std::string, plan, "", "ShardPlan (binary protobuf)");
ABSL_FLAG(int, rank, -1, "global rank = stage * tp_size + tp_rank");
ABSL_FLAG(std::string, master_addr, "127.0.0.1",
          "rendezvous host (rank 0 hosts the store there, on that address only)");
ABSL_FLAG(std::string, rendezvous_secret_file, "",
          "the run's rendezvous secret, hex in a 0600 file (shardctl run --local makes it); required");
ABSL_FLAG(int, master_port, 0,
          "rendezvous port; 0 (rank 0 only, with --port_file): one the system picks, bound at once");
ABSL_FLAG(std::string, port_file, "",
          "with --master_port=0: rank 0 writes the port it bound here, for the launcher to start the "
          "other ranks with");
ABSL_FLAG(std::string, checkpoint, "", "HuggingFace model directory");
ABSL_FLAG(std::string, inputs, "", "normalised inputs JSON");
ABSL_FLAG(int, micro_batches, 1, "micro-batches per forward");
ABSL_FLAG(std::string, output, "", "outputs safetensors (written by the head stage's TP rank 0)");
ABSL_FLAG(std::string, report, "", "JSON report of this rank");
ABSL_FLAG(int, threads, 1, "LibTorch intra-op threads");
ABSL_FLAG(int, timeout_s, 120, "rendezvous and collective timeout, seconds");
ABSL_FLAG(int, iterations, 1, "forwards to run (benchmarks)");
ABSL_FLAG(std::string, backend, "gloo", "gloo (CPU) or nccl (CUDA, --config=cuda builds)");
ABSL_FLAG(std::string, gemm, "auto",
          "CPU matrix products: blas (at::linear), onednn (MKL-DNN, weights prepacked at load), or auto "
          "(time both at start with --threads, take the faster)");

ABSL_FLAG(std::string, tp_transport, "auto",
          "tensor-parallel collectives: auto (shared memory where a stage's ranks share a host, else "
          "Gloo) or gloo");

namespace bertshard::worker {
namespace {

// The flags' values, checked: INVALID_ARGUMENT naming the bad one.
absl::StatusOr<RankOptions> RankOptionsFromFlags() {
  RankOptions options;
  options.plan_path = absl::GetFlag(FLAGS_plan);
  options.rank = absl::GetFlag(FLAGS_rank);
  options.master_addr = absl::GetFlag(FLAGS_master_addr);
  options.master_port = absl::GetFlag(FLAGS_master_port);
  options.port_file = absl::GetFlag(FLAGS_port_file);
  options.secret_file = absl::GetFlag(FLAGS_rendezvous_secret_file);
  options.checkpoint = absl::GetFlag(FLAGS_checkpoint);
  options.inputs_path = absl::GetFlag(FLAGS_inputs);
  options.micro_batches = absl::GetFlag(FLAGS_micro_batches);
  options.output_path = absl::GetFlag(FLAGS_output);
  options.report_path = absl::GetFlag(FLAGS_report);
  options.threads = absl::GetFlag(FLAGS_threads);
  options.timeout_seconds = absl::GetFlag(FLAGS_timeout_s);
  options.iterations = absl::GetFlag(FLAGS_iterations);
  options.backend = absl::GetFlag(FLAGS_backend);
  const std::string tp_transport = absl::GetFlag(FLAGS_tp_transport);
  if (tp_transport != "auto" && tp_transport != "gloo") {
    return absl::InvalidArgumentError(absl::StrCat("--tp_transport must be auto or gloo, not ", tp_transport));
  }
  options.shared_memory = tp_transport == "auto";
  ASSIGN_OR_RETURN(options.gemm, model::ParseGemmFlag(absl::GetFlag(FLAGS_gemm)));
  return options;
}

}  // namespace
}  // namespace bertshard::worker

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const absl::StatusOr<bertshard::worker::RankOptions> options = bertshard::worker::RankOptionsFromFlags();
  if (!options.ok()) {
    std::fprintf(stderr, "shard-rank %d: %s\n", absl::GetFlag(FLAGS_rank),
                 std::string(options.status().message()).c_str());
    return 2;
  }
  // Rank 0 of each run clears what killed runs left in /dev/shm (worker/shm_group.h): only this
  // user's segments whose creator is gone.
  if (options->rank == 0) {
    if (const absl::StatusOr<int> swept = bertshard::worker::SweepStaleSegments(); !swept.ok()) {
      std::fprintf(stderr, "shard-rank 0: %s\n", swept.status().ToString().c_str());
    }
  }
  const absl::Status status = bertshard::worker::RunRank(*options);
  if (!status.ok()) {
    std::fprintf(stderr, "shard-rank %d: %s\n", options->rank, status.ToString().c_str());
    return 1;
  }
  return 0;
}
