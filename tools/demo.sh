#!/usr/bin/env bash
# The main job, on this machine: a local embedded cluster -- a coordinator and four CPU workers
# on loopback (Gloo) -- serving a small random BERT (BertForMaskedLM with the real
# bert-base-uncased vocabulary) sharded TP 2 x PP 2: submit, wait until ready, infer from text,
# print the outputs and the plan, and shut everything down cleanly (SIGTERM, drain).
# Works on a fresh Debian 12 machine (installs what it needs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install_deps.sh
targets="//client:shardctl //server:bertshard-coordinator //worker:shard-worker //worker:shard-rank"
bazel build $targets >/dev/null 2>&1 || bazel build $targets

WORK=$(mktemp -d)
COORDINATOR_BIN=bazel-bin/server/bertshard-coordinator
WORKER_BIN=bazel-bin/worker/shard-worker
source tools/local_cluster.sh
trap 'stop_cluster; rm -rf "$WORK"' EXIT
shardctl=bazel-bin/client/shardctl

start_coordinator
echo "== coordinator on ${BERTSHARD_SERVER}; starting 4 workers"
start_workers 4
for _ in $(seq 100); do
  [ "$($shardctl workers | grep -c ' yes ')" -ge 4 ] && break
  sleep 0.1
done
$shardctl workers

echo "== a small random BertForMaskedLM with the bert-base-uncased vocabulary"
$shardctl init-checkpoint --variant BertForMaskedLM --seed 1 --out "$WORK/model" \
  --vocab tests/testdata/vocab/bert-base-uncased-vocab.txt \
  --config '{"hidden_size": 128, "num_attention_heads": 4, "intermediate_size": 512, "num_hidden_layers": 4}'

echo "== the plan: TP 2 x PP 2"
$shardctl plan --checkpoint "$WORK/model" --tp 2 --pp 2 | sed -n '1,/^module policy/p'

echo "== submit and watch it load"
job=$($shardctl submit --checkpoint "$WORK/model" --tp 2 --pp 2)
echo "job $job"
$shardctl watch "$job"

echo "== infer from text"
$shardctl infer "$job" --text "The capital of France is [MASK]."
$shardctl jobs

echo "== shutting down"
$shardctl cancel "$job"
stop_cluster
echo "== coordinator and workers stopped cleanly"
