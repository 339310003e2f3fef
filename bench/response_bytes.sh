#!/usr/bin/env bash
# Bytes the workers send back to the coordinator per Embed and per Infer request, on the real
# all-MiniLM-L6-v2 (BertModel, hidden 384) through the service: the BatchInfo.response_bytes that
# //bench:embed_load reports, for one-sentence requests and for 32 texts of 256 tokens each. The
# figures do not depend on the machine's load (latency is bench/serving_benchmark.sh's business).
# Infer on a BertModel job returns the raw outputs (last_hidden_state, pooler_output): what every
# Embed moved before the pooling ran on the workers.
#
#   bash bench/response_bytes.sh   # CONFIGS="1x1 2x2" (TPxPP) by default
set -euo pipefail
cd "$(dirname "$0")/.."
CONFIGS=${CONFIGS:-"1x1 2x2"}
bazel build //client:shardctl //server:bertshard-coordinator //worker:shard-worker //bench:embed_load >/dev/null 2>&1 || {
  echo "response_bytes: build failed; run: bazel build //client:shardctl //server:bertshard-coordinator //worker:shard-worker //bench:embed_load" >&2
  exit 1
}
WORK=$(mktemp -d)
source tools/local_cluster.sh
trap 'stop_cluster >/dev/null 2>&1 || true; rm -rf "$WORK"' EXIT
COORDINATOR_BIN=bazel-bin/server/bertshard-coordinator
WORKER_BIN=bazel-bin/worker/shard-worker
shardctl=bazel-bin/client/shardctl
load=bazel-bin/bench/embed_load
model=$(bash tools/fetch_model.sh all-MiniLM-L6-v2)
echo "The train to the airport leaves every twenty minutes from the second platform." > "$WORK/short.txt"
# 254 one-piece words: [CLS] + 254 + [SEP] = 256 tokens, all-MiniLM-L6-v2's max_seq_length.
python3 -c "print(' '.join(['the'] * 254))" > "$WORK/long.txt"
for config in $CONFIGS; do
  tp=${config%x*}
  pp=${config#*x}
  start_coordinator
  start_workers $((tp * pp))
  for _ in $(seq 100); do
    [ "$($shardctl workers | grep -c ' yes ')" -ge $((tp * pp)) ] && break
    sleep 0.2
  done
  job=$($shardctl submit --checkpoint "$model" --tp "$tp" --pp "$pp")
  $shardctl watch "$job" >/dev/null
  for input in short:1 long:32; do
    for rpc in embed infer; do
      echo "== TP $tp x PP $pp, $rpc, ${input#*:} text(s) per request (${input%%:*})"
      $load --job="$job" --rpc="$rpc" --sentences="$WORK/${input%%:*}.txt" --texts_per_request="${input#*:}" \
        --requests_per_client=3 --warmup=0 | grep -E 'network|requests in'
    done
  done
  $shardctl cancel "$job" >/dev/null
  stop_cluster
done
