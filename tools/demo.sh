#!/usr/bin/env bash
# The main job, on this machine: builds bertshard, starts a coordinator on loopback, asks it to
# plan examples/plan_request.json (BERT-base BertForMaskedLM, TP 2 x PP 2 interleaved, sequence
# parallel), prints the plan, shuts the coordinator down with SIGTERM (graceful drain), then runs
# that sharding for real on a small random BERT: four rank processes over Gloo on loopback.
# Works on a fresh Debian 12 machine (installs what it needs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install_deps.sh
targets="//client:shardctl //server:bertshard-coordinator //worker:shard-rank"
bazel build $targets >/dev/null 2>&1 || bazel build $targets

out=$(mktemp)
bazel-bin/server/bertshard-coordinator --listen=127.0.0.1:0 >"$out" &
coordinator=$!
trap 'kill "$coordinator" 2>/dev/null || true; rm -f "$out"' EXIT
port=""
for _ in $(seq 100); do
  port=$(sed -n 's/.*listening on port \([0-9]*\).*/\1/p' "$out")
  [ -n "$port" ] && break
  sleep 0.1
done
[ -n "$port" ] || { echo "demo: coordinator did not start" >&2; exit 1; }
echo "== coordinator on 127.0.0.1:${port}; planning examples/plan_request.json"
bazel-bin/client/shardctl plan examples/plan_request.json --server "127.0.0.1:${port}"
echo "== the same plan as Graphviz (first lines):"
bazel-bin/client/shardctl plan examples/plan_request.json --server "127.0.0.1:${port}" --output dot >"$out.dot"
head -8 "$out.dot"
rm -f "$out.dot"
echo "== an invalid request is refused:"
bazel-bin/client/shardctl plan --variant BertModel --tp 5 --server "127.0.0.1:${port}" || echo "(exit status $?)"
kill -TERM "$coordinator"
wait "$coordinator"
trap - EXIT
rm -f "$out"
echo "== coordinator drained and stopped"

echo "== a sharded forward: TP 2 x PP 2 interleaved, split_gather, on a small random BertForMaskedLM"
ckpt=$(mktemp -d)
trap 'rm -rf "$ckpt"' EXIT
bazel-bin/client/shardctl init-checkpoint --variant BertForMaskedLM --seed 1 --out "$ckpt/model" \
  --config '{"hidden_size": 128, "num_attention_heads": 4, "intermediate_size": 512, "num_hidden_layers": 4}'
echo '{"input_ids": [[101, 7592, 1010, 2088, 999, 102, 0, 0]], "attention_mask": [[1, 1, 1, 1, 1, 1, 0, 0]]}' >"$ckpt/input.json"
bazel-bin/client/shardctl run --local --checkpoint "$ckpt/model" --tp 2 --pp 2 --pp-style interleaved \
  --chunks 2 --sp-mode split_gather --input "$ckpt/input.json" --output "$ckpt/out.safetensors"
