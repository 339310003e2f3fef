#!/usr/bin/env bash
# Serving benchmark on the real all-MiniLM-L6-v2 (BertModel, 6 layers, hidden 384): concurrent
# one-sentence Embed requests through the service (persistent gRPC clients, //bench:embed_load)
# against one local forward of the same sentences as one batch (`shardctl run --local`), for an
# unsharded job (cores threads, and 1 thread) and for TP 2 x PP 2, one job at a time. Writes
# bench/results/serving-<date>.md and prints it; takes about 5 minutes on 2 cores.
#
#   bash bench/serving_benchmark.sh
#
# Environment: DURATION (measured seconds per service run, default 12), ITERATIONS (local forwards
# per baseline, default 40: two runs of 20, right before and after the service run), CONFIGS (default "1x1 1x1:1 2x2": TPxPP, or
# TPxPP:THREADS for THREADS LibTorch threads per rank),
# BATCH_FLAGS (extra coordinator flags, e.g. "--max_batch_delay_ms=2"), THREADS (LibTorch threads
# per rank, locally and on the workers; default cores / ranks, at least 1), BLAS_ENV (see
# start_workers_threads), WORKER_ENV (extra VAR=VALUE words for the workers' environment, e.g.
# "OMP_WAIT_POLICY=PASSIVE"), RESULTS (output file).
#
# Targets (figures, not asserts; the exit status is 0 unless something fails):
#   throughput: 16 concurrent one-sentence clients >= 70% of 16 / (local forward of the 16 batched)
#   latency:    one client alone, p50 <= 1.1 x local forward of that sentence + 3 ms
set -euo pipefail
cd "$(dirname "$0")/.."
DURATION=${DURATION:-12}
ITERATIONS=${ITERATIONS:-40}
CONFIGS=${CONFIGS:-"1x1 1x1:1 2x2"}
BATCH_FLAGS=${BATCH_FLAGS:-}
BLAS_ENV=${BLAS_ENV:-1}
CLIENT_COUNTS=(1 4 16)
RESULTS=${RESULTS:-bench/results/serving-$(date +%Y-%m-%d).md}

echo "serving_benchmark: building (-c opt)" >&2
bazel build -c opt //client:shardctl //server:bertshard-coordinator //worker:shard-worker //worker:shard-rank \
  //bench:embed_load >/dev/null 2>&1 || {
  echo "serving_benchmark: build failed; run: bazel build -c opt //client:shardctl //server:bertshard-coordinator //worker:shard-worker //worker:shard-rank //bench:embed_load" >&2
  exit 1
}
WORK=$(mktemp -d)
work=$WORK
source tools/local_cluster.sh
monitor_pid=
trap 'stop_cluster >/dev/null 2>&1 || true; [ -z "$monitor_pid" ] || kill "$monitor_pid" 2>/dev/null || true; rm -rf "$WORK"' EXIT
# Private copies of the opt binaries: a later build (any config) moves bazel-bin, and may rewrite
# them, while this runs. shard-rank sits next to shardctl, where `run --local` looks for it.
mkdir -p "$work/bin"
for b in client/shardctl worker/shard-rank worker/shard-worker server/bertshard-coordinator bench/embed_load; do
  cp "bazel-out/k8-opt/bin/$b" "$work/bin/"
done
shardctl=$work/bin/shardctl
load=$work/bin/embed_load
COORDINATOR_BIN=$work/bin/bertshard-coordinator
WORKER_BIN=$work/bin/shard-worker
model=$(bash tools/fetch_model.sh all-MiniLM-L6-v2)
python=$(bash tools/python_env.sh hf)/bin/python
cores=$(nproc)
cpu=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n 1)
# Share of the CPUs busy before the run, and the CPU other processes use while it runs.
BENCH_NAME=serving_benchmark
source bench/cpu_watch.sh  # (the script runs from the repo root)

# Like local_cluster.sh's start_coordinator, with the batching flags.
start_batching_coordinator() {
  # shellcheck disable=SC2086
  "$COORDINATOR_BIN" --listen=127.0.0.1:0 --data_dir="$WORK/coordinator" $BATCH_FLAGS \
    >"$WORK/coordinator.log" 2>&1 &
  CLUSTER_PIDS+=($!)
  local port
  port=$(wait_for_port "$WORK/coordinator.log") || return 1
  export BERTSHARD_SERVER="127.0.0.1:${port}"
}

