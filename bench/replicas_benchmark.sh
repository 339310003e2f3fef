#!/usr/bin/env bash
# Replicas benchmark (issue 22) on the real all-MiniLM-L6-v2: one TP 1 job with 1 replica against
# the same job with 2 replicas, each replica a worker with THREADS LibTorch threads (default 1),
# under CLIENTS concurrent one-sentence Embed clients (//bench:embed_load) for DURATION seconds;
# then failover: the 2-replica job with a spare worker, SIGKILL of one replica's worker DURATION/3
# seconds into a run of the same clients: the errors the clients saw (target 0) and how long
# until the lost replica was READY again; then a live update: the 2-replica job on four workers
# moved from TP 1 to TP 2 a third of the way into a run (two spares hold one TP 2 replica, so it goes
# replica by replica): the errors, latency before and during, and the time to switch over and to
# have every new replica READY; then smaller shapes (the coordinator's --smaller_shapes): a TP 2 x PP 2
# job on four workers, rank 3's worker killed a third of the way in with no spare (it serves as
# TP 2 x PP 1 on the workers it kept), a fifth worker started two thirds in (it grows back): the
# errors, the times, and the checkpoint bytes each load read against a full load.
# Writes bench/results/replicas-<date>.md and prints it.
#
#   bash bench/replicas_benchmark.sh
#
# Environment: DURATION (default 12), CLIENTS (default 16), THREADS (default 1), RESULTS (file).
# Figures, not asserts: the exit status is 0 unless something fails to run.
set -euo pipefail
cd "$(dirname "$0")/.."
DURATION=${DURATION:-12}
CLIENTS=${CLIENTS:-16}
THREADS=${THREADS:-1}
RESULTS=${RESULTS:-bench/results/replicas-$(date +%Y-%m-%d).md}

echo "replicas_benchmark: building (-c opt)" >&2
bazel build -c opt //client:shardctl //server:bertshard-coordinator //worker:shard-worker //bench:embed_load \
  >/dev/null 2>&1 || {
  echo "replicas_benchmark: build failed; run: bazel build -c opt //client:shardctl //server:bertshard-coordinator //worker:shard-worker //bench:embed_load" >&2
  exit 1
}
WORK=$(mktemp -d)
source tools/local_cluster.sh
trap 'stop_cluster >/dev/null 2>&1 || true; rm -rf "$WORK"' EXIT
mkdir -p "$WORK/bin"
for b in client/shardctl worker/shard-worker server/bertshard-coordinator bench/embed_load; do
  cp "bazel-out/k8-opt/bin/$b" "$WORK/bin/"
done
shardctl=$WORK/bin/shardctl
load=$WORK/bin/embed_load
COORDINATOR_BIN=$WORK/bin/bertshard-coordinator
WORKER_BIN=$WORK/bin/shard-worker
model=$(bash tools/fetch_model.sh all-MiniLM-L6-v2)
cpu=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n 1)
# The serving benchmark's sixteen everyday sentences.
cp bench/sentences-16.txt "$WORK/sentences.txt"

# Workers with THREADS threads each (and their BLAS pools sized alike, as serving_benchmark does).
start_bench_workers() {
  for i in $(seq "$1"); do
    OMP_NUM_THREADS="$THREADS" OPENBLAS_NUM_THREADS="$THREADS" "$WORKER_BIN" --listen=127.0.0.1:0 \
      --coordinator="$BERTSHARD_SERVER" --threads="$THREADS" >"$WORK/worker-$2-$i.log" 2>&1 &
    CLUSTER_PIDS+=($!)
  done
  for _ in $(seq 200); do
    [ "$($shardctl workers | grep -c ' yes ')" -ge "$1" ] && return 0
    sleep 0.1
  done
  echo "replicas_benchmark: workers did not register" >&2
  return 1
}

# Submits the model with REPLICAS replicas and waits until every one is READY; prints the job id.
submit() {
  local job
  # The whole output first: closing the pipe after the id would end the watch.
  $shardctl submit --checkpoint "$model" --tp 1 --pp 1 --replicas "$1" --watch > "$WORK/submit.txt"
  job=$(head -n 1 "$WORK/submit.txt")
  [ -n "$job" ] || { echo "replicas_benchmark: submit failed" >&2; return 1; }
  echo "$job"
}

# "RESTARTS READY" of job JOB: its losses in a row and its replicas READY now.
replica_state() {
  $shardctl job "$1" | /usr/bin/python3 -c '
import json, sys
j = json.load(sys.stdin)
print(j.get("restarts", 0), sum(1 for r in j.get("replica_status", []) if r.get("state") == "READY"))'
}

# The pid of the worker process (of workers NAME-1..NAME-N, started by start_bench_workers) whose
# log names ADDRESS's port; "" when none does.
worker_pid_at() {  # ADDRESS NAME N
  local i
  for i in $(seq "$3"); do
    if grep -q "port ${1##*:}" "$WORK/worker-$2-$i.log"; then echo "${CLUSTER_PIDS[$i]}"; return; fi
  done
}

