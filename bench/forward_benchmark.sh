#!/usr/bin/env bash
# Sharded forward throughput on this machine: BERT-base shape (BertModel, random weights), seq 128,
# batch 8. Compares the unsharded model (1 process, 2 LibTorch threads) with TP 2 (2 processes x 1
# thread) and PP 2 (2 processes x 1 thread, micro-batches), and prints throughput, peak RSS per
# rank and shard load time. Each configuration runs with each GEMM path: --gemm blas (OpenBLAS via
# at::linear), --gemm onednn (MKL-DNN, weights prepacked at load) and --gemm auto (each rank times
# both at start and takes the faster; its pick and the figures it picked on are shown). Each run
# does ITERATIONS forwards; the first is warm-up.
#   bash bench/forward_benchmark.sh [ITERATIONS]
set -euo pipefail
cd "$(dirname "$0")/.."
iterations=${1:-6}
bazel build -c opt //client:shardctl //worker:shard-rank >/dev/null 2>&1
shardctl=bazel-bin/client/shardctl
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
$shardctl init-checkpoint --variant BertModel --seed 1 --out "$work/bert-base" >/dev/null
/usr/bin/env python3 - "$work/input.json" <<'PY' 2>/dev/null || \
  awk 'BEGIN{srand(1); printf "{\"input_ids\": ["; for(b=0;b<8;b++){printf "%s[", (b?",":""); for(s=0;s<128;s++) printf "%s%d", (s?",":""), 1000+int(rand()*29000); printf "]"} print "]}"}' > "$work/input.json"
import json, random, sys
random.seed(1)
json.dump({"input_ids": [[random.randrange(1000, 30000) for _ in range(128)] for _ in range(8)]}, open(sys.argv[1], "w"))
PY
run() {  # name, flags...
  local name=$1; shift
  local gemm
  for gemm in blas onednn auto; do
    $shardctl run --local --checkpoint "$work/bert-base" --input "$work/input.json" \
      --output "$work/out.safetensors" --report "$work/run.json" --iterations "$iterations" --gemm "$gemm" "$@" >/dev/null
    /usr/bin/env python3 - "$work/run.json" "$name" "$gemm" <<'PY' 2>/dev/null || cat "$work/run.json"
import json, sys
ranks = json.load(open(sys.argv[1]))
name, gemm = sys.argv[2], sys.argv[3]
# Forward time of the pipeline = the slowest rank's, per iteration; drop the warm-up.
per_iter = [max(r["forward_seconds_all"][i] for r in ranks) for i in range(len(ranks[0]["forward_seconds_all"]))]
steady = per_iter[1:] or per_iter
mean = sum(steady) / len(steady)
line = (f"{name if gemm == 'blas' else '':<28} {gemm:<7} {8 / mean:8.2f} seq/s  forward {mean * 1000:7.1f} ms  "
        f"peak RSS {max(r['peak_rss_bytes'] for r in ranks) / 2**20:7.1f} MiB/rank  "
        f"load {max(r['load_seconds'] for r in ranks):5.2f} s  "
        f"read {sum(r['checkpoint_bytes_read'] for r in ranks) / 2**20:6.1f} MiB")
if gemm == "auto":
    picks = [f"rank {r['rank']}: {r['gemm']} (" +
             ", ".join(f"{k} {v:.1f}" for k, v in r.get("gemm_gflops", {}).items()) + " GFLOP/s)" for r in ranks]
    line += "\n" + " " * 37 + "picked " + "; ".join(picks)
print(line)
PY
  done
}
echo "BERT-base (BertModel), seq 128, batch 8, $(nproc) cores, ${iterations} forwards (first dropped)"
run "unsharded 1 proc x 2 thr" --threads 2
run "tp 2: 2 procs x 1 thr" --tp 2 --threads 1
run "pp 2: 2 procs x 1 thr, mb 4" --pp 2 --micro-batches 4 --threads 1
run "pp 2: 2 procs x 1 thr, mb 8" --pp 2 --micro-batches 8 --threads 1
run "tp 2 split_gather" --tp 2 --sp-mode split_gather --threads 1