# Like local_cluster.sh's start_workers (which gives each worker one thread), with THREADS
# LibTorch threads per worker: the same threads per rank as the local baseline. `shardctl run`
# also sets OMP_NUM_THREADS and OPENBLAS_NUM_THREADS to that for its ranks; the worker daemon does
# not (its --threads sets LibTorch's intra-op threads only, while OpenBLAS keeps a pool as large
# as the machine, which spins between GEMMs), so with BLAS_ENV=1 (the default) the workers get
# the same environment; BLAS_ENV=0 starts them as tools/local_cluster.sh does.
start_workers_threads() {
  local count=$1 threads=$2
  local env=()
  [ "$BLAS_ENV" = 0 ] || env=(OMP_NUM_THREADS="$threads" OPENBLAS_NUM_THREADS="$threads")
  env+=(${WORKER_ENV:-})
  for i in $(seq "$count"); do
    env "${env[@]}" "$WORKER_BIN" --listen=127.0.0.1:0 --coordinator="$BERTSHARD_SERVER" --threads="$threads" \
      >"$WORK/worker$i.log" 2>&1 &
    CLUSTER_PIDS+=($!)
  done
  for _ in $(seq 200); do
    [ "$($shardctl workers | grep -c ' yes ')" -ge "$count" ] && return 0
    sleep 0.1
  done
  echo "serving_benchmark: workers did not register" >&2
  return 1
}

# 16 everyday sentences, 8-25 words. The first alone is the one-client input, the first 4 the
# four-client input; their lengths are near the set's.
cp bench/sentences-16.txt "$work/sentences.txt"
for n in "${CLIENT_COUNTS[@]}"; do head -n "$n" "$work/sentences.txt" > "$work/sentences-$n.txt"; done
# Token ids as the service's tokenizer makes them (HF BertTokenizerFast of the checkpoint), each
# batch padded to its longest sentence, as the coordinator's batcher pads a merged batch.
"$python" - "$model" "$work" "${CLIENT_COUNTS[@]}" <<'PY'
import json, sys
from transformers import BertTokenizerFast
model, work, counts = sys.argv[1], sys.argv[2], [int(c) for c in sys.argv[3:]]
tok = BertTokenizerFast.from_pretrained(model)
lines = [l.strip() for l in open(f"{work}/sentences.txt") if l.strip()]
lengths = [len(tok(s)["input_ids"]) for s in lines]
for n in counts:
    enc = tok(lines[:n], padding=True)
    json.dump({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"],
               "token_type_ids": enc["token_type_ids"]}, open(f"{work}/tokens-{n}.json", "w"))
json.dump({"lengths": lengths, "words": [len(s.split()) for s in lines]}, open(f"{work}/lengths.json", "w"))
PY

results=$work/results.jsonl
: > "$results"

# Local forwards of tokens-N.json, ITERATIONS / 2 in one `shardctl run --local` (the ranks start
# each one together: one forward's latency): per iteration the slowest rank, the first iteration
# dropped; appends the seconds, one per line,
# to FILE. Each baseline runs twice, right before and right after the service run it is compared
# with (this machine's speed drifts); the figure is the median of both halves together.
local_forwards() {
  local tp=$1 pp=$2 threads=$3 n=$4 file=$5
  $shardctl run --local --checkpoint "$model" --tp "$tp" --pp "$pp" --threads "$threads" \
    --iterations $(( ITERATIONS / 2 > 1 ? ITERATIONS / 2 : 2 )) \
    --input "$work/tokens-$n.json" --output "$work/local.safetensors" --report "$work/local.json" >/dev/null
  /usr/bin/python3 - "$work/local.json" >> "$file" <<'PY'
import json, sys
ranks = json.load(open(sys.argv[1]))
per_iter = [max(r["forward_seconds_all"][i] for r in ranks) for i in range(len(ranks[0]["forward_seconds_all"]))]
print("\n".join(f"{t:.6f}" for t in per_iter[1:]))
PY
}

# CPU time (clock ticks) used so far by the processes PIDS, all their threads.
cpu_ticks() {
  local sum=0 p t
  for p in "$@"; do
    t=$(sed 's/.*) //' "/proc/$p/stat" | awk '{print $12 + $13}')
    sum=$((sum + t))
  done
  echo "$sum"
}
hz=$(getconf CLK_TCK)