run_load() {  # JOB -> embed_load's JSON line
  $load --job="$1" --clients="$CLIENTS" --sentences="$WORK/sentences.txt" --duration_s="$DURATION" --warmup=3 \
    --json > "$WORK/load.txt" || grep -m1 "first error" "$WORK/load.txt" >&2
  tail -n 1 "$WORK/load.txt"
}

rows=()
for replicas in 1 2; do
  start_coordinator
  start_bench_workers "$replicas" "r$replicas"
  job=$(submit "$replicas")
  line=$(run_load "$job")
  echo "replicas $replicas: $line" >&2
  rows+=("$replicas $line")
  stop_cluster >/dev/null 2>&1 || true
  rm -rf "$WORK/coordinator"
done

# Failover: 2 replicas and a spare; one replica's worker killed a third of the way in.
start_coordinator
start_bench_workers 3 failover
job=$(submit 2)
victim_addr=$($shardctl workers | grep -F " $job/replica-1 " | awk '{print $2; exit}')
victim_pid=$(worker_pid_at "$victim_addr" failover 3)
[ -n "$victim_pid" ] || { echo "replicas_benchmark: no worker serves $job/replica-1" >&2; exit 1; }
$load --job="$job" --clients="$CLIENTS" --sentences="$WORK/sentences.txt" --duration_s="$DURATION" --warmup=3 \
  --json > "$WORK/failover.txt" &
load_pid=$!
sleep "$(( DURATION / 3 + 1 ))"
killed=$(date +%s.%N)
kill -KILL "$victim_pid"
# Lost once (its count stays) and both replicas READY: the lost one is back on the spare.
back=
for _ in $(seq 600); do
  state=$(replica_state "$job")
  if [ "$state" = "1 2" ]; then
    back=$(date +%s.%N)
    break
  fi
  sleep 0.05
done
[ -n "$back" ] || { echo "replicas_benchmark: the lost replica did not come back (restarts, READY: $state)" >&2; $shardctl job "$job" >&2; }
wait "$load_pid" || true
failover=$(tail -n 1 "$WORK/failover.txt")
stop_cluster >/dev/null 2>&1 || true
rm -rf "$WORK/coordinator"

# Live update: TP 1 -> TP 2 of the 2-replica job under the same clients.
start_coordinator
start_bench_workers 4 update
job=$(submit 2)
steady=$(run_load "$job")
$load --job="$job" --clients="$CLIENTS" --sentences="$WORK/sentences.txt" --duration_s="$DURATION" --warmup=3 \
  --json > "$WORK/update.txt" &
