#!/usr/bin/env bash
# The main job, on this machine: builds bertshard, starts a coordinator on loopback, asks it to
# plan examples/plan_request.json (BERT-base BertForMaskedLM, TP 2 x PP 2 interleaved, sequence
# parallel), prints the plan, and shuts the coordinator down with SIGTERM (graceful drain).
# Works on a fresh Debian 12 machine (installs what it needs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install_deps.sh
bazel build //client:shardctl //server:bertshard-coordinator >/dev/null 2>&1 ||
  bazel build //client:shardctl //server:bertshard-coordinator

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