# Runs embed_load KIND (embed|infer) with N clients for SECONDS on $job and appends its JSON
# figures, with the CPU the coordinator and the workers used meanwhile, to $results.
run_load() {
  local kind=$1 n=$2 seconds=$3
  local c0 w0 c1 w1
  c0=$(cpu_ticks "${CLUSTER_PIDS[0]}")
  w0=$(cpu_ticks "${CLUSTER_PIDS[@]:1}")
  if ! $load --job="$job" --clients="$n" --sentences="$work/sentences-$n.txt" --duration_s="$seconds" --warmup=3 \
    --rpc="$kind" --json > "$work/load.txt"; then
    cat "$work/load.txt" >&2
    $shardctl job "$job" 2>&1 | grep -iE '"state"|cause|error' >&2 || true
    tail -n 20 "$WORK/coordinator.log" "$WORK"/worker*.log >&2
    echo "serving_benchmark: embed_load failed ($kind, $n clients, job $job)" >&2
    exit 1
  fi
  c1=$(cpu_ticks "${CLUSTER_PIDS[0]}")
  w1=$(cpu_ticks "${CLUSTER_PIDS[@]:1}")
  sed '$d' "$work/load.txt" >&2
  tail -n 1 "$work/load.txt" | /usr/bin/python3 -c "
import json, sys
r = json.loads(sys.stdin.read())
# The warm-up requests (3 per client) ran in these CPU figures too.
served = r['requests'] + 3 * r['clients']
r.update(config='$config', kind='$kind', threads=$threads,
         coordinator_cpu_ms=1000 * ($c1 - $c0) / $hz / served, workers_cpu_ms=1000 * ($w1 - $w0) / $hz / served)
print(json.dumps(r))
print(f\"  service CPU     coordinator {r['coordinator_cpu_ms']:.2f} ms, workers {r['workers_cpu_ms']:.2f} ms per request\", file=sys.stderr)
" >> "$results"
}

for config in $CONFIGS; do
  shape=${config%%:*}
  tp=${shape%x*}
  pp=${shape#*x}
  world=$((tp * pp))
  # Threads per rank: the machine's cores shared by the ranks (shardctl run's default) unless
  # CONFIGS or THREADS says; the same locally and on the workers.
  threads=$((cores / world))
  [ "$threads" -ge 1 ] || threads=1
  threads=${THREADS:-$threads}
  [ "$config" = "$shape" ] || threads=${config#*:}
  echo "== TP $tp x PP $pp: $world rank(s), $threads thread(s) each" >&2
  mark=$(cat "$work/foreign" 2>/dev/null || echo "0 0")
  start_batching_coordinator
  start_workers_threads "$world" "$threads"
  job=$($shardctl submit --checkpoint "$model" --tp "$tp" --pp "$pp")
  $shardctl watch "$job" >/dev/null
  # Each service run between two local runs of the same sentences (the idle cluster stays up).
  for n in "${CLIENT_COUNTS[@]}"; do
    : > "$work/local-$n-before.txt"
    : > "$work/local-$n-after.txt"
    local_forwards "$tp" "$pp" "$threads" "$n" "$work/local-$n-before.txt"
    run_load embed "$n" "$DURATION"
    local_forwards "$tp" "$pp" "$threads" "$n" "$work/local-$n-after.txt"
    /usr/bin/python3 - "$work/local-$n-before.txt" "$work/local-$n-after.txt" "$config" "$n" "$threads" >> "$results" <<'PY'
import json, statistics, sys
before, after = ([float(l) for l in open(f) if l.strip()] for f in sys.argv[1:3])
config, n, threads = sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
r = dict(config=config, kind="local", batch=n, threads=threads, forward_s=statistics.median(before + after),
         before_s=statistics.median(before), after_s=statistics.median(after))
print(f"local forward, batch of {n}: {1000 * r['forward_s']:.2f} ms (median before the service run "
      f"{1000 * r['before_s']:.2f}, after {1000 * r['after_s']:.2f})", file=sys.stderr)
print(json.dumps(r))
PY
  done
  # Where a request's time goes: Infer reports the ranks' forward time next to BatchInfo.
  for n in 1 16; do run_load infer "$n" 5; done
  $shardctl cancel "$job" >/dev/null
  stop_cluster
  foreign=$(foreign_since "$mark")
  echo "{\"config\": \"$config\", \"kind\": \"foreign\", \"percent\": $foreign}" >> "$results"
  [ "$foreign" -lt 5 ] || echo "serving_benchmark: warning: other processes used $foreign% of the CPUs during TP $tp x PP $pp" >&2
done

mkdir -p "$(dirname "$RESULTS")"
/usr/bin/python3 - "$results" "$work/lengths.json" "$cores" "$cpu" "$DURATION" "$ITERATIONS" "$BATCH_FLAGS" \
  "$(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet -- server serving worker 2>/dev/null || echo ' + uncommitted changes in server/serving/worker')" \
  "$(date '+%Y-%m-%d %H:%M')" "$busy_before" "$(busy_percent)" "$BLAS_ENV" > "$RESULTS" <<'PY'
import json, sys
(results_path, lengths_path, cores, cpu, duration, iterations, batch_flags, commit, when,
 busy_before, busy_after, blas_env) = sys.argv[1:]
rows = [json.loads(l) for l in open(results_path) if l.strip()]
lengths = json.load(open(lengths_path))
def get(config, kind, **kw):
    for r in rows:
        if r["config"] == config and r["kind"] == kind and all(r.get(k) == v for k, v in kw.items()):
            return r
    return None
configs = []
for r in rows:
    if r["config"] not in configs:
        configs.append(r["config"])
def label(c):
    tp, pp = c.split(":")[0].split("x")
    base = "unsharded" if (tp, pp) == ("1", "1") else f"TP {tp} x PP {pp}"
    threads = next((r["threads"] for r in rows if r["config"] == c and "threads" in r), None)
    return f"{base}, {threads} thread{'s' if threads != 1 else ''}/rank"
name = {c: label(c) for c in configs}
out = []
p = out.append
p(f"# Serving benchmark, {when}")
p("")
foreign = ", ".join(f"{name[c]} {get(c, 'foreign')['percent']}%" for c in configs if get(c, "foreign") is not None)
p(f"Machine: {cores} cores, {cpu}; CPUs {busy_before}% busy in the 2 s before the run, {busy_after}% after it; "
  f"CPU used by other processes while each configuration ran: {foreign} (the figures mean something on an otherwise "
  f"idle machine only). Commit {commit}. "
  f"Model all-MiniLM-L6-v2 (BertModel, 6 layers, hidden 384), CPU ranks (Gloo). Coordinator batching flags: "
  f"{batch_flags or 'defaults (--max_batch_tokens=16384 --max_batch_requests=32 --max_batch_delay_ms=0 --max_batch_regroup_ms=5)'}. "
  + ("Workers run with `--threads=T` and OMP_NUM_THREADS = OPENBLAS_NUM_THREADS = T, as `shardctl run` gives its ranks "
     "(BLAS_ENV=1)." if blas_env != "0" else
     "Workers run with `--threads=T` only, as tools/local_cluster.sh starts them (BLAS_ENV=0): OpenBLAS then keeps "
     "a pool of as many threads as cores in every worker, unlike the local ranks."))
p("")
p(f"Sentences: 16, {min(lengths['words'])}-{max(lengths['words'])} words, {min(lengths['lengths'])}-{max(lengths['lengths'])} "
  f"tokens with [CLS]/[SEP] (mean {sum(lengths['lengths']) / len(lengths['lengths']):.1f}). Service: N clients send the "
  f"first N sentences (client i starts at sentence i and cycles), one sentence per Embed request, closed loop, {duration} s "
  f"after 3 warm-up requests per client; each client is a thread of bench/embed_load with its own gRPC channel and "
  f"connection, on the same machine as the service. Local: `shardctl run --local` of the same N sentences as one padded "
  f"batch, the same threads per rank: two runs of {int(iterations) // 2} forwards, each started by all ranks together "
  f"(a barrier, so that one figure is one forward's latency, pipeline stages one after the other as in the service), "
  f"right before and right after the service run (the cluster idle), the first forward of each dropped, the median of "
  f"the slowest rank's times (each run's median in the last column).")
p("")
p("| config | clients | service req/s | p50 ms | p90 ms | p99 ms | merged: mean BatchInfo.requests / requests per forward | local forward of the N batched, ms | local req/s (N / forward) | service / local req/s | local before / after, ms |")
p("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
verdicts = []
for c in configs:
    for n in (1, 4, 16):
        e, l = get(c, "embed", clients=n), get(c, "local", batch=n)
        if e is None or l is None:
            continue
        local_rps = n / l["forward_s"]
        p(f"| {name[c]} | {n} | {e['requests_per_second']:.1f} | {e['p50_ms']:.1f} | {e['p90_ms']:.1f} | {e['p99_ms']:.1f} | "
          f"{e['mean_batch_requests']:.1f} / {e['requests_per_forward']:.1f} | {1000 * l['forward_s']:.1f} | {local_rps:.1f} | {100 * e['requests_per_second'] / local_rps:.0f}% | "
          f"{1000 * l['before_s']:.1f} / {1000 * l['after_s']:.1f} |")
    fg = get(c, "foreign")
    if fg is not None and fg["percent"] >= 5:
        verdicts.append(f"- {name[c]}: **other processes used {fg['percent']}% of the CPUs while it ran: its figures are skewed**")
    e16, l16 = get(c, "embed", clients=16), get(c, "local", batch=16)
    e1, l1 = get(c, "embed", clients=1), get(c, "local", batch=1)
    if e16 and l16:
        ratio = e16["requests_per_second"] / (16 / l16["forward_s"])
        verdicts.append(f"- {name[c]}, throughput: 16 clients {e16['requests_per_second']:.1f} req/s = "
                        f"{100 * ratio:.0f}% of local {16 / l16['forward_s']:.1f} req/s (target >= 70%): "
                        f"**{'PASS' if ratio >= 0.70 else 'MISS'}**")
    if e1 and l1:
        bound = 1.1 * 1000 * l1["forward_s"] + 3
        verdicts.append(f"- {name[c]}, latency: 1 client p50 {e1['p50_ms']:.1f} ms vs 1.1 x {1000 * l1['forward_s']:.1f} ms + 3 ms "
                        f"= {bound:.1f} ms: **{'PASS' if e1['p50_ms'] <= bound else 'MISS'}** (mean {e1['mean_ms']:.1f} ms)")
p("")
p("Targets:")
p("")
out.extend(verdicts)
if any(int(c.split(":")[0].split("x")[1]) > 1 for c in configs):
    p("")
    p("With PP > 1 both figures are one forward's latency, its pipeline stages one after the other: the service runs "
      "one job's forwards one at a time, and the local ranks start every forward together (no overlap of forward i+1 "
      "on stage 0 with forward i on the last stage, which would make back-to-back forwards look faster than one is).")
p("")
p("Where the time goes. Infer on the same job (5 s) reports the ranks' forward time (the rank with the outputs) next "
  "to BatchInfo's queue time; the rest is tokenising, gRPC between client, coordinator and workers, merging and "
  "splitting, and the client. Per request: means and medians over requests (a request in a big batch sees a long "
  "forward). Per forward: each forward counted once; busy = share of the wall time the job's ranks spent in a "
  "forward (forwards of one job run one at a time):")
p("")
p("| config | clients | req/s | latency mean / p50 ms | queue ms | forward ms, mean / p50 | rest ms, mean / p50 | requests per forward | rows, padded tokens per forward | ms per forward | busy |")
p("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for c in configs:
    for n in (1, 16):
        i = get(c, "infer", clients=n)
        if i is None:
            continue
        p(f"| {name[c]} | {n} | {i['requests_per_second']:.1f} | {i['mean_ms']:.1f} / {i['p50_ms']:.1f} | {i['mean_queue_ms']:.1f} | "
          f"{i['mean_forward_ms']:.1f} / {i['p50_forward_ms']:.1f} | {i['mean_ms'] - i['mean_queue_ms'] - i['mean_forward_ms']:.1f} / "
          f"{i['p50_rest_ms']:.1f} | {i['requests_per_forward']:.2f} | {i['rows_per_forward']:.1f}, {i['tokens_per_forward']:.0f} | "
          f"{i['forward_ms_per_forward']:.1f} | {100 * i['forward_busy']:.0f}% |")
p("")
p("CPU per request (ms of CPU time, all threads; coordinator and workers include the warm-up requests), and how busy "
  f"that kept the {cores} cores:")
p("")
p("| config | rpc | clients | coordinator | workers (all ranks) | clients (embed_load) | total | cores busy |")
p("|---|---|---:|---:|---:|---:|---:|---:|")
for c in configs:
    for kind in ("embed", "infer"):
        for n in (1, 4, 16):
            r = get(c, kind, clients=n)
            if r is None:
                continue
            client = 1000 * r["client_cpu_s"] / max(1, r["requests"])
            total = r["coordinator_cpu_ms"] + r["workers_cpu_ms"] + client
            p(f"| {name[c]} | {kind.capitalize()} | {n} | {r['coordinator_cpu_ms']:.1f} | {r['workers_cpu_ms']:.1f} | {client:.1f} | "
              f"{total:.1f} | {100 * total * r['requests_per_second'] / 1000 / int(cores):.0f}% |")
print("\n".join(out))
PY
cat "$RESULTS"
echo "serving_benchmark: wrote $RESULTS" >&2
