#!/usr/bin/env bash
# HTTP overhead benchmark (issue 23) on the real all-MiniLM-L6-v2: one unsharded job (one worker,
# THREADS LibTorch threads) served by one coordinator with --http_listen, and the same one-sentence
# requests through each protocol, closed-loop, with 1 and with 16 clients:
#   grpc-embed   bertshard.v1 Embed (//bench:embed_load --rpc=embed)
#   tei-embed    TEI's POST /embed (//bench:http_load)
#   openai       OpenAI's POST /v1/embeddings
#   grpc-infer   bertshard.v1 Infer (every output; embed_load --rpc=infer)
#   kserve       KServe v2 POST /v2/models/minilm/infer, BYTES text, JSON tensors back (every output)
# and, side by side in the same rounds, what a user would run instead on this machine:
#   st-encode    sentence-transformers' encode() in-process (bench/st_encode_load.py) as a user gets
#                it from PyPI today (3.4.1 on torch 2.5.1: the infinity venv's): 1 client = one
#                sentence per call, 16 = the 16 sentences as one batch
#   st-encode-t113  the same with sentence-transformers 3.1.1 on Debian's torch 1.13 (the bench venv)
#   infinity     infinity-emb's OpenAI-style POST /v1/embeddings (the infinity venv: its own torch
#                2.5), serving the same directory with THREADS threads, driven by //bench:http_load
# Each HTTP route is compared with the gRPC call it makes: TEI and OpenAI with Embed, KServe with
# Infer; the peers with Embed. ROUNDS rounds (default 2), each running every protocol in turn, so
# that drift shows. Writes bench/results/http-<date>.md and prints it. PEERS=0 leaves the peers out
# (their venvs are built on first use: tools/python_env.sh bench and infinity).
#
#   bash bench/http_benchmark.sh
#
# Environment: DURATION (measured seconds per run, default 8), ROUNDS (default 2), THREADS
# (LibTorch threads of the worker, default the cores), RESULTS (output file).
# Targets (figures, not asserts): 1 client, p50 at most +1 ms over the gRPC call; 16 clients, at
# least 90% of the gRPC call's requests/s.
set -euo pipefail
cd "$(dirname "$0")/.."
DURATION=${DURATION:-8}
ROUNDS=${ROUNDS:-2}
THREADS=${THREADS:-$(nproc)}
RESULTS=${RESULTS:-bench/results/http-$(date +%Y-%m-%d).md}
PEERS=${PEERS:-1}
protocols=(grpc-embed tei-embed openai grpc-infer kserve)
if [ "$PEERS" = 1 ]; then
  bench_venv=$(bash tools/python_env.sh bench)
  infinity_venv=$(bash tools/python_env.sh infinity)
  protocols+=(st-encode st-encode-t113 infinity)
fi

echo "http_benchmark: building (-c opt)" >&2
targets=(//client:shardctl //server:bertshard-coordinator //worker:shard-worker //bench:embed_load //bench:http_load)
bazel build -c opt "${targets[@]}" >/dev/null 2>&1 || {
  echo "http_benchmark: build failed; run: bazel build -c opt ${targets[*]}" >&2
  exit 1
}
WORK=$(mktemp -d)
source tools/local_cluster.sh
trap 'stop_cluster >/dev/null 2>&1 || true; rm -rf "$WORK"' EXIT
# Private copies: a later build may move bazel-bin while this runs.
mkdir -p "$WORK/bin"
for b in client/shardctl worker/shard-worker server/bertshard-coordinator bench/embed_load bench/http_load; do
  cp "bazel-out/k8-opt/bin/$b" "$WORK/bin/"
done
shardctl=$WORK/bin/shardctl
COORDINATOR_BIN=$WORK/bin/bertshard-coordinator
WORKER_BIN=$WORK/bin/shard-worker
model=$(bash tools/fetch_model.sh all-MiniLM-L6-v2)
cpu=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n 1)

COORDINATOR_FLAGS="--http_listen=127.0.0.1:0" start_coordinator
http=127.0.0.1:$(wait_for_logged_port "$WORK/coordinator.log" 's/^http listening on port \([0-9]*\).*/\1/p')
OMP_NUM_THREADS=$THREADS OPENBLAS_NUM_THREADS=$THREADS "$WORKER_BIN" --listen=127.0.0.1:0 \
  --coordinator="$BERTSHARD_SERVER" --threads="$THREADS" >"$WORK/worker.log" 2>&1 &
CLUSTER_PIDS+=($!)
for _ in $(seq 200); do
  [ "$($shardctl workers | grep -c ' yes ')" -ge 1 ] && break
  sleep 0.1
done
job=$($shardctl submit --checkpoint "$model" --name minilm)
$shardctl watch "$job" >/dev/null