load_pid=$!
sleep "$(( DURATION / 3 + 1 ))"
update_start=$(date +%s.%N)
$shardctl update "$job" --tp 2 --watch > "$WORK/update-watch.txt" 2>&1 || cat "$WORK/update-watch.txt" >&2
update_done=$(date +%s.%N)
switched_at=$($shardctl job "$job" | /usr/bin/python3 -c '
import datetime, json, re, sys
m = re.search(r"switched over at (\S+ \S+) UTC", json.load(sys.stdin).get("last_update", ""))
print(datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S.%f").replace(tzinfo=datetime.timezone.utc).timestamp() if m else 0)')
wait "$load_pid" || true
during=$(tail -n 1 "$WORK/update.txt")
stop_cluster >/dev/null 2>&1 || true
rm -rf "$WORK/coordinator"

# Smaller shapes: TP 2 x PP 2 on every worker, no spare.
COORDINATOR_FLAGS=--smaller_shapes start_coordinator
start_bench_workers 4 smaller
$shardctl submit --checkpoint "$model" --tp 2 --pp 2 --watch > "$WORK/submit.txt"
job=$(head -n 1 "$WORK/submit.txt")
# "READY SMALLER RANKS READ KEPT" of job JOB's replica 0 now.
shape_state() {
  $shardctl job "$1" | /usr/bin/python3 -c '
import json, sys
j = json.load(sys.stdin); r = (j.get("replica_status") or [{}])[0]
print(r.get("state", "-"), "yes" if r.get("smaller_shape") else "no", len(j.get("ranks", [])),
      r.get("load_bytes_read", 0), r.get("load_bytes_kept", 0))'
}
full_read=$(shape_state "$job" | awk '{print $4}')
victim_addr=$($shardctl job "$job" | /usr/bin/python3 -c '
import json, sys
print(next(r["worker_address"] for r in json.load(sys.stdin)["ranks"] if r.get("rank", 0) == 3))')
victim_pid=$(worker_pid_at "$victim_addr" smaller 4)
[ -n "$victim_pid" ] || { echo "replicas_benchmark: no worker serves rank 3 of $job" >&2; exit 1; }
$load --job="$job" --clients="$CLIENTS" --sentences="$WORK/sentences.txt" --duration_s="$DURATION" --warmup=3 \
  --json > "$WORK/smaller.txt" &
load_pid=$!
sleep "$(( DURATION / 3 + 1 ))"
smaller_killed=$(date +%s.%N)
kill -KILL "$victim_pid"
smaller_at=0 smaller_state="-"
for _ in $(seq 600); do
  smaller_state=$(shape_state "$job")
  if [[ "$smaller_state" == "READY yes "* ]]; then smaller_at=$(date +%s.%N); break; fi
  sleep 0.05
done
sleep "$(( DURATION / 3 ))"
joined=$(date +%s.%N)
"$WORKER_BIN" --listen=127.0.0.1:0 --coordinator="$BERTSHARD_SERVER" --threads="$THREADS" \
  >"$WORK/worker-smaller-5.log" 2>&1 &
CLUSTER_PIDS+=($!)
grown_at=0 grown_state="-"
for _ in $(seq 600); do
  grown_state=$(shape_state "$job")
  if [[ "$grown_state" == "READY no 4 "* ]]; then grown_at=$(date +%s.%N); break; fi
  sleep 0.05
done
wait "$load_pid" || true
smaller_run=$(tail -n 1 "$WORK/smaller.txt")
stop_cluster >/dev/null 2>&1 || true

/usr/bin/python3 - "$RESULTS" "$cpu" "$CLIENTS" "$DURATION" "$THREADS" "$killed" "${back:-0}" "$failover" \
  "$steady" "$during" "$update_start" "$switched_at" "$update_done" "$full_read" "$smaller_killed" "$smaller_at" \
  "$smaller_state" "$joined" "$grown_at" "$grown_state" "$smaller_run" "${rows[@]}" <<'PY'
import json, sys
out, cpu, clients, duration, threads, killed, back, failover = sys.argv[1:9]
steady, during = json.loads(sys.argv[9]), json.loads(sys.argv[10])
update_start, switched_at, update_done = (float(x) for x in sys.argv[11:14])
full_read, s_killed, s_at = int(sys.argv[14]), float(sys.argv[15]), float(sys.argv[16])
s_state, joined, g_at, g_state = sys.argv[17].split(), float(sys.argv[18]), float(sys.argv[19]), sys.argv[20].split()
smaller = json.loads(sys.argv[21])
rows = [(int(r.split(" ", 1)[0]), json.loads(r.split(" ", 1)[1])) for r in sys.argv[22:]]
f = json.loads(failover)
lines = [f"# Replicas benchmark ({__import__('datetime').date.today()})", "",
         f"CPU: {cpu}; all-MiniLM-L6-v2, TP 1, {threads} LibTorch thread(s) per worker, {clients} closed-loop "
         f"one-sentence Embed clients, {duration} s per run.", "",
         "| replicas | requests/s | p50 ms | p99 ms | errors |", "|---|---|---|---|---|"]
for n, r in rows:
    lines.append(f"| {n} | {r['requests_per_second']:.1f} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {r['errors']} |")
base = rows[0][1]["requests_per_second"]
lines += ["", f"2 replicas / 1 replica: {rows[1][1]['requests_per_second'] / base:.2f}x", "",
          "Failover (2 replicas and a spare worker, SIGKILL of replica 1's worker a third of the way in):",
          f"- client errors over the run: {f['errors']} of {f['requests'] + f['errors']} requests "
          f"({f['requests_per_second']:.1f} requests/s, p99 {f['p99_ms']:.2f} ms)",
          f"- lost replica READY again on the spare: "
          + (f"{float(back) - float(killed):.2f} s after the kill" if float(back) > 0 else "not within 30 s"),
          "",
          "Live update TP 1 -> TP 2 of the 2-replica job on four workers (replica by replica), a third of the way in:",
          f"- client errors over the run: {during['errors']} of {during['requests'] + during['errors']} requests",
          f"- latency: p50 {steady['p50_ms']:.2f} ms, p99 {steady['p99_ms']:.2f} ms in a run without it; "
          f"p50 {during['p50_ms']:.2f} ms, p99 {during['p99_ms']:.2f} ms over the run with it "
          f"({steady['requests_per_second']:.1f} and {during['requests_per_second']:.1f} requests/s)",
          f"- switched over {switched_at - update_start:.2f} s after the call"
          if switched_at > 0 else "- did not switch over",
          f"- every new replica READY (update --watch returned) {update_done - update_start:.2f} s after the call",
          "",
          "Smaller shapes (--smaller_shapes): TP 2 x PP 2 on four workers, SIGKILL of rank 3's worker a third of the "
          "way in with no spare, a fifth worker started two thirds in:",
          f"- client errors over the run: {smaller['errors']} of {smaller['requests'] + smaller['errors']} requests "
          f"({smaller['requests_per_second']:.1f} requests/s, p99 {smaller['p99_ms']:.2f} ms)",
          (f"- serving as TP 2 x PP 1 {s_at - s_killed:.2f} s after the kill; its load read {int(s_state[3]):,} "
           f"checkpoint bytes and kept {int(s_state[4]):,} (a full TP 2 x PP 2 load read {full_read:,})")
          if s_at > 0 else f"- did not serve in a smaller shape within 30 s (last seen: {' '.join(s_state)})",
          (f"- grown back to TP 2 x PP 2 {g_at - joined:.2f} s after the worker started (its start included); "
           f"read {int(g_state[3]):,}, kept {int(g_state[4]):,}")
          if g_at > 0 else f"- did not grow back within 30 s (last seen: {' '.join(g_state)})"]
open(out, "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
