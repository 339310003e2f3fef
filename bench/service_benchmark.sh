#!/usr/bin/env bash
# Inference through the service vs `shardctl run --local`, TP 2 x PP 2 on this machine, and how
# concurrent requests scale. Model: BertModel with hidden 256, 4 layers, 4 heads, vocab 30522
# (random weights); input batch 8 x seq 128.
#   bash bench/service_benchmark.sh [REQUESTS]
set -euo pipefail
cd "$(dirname "$0")/.."
requests=${1:-8}
bazel build -c opt //client:shardctl //server:bertshard-coordinator //worker:shard-worker //worker:shard-rank >/dev/null 2>&1
shardctl=bazel-bin/client/shardctl
WORK=$(mktemp -d)
work=$WORK
COORDINATOR_BIN=bazel-bin/server/bertshard-coordinator
WORKER_BIN=bazel-bin/worker/shard-worker
source tools/local_cluster.sh
trap 'stop_cluster; rm -rf "$WORK"' EXIT
$shardctl init-checkpoint --variant BertModel --seed 1 --out "$work/model" \
  --config '{"hidden_size": 256, "num_attention_heads": 4, "intermediate_size": 1024, "num_hidden_layers": 4}' >/dev/null
/usr/bin/python3 -c "
import json, random; random.seed(1)
json.dump({'input_ids': [[random.randrange(1000, 30000) for _ in range(128)] for _ in range(8)]}, open('$work/input.json', 'w'))"
now() { date +%s.%N; }

echo "TP 2 x PP 2, BertModel hidden 256 x 4 layers, batch 8 x seq 128, $(nproc) cores"
$shardctl run --local --checkpoint "$work/model" --tp 2 --pp 2 --threads 1 --iterations 6 \
  --input "$work/input.json" --output "$work/local.safetensors" --report "$work/local.json" >/dev/null
/usr/bin/python3 - "$work/local.json" <<'PY'
import json, sys
ranks = json.load(open(sys.argv[1]))
per_iter = [max(r["forward_seconds_all"][i] for r in ranks) for i in range(len(ranks[0]["forward_seconds_all"]))]
steady = per_iter[1:]
print(f"shardctl run --local      forward {1000 * sum(steady) / len(steady):7.1f} ms (mean of {len(steady)}, warm ranks)")
PY

start_coordinator
start_workers 4
for _ in $(seq 100); do [ "$($shardctl workers | grep -c ' yes ')" -ge 4 ] && break; sleep 0.1; done
job=$($shardctl submit --checkpoint "$work/model" --tp 2 --pp 2)
$shardctl watch "$job" >/dev/null
$shardctl infer "$job" --input "$work/input.json" >/dev/null   # warm-up
start=$(now)
for _ in $(seq "$requests"); do $shardctl infer "$job" --input "$work/input.json" > "$work/one.txt"; done
end=$(now)
forward=$(sed -n 's/^forward \([0-9.]*\) s/\1/p' "$work/one.txt")
/usr/bin/python3 -c "
t = ($end - $start) / $requests
print(f'service, sequential        latency {1000 * t:7.1f} ms per request (worker forward {1000 * $forward:.1f} ms; the rest is shardctl start, gRPC, tokens)')"
for clients in 2 4; do
  start=$(now)
  clients_pids=()
  for c in $(seq "$clients"); do
    ( for _ in $(seq "$requests"); do $shardctl infer "$job" --input "$work/input.json" >/dev/null; done ) &
    clients_pids+=($!)
  done
  wait "${clients_pids[@]}"
  end=$(now)
  /usr/bin/python3 -c "
n = $clients * $requests
print(f'service, {$clients} concurrent clients  {n / ($end - $start):6.2f} requests/s ({8 * n / ($end - $start):6.1f} sequences/s)')"
done