if [ "$PEERS" = 1 ]; then
  # infinity on the same directory and threads; offline (a local path is never looked up on the hub).
  infinity_port=$(/usr/bin/python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 OMP_NUM_THREADS=$THREADS MKL_NUM_THREADS=$THREADS \
    "$infinity_venv/bin/infinity_emb" v2 --model-id "$model" --served-model-name minilm --engine torch \
    --device cpu --host 127.0.0.1 --port "$infinity_port" --url-prefix /v1 >"$WORK/infinity.log" 2>&1 &
  CLUSTER_PIDS+=($!)
  for _ in $(seq 300); do
    /usr/bin/python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$infinity_port/health', timeout=1)" \
      2>/dev/null && break
    sleep 0.5
  done
  /usr/bin/python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$infinity_port/health', timeout=1)" ||
    { tail -n 30 "$WORK/infinity.log" >&2; echo "http_benchmark: infinity did not start" >&2; exit 1; }
fi

cp bench/sentences-16.txt "$WORK/sentences-16.txt"
head -n 1 "$WORK/sentences-16.txt" > "$WORK/sentences-1.txt"
results=$WORK/results.jsonl
: > "$results"

# Runs PROTOCOL with N clients; appends its JSON figures, tagged, to $results.
run() {
  local protocol=$1 n=$2 round=$3 out=$WORK/load.txt
  local common=(--clients="$n" --sentences="$WORK/sentences-$n.txt" --duration_s="$DURATION" --warmup=2 --json)
  case $protocol in
    grpc-embed) "$WORK/bin/embed_load" --job="$job" --rpc=embed "${common[@]}" > "$out" ;;
    grpc-infer) "$WORK/bin/embed_load" --job="$job" --rpc=infer "${common[@]}" > "$out" ;;
    tei-embed) "$WORK/bin/http_load" --address="$http" --path=/embed \
      --body='{"inputs": {SENTENCE}, "model": "minilm"}' "${common[@]}" > "$out" ;;
    openai) "$WORK/bin/http_load" --address="$http" --path=/v1/embeddings \
      --body='{"input": {SENTENCE}, "model": "minilm"}' "${common[@]}" > "$out" ;;
    kserve) "$WORK/bin/http_load" --address="$http" --path=/v2/models/minilm/infer \
      --body='{"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": [{SENTENCE}]}]}' \
      "${common[@]}" > "$out" ;;
    st-encode | st-encode-t113)
      local venv=$infinity_venv
      [ "$protocol" = st-encode-t113 ] && venv=$bench_venv
      OMP_NUM_THREADS=$THREADS "$venv/bin/python" bench/st_encode_load.py --model="$model" \
        --sentences="$WORK/sentences-$n.txt" --duration_s="$DURATION" --warmup=2 --threads="$THREADS" > "$out" ;;
    infinity) "$WORK/bin/http_load" --address="127.0.0.1:$infinity_port" --path=/v1/embeddings \
      --body='{"input": {SENTENCE}, "model": "minilm"}' "${common[@]}" > "$out" ;;
  esac || { cat "$out" >&2; echo "http_benchmark: $protocol with $n clients failed" >&2; exit 1; }
  sed '$d' "$out" >&2
  tail -n 1 "$out" | /usr/bin/python3 -c "
import json, sys
r = json.loads(sys.stdin.read())
r.update(protocol='$protocol', n=$n, round=$round)
print(json.dumps(r))" >> "$results"
}

for round in $(seq "$ROUNDS"); do
  for n in 1 16; do
    for protocol in "${protocols[@]}"; do
      echo "== round $round: $protocol, $n client(s)" >&2
      run "$protocol" "$n" "$round"
    done
  done
done

/usr/bin/python3 - "$results" "$RESULTS" "$cpu" "$THREADS" "$DURATION" "$(git rev-parse --short HEAD)" <<'PY'
import json, sys
results, out, cpu, threads, duration, commit = sys.argv[1:]
rows = [json.loads(l) for l in open(results)]
base = {"tei-embed": "grpc-embed", "openai": "grpc-embed", "kserve": "grpc-infer"}
peers = {"st-encode": "grpc-embed", "st-encode-t113": "grpc-embed", "infinity": "grpc-embed"}  # no target
lines = [f"# HTTP overhead benchmark ({__import__('datetime').date.today()})", "",
         f"CPU: {cpu}; all-MiniLM-L6-v2 unsharded, one worker with {threads} LibTorch thread(s); "
         f"one-sentence requests, closed loop, {duration} s per run; commit {commit}. Each HTTP route "
         "against the gRPC call it makes (TEI and OpenAI: Embed; KServe: Infer, every output, JSON "
         "tensors). Targets: 1 client p50 at most +1 ms; 16 clients at least 90% of the gRPC requests/s. "
         "Peers, where measured, against Embed: st-encode is sentence-transformers' encode() in-process "
         "(3.4.1 on PyPI's torch 2.5.1; st-encode-t113: 3.1.1 on Debian's torch 1.13; 16 clients: the 16 "
         "sentences as one batch per call, requests/s counting sentences), infinity is infinity-emb "
         "0.0.78's /v1/embeddings on the same directory and threads (torch 2.5.1).", ""]
for rnd in sorted({r["round"] for r in rows}):
    lines += [f"## Round {rnd}", "", "| protocol | clients | requests/s | p50 ms | p99 ms | errors | against gRPC |",
              "|---|---|---|---|---|---|---|"]
    for n in (1, 16):
        got = {r["protocol"]: r for r in rows if r["round"] == rnd and r["n"] == n}
        for p in ("grpc-embed", "tei-embed", "openai", "grpc-infer", "kserve", "st-encode", "st-encode-t113",
                  "infinity"):
            if p not in got:
                continue
            r = got[p]
            vs = ""
            if p in peers:
                b = got[peers[p]]
                vs = (f"p50 {r['p50_ms'] - b['p50_ms']:+.2f} ms" if n == 1 else
                      f"{100 * r['requests_per_second'] / b['requests_per_second']:.0f}%")
            if p in base:
                b = got[base[p]]
                if n == 1:
                    d = r["p50_ms"] - b["p50_ms"]
                    vs = f"p50 {d:+.2f} ms ({'met' if d <= 1 else 'MISS'})"
                else:
                    q = r["requests_per_second"] / b["requests_per_second"]
                    vs = f"{100 * q:.0f}% ({'met' if q >= 0.9 else 'MISS'})"
            lines.append(f"| {p} | {n} | {r['requests_per_second']:.1f} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | "
                         f"{r['errors']} | {vs} |")
    lines.append("")
open(out, "w").write("\n".join(lines))
print("\n".join(lines))
PY
