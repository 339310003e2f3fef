// shardctl: the bertshard command line.
//
//   shardctl plan [REQUEST.json] [--variant V --tp N --pp N --pp-style S --chunks N
//                 --sp-mode M --config FILE|JSON --checkpoint DIR ...]
//                 [--local | --server HOST:PORT] [--output table|json|dot] [--batch FILE.jsonl]
//
// Exit status: 0 ok, 1 the coordinator could not be reached or output failed, 2 invalid input.
#include <cstdio>
#include <set>
#include <string>
#include <vector>

#include "client/cluster_commands.h"
#include "client/command_line.h"
#include "client/init_checkpoint.h"
#include "client/plan_command.h"
#include "client/run_command.h"

namespace {

constexpr char kUsage[] = R"(usage: shardctl plan [REQUEST.json] [flags]
       shardctl run --local --checkpoint DIR --input FILE.json --output FILE.safetensors [flags]
       shardctl init-checkpoint --variant V [--config JSON] [--seed N] --out DIR

plan: how a BERT model is sharded over tensor- and pipeline-parallel ranks.
run: the sharded forward, one process per rank on this machine (Gloo on loopback); --tp, --pp,
  --pp-style, --chunks, --sp-mode as for plan, plus --micro-batches M, --threads T (per rank),
  --gemm auto|blas|onednn (CPU matrix products: OpenBLAS via at::linear, or oneDNN with weights
  prepacked at load; auto, the default, times both in each rank and takes the faster),
  --tp-transport auto|gloo (tensor-parallel collectives: auto, the default, goes through shared
  memory between ranks that share a host; gloo always uses Gloo's TCP),
  --backend gloo, --timeout SECONDS, --rank-binary PATH. Prints per-rank load/forward time, peak
  RSS, checkpoint bytes read and GEMM path; writes the outputs (float32, HF names).
init-checkpoint: a randomly initialised HF model directory (config.json + model.safetensors).

On a coordinator (--server HOST:PORT, default $BERTSHARD_SERVER or 127.0.0.1:50051; --token-file F,
default $BERTSHARD_TOKEN: the bearer token a coordinator with tokens needs; --tls-ca F [--tls-cert F
--tls-key F], default $BERTSHARD_TLS_CA/_CERT/_KEY: TLS, with a client certificate for mutual TLS):
  shardctl submit --checkpoint DIR [--tp N --pp N ...] [--backend gloo|nccl] [--watch] [--no-wait]
      prints the job id; --backend nccl: GPU workers (shard-worker --device=cuda:N), one rank per GPU
      --watch: then print its states until it settles: READY exits 0, FAILED 1 with the cause
      --no-wait: refuse the job (FAILED_PRECONDITION, exit 1) instead of queueing it PENDING when
        too few workers are idle; submit never waits for loading without --watch
  shardctl jobs | job ID | watch ID | cancel ID | workers
  shardctl infer ID --text "..." [--text-pair "..."] | --input FILE.json [--output FILE.safetensors]
                 [--top-k K] [--truncate] [--micro-batches M]
      prints the input_ids the model ran on (and token_type_ids for a pair), the head's predictions
      (top-k tokens per [MASK], labels with scores, the answer span) and the outputs' shapes;
      --output writes the raw tensors
  shardctl embed ID "text" ["text" ...] | --file FILE|- | --input FILE.json [--pooling mean|cls|max|
                 mean_sqrt_len] [--normalize true|false] [--truncate] [--format table|json]
      one vector per text (a BertModel job), pooled as the checkpoint's sentence-transformers files
      say unless overridden; the table ends with the texts' cosine-similarity matrix

Request (a JSON file in the plan contract's format, and/or flags; flags win):
  --request FILE            PlanRequest JSON (same as the positional REQUEST.json)
  --variant NAME            BertModel, BertForPreTraining, BertLMHeadModel, BertForMaskedLM,
                            BertForNextSentencePrediction, BertForSequenceClassification,
                            BertForTokenClassification, BertForMultipleChoice,
                            BertForQuestionAnswering (or BERT_FOR_MASKED_LM style names)
  --config FILE|JSON        HuggingFace config.json fields (a file, or inline JSON)
  --checkpoint DIR          HuggingFace model directory; its config.json fills config and variant
  --tp N                    tensor parallel size (1: off)
  --pp N                    pipeline stages (1: no pipeline)
  --pp-style S              1f1b (default), interleaved, zbv
  --chunks N                model chunks per stage (interleaved: > 1; zbv: 2)
  --layers-per-stage A,B,.. explicit layer count per pipeline slot (stages x chunks)
  --sp-mode M               none, split_gather, ring (all_to_all, ring_attn are refused)
  --vocab-multiple N        make_vocab_size_divisible_by (default 64)
  --dtype D                 fp32 (default), bf16 or fp16: the dtype ranks hold weights and compute
                            in (converted at load from any float checkpoint; outputs stay float32;
                            param bytes follow it). fp16 needs CUDA: a CPU rank refuses it
  --fused-norm --jit-fused --all-optimization --fp8

Where and how:
  --local                   plan in this process (the default without --server)
  --server HOST:PORT        ask a bertshard coordinator
  --timeout SECONDS         deadline of each call to the coordinator (default 30)
  --output table|json|dot   readable summary (default), contract JSON, Graphviz diagram
  --batch FILE.jsonl        with --output json: one request per line ('-' for stdin), one JSON
                            line per request: the plan or {"error": {"code", "message"}}

Exit status: 0 ok, 1 coordinator unreachable, job failed or output error, 2 invalid request or
usage, 3 unknown job.
)";

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty() || args[0] == "help" || args[0] == "--help" || args[0] == "-h") {
    std::fputs(kUsage, args.empty() ? stderr : stdout);
    return args.empty() ? bertshard::client::kExitInvalidInput : bertshard::client::kExitOk;
  }
  namespace client = bertshard::client;
  const std::set<std::string> no_switches = {"help"};
  const std::set<std::string>* value_flags = nullptr;
  const std::set<std::string>* switch_flags = nullptr;
  if (args[0] == "plan") {
    value_flags = &client::PlanValueFlags();
    switch_flags = &client::PlanSwitchFlags();
  } else if (args[0] == "run") {
    value_flags = &client::RunValueFlags();
    switch_flags = &client::RunSwitchFlags();
  } else if (args[0] == "init-checkpoint") {
    value_flags = &client::InitCheckpointValueFlags();
    switch_flags = &no_switches;
  } else if (client::IsClusterCommand(args[0])) {
    value_flags = &client::ClusterValueFlags(args[0]);
    switch_flags = &client::ClusterSwitchFlags(args[0]);
  } else {
    std::fprintf(stderr,
                 "shardctl: unknown command '%s'; commands: plan, run, init-checkpoint, submit, jobs, job, "
                 "watch, cancel, workers, infer (see shardctl --help)\n",
                 args[0].c_str());
    return client::kExitInvalidInput;
  }
  auto command_line = client::ParseCommandLine(args, *value_flags, *switch_flags);
  if (!command_line.ok()) {
    std::fprintf(stderr, "shardctl: %s (see shardctl --help)\n", std::string(command_line.status().message()).c_str());
    return bertshard::client::kExitInvalidInput;
  }
  if (command_line->switches.count("help")) {
    std::fputs(kUsage, stdout);
    return bertshard::client::kExitOk;
  }
  if (args[0] == "run") return client::RunRunCommand(*command_line, stdout, stderr);
  if (args[0] == "init-checkpoint") return client::RunInitCheckpointCommand(*command_line, stdout, stderr);
  if (client::IsClusterCommand(args[0])) return client::RunClusterCommand(*command_line, stdout, stderr);
  return client::RunPlanCommand(*command_line, stdout, stderr);
}
