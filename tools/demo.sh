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

work=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
shardctl=bazel-bin/client/shardctl

bazel-bin/server/bertshard-coordinator --listen=127.0.0.1:0 --data_dir="$work/coordinator" >"$work/coordinator.log" 2>&1 &
pids+=($!)
port=""
for _ in $(seq 100); do
  port=$(sed -n 's/.*listening on port \([0-9]*\).*/\1/p' "$work/coordinator.log")
  [ -n "$port" ] && break
  sleep 0.1
done
[ -n "$port" ] || { cat "$work/coordinator.log" >&2; exit 1; }
export BERTSHARD_SERVER="127.0.0.1:${port}"
echo "== coordinator on ${BERTSHARD_SERVER}; starting 4 workers"
for i in 1 2 3 4; do
  bazel-bin/worker/shard-worker --listen=127.0.0.1:0 --coordinator="$BERTSHARD_SERVER" --threads=1 \
    >"$work/worker$i.log" 2>&1 &
  pids+=($!)
done
for _ in $(seq 100); do
  [ "$($shardctl workers | grep -c ' yes ')" -ge 4 ] && break
  sleep 0.1
done
$shardctl workers

echo "== a small random BertForMaskedLM with the bert-base-uncased vocabulary"
$shardctl init-checkpoint --variant BertForMaskedLM --seed 1 --out "$work/model" \
  --vocab tests/testdata/vocab/bert-base-uncased-vocab.txt \
  --config '{"hidden_size": 128, "num_attention_heads": 4, "intermediate_size": 512, "num_hidden_layers": 4}'

echo "== the plan: TP 2 x PP 2"
$shardctl plan --checkpoint "$work/model" --tp 2 --pp 2 | sed -n '1,/^module policy/p'

echo "== submit and watch it load"
job=$($shardctl submit --checkpoint "$work/model" --tp 2 --pp 2)
echo "job $job"
$shardctl watch "$job"

echo "== infer from text"
$shardctl infer "$job" --text "The capital of France is [MASK]."
$shardctl jobs

echo "== shutting down"
$shardctl cancel "$job"
for p in "${pids[@]}"; do kill -TERM "$p"; done
for p in "${pids[@]}"; do wait "$p"; done
pids=()
echo "== coordinator and workers stopped cleanly"
