#!/usr/bin/env bash
# The service path end to end, for tools/gpu_check.sh (GPU workers, NCCL) and its CPU dry run in
# tests/gpu_check_test (CPU workers, Gloo): starts a coordinator and one worker per device, submits
# the checkpoint as one tensor-parallel job over all of them with the given backend, waits for it
# to be READY, runs Infer on the token inputs and writes the raw outputs (HF names), which the
# caller compares with HF. Everything it starts is stopped on exit; logs go to LOG_DIR.
#
#   SHARDCTL=... COORDINATOR=... WORKER=... [LIBRARY_PATH=...] \
#     bash tools/service_parity.sh BACKEND CHECKPOINT INPUT.json OUTPUT.safetensors LOG_DIR DEVICE...
#
# DEVICE: cpu or cuda:N, one per worker; the job's tp is their count. LIBRARY_PATH, when set, is
# the LD_LIBRARY_PATH of our binaries only. Exit 0 when the output is written, 1 with the reason.
set -uo pipefail
backend=$1 checkpoint=$2 input=$3 output=$4 logs=$5
shift 5
devices=("$@")
work=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null; done
  rm -rf "$work"
}
trap cleanup EXIT
ours() { env ${LIBRARY_PATH:+LD_LIBRARY_PATH="$LIBRARY_PATH"} "$@"; }
fail() { echo "service_parity: $*" >&2; exit 1; }
mkdir -p "$logs"
source "$(dirname "$0")/local_cluster.sh"  # wait_for_port
ours "$COORDINATOR" --listen=127.0.0.1:0 --data_dir="$work/coordinator" > "$logs/coordinator.log" 2>&1 &
pids+=($!)
port=$(wait_for_port "$logs/coordinator.log") || fail "the coordinator did not start: $(tail -n 3 "$logs/coordinator.log")"
server="--server=127.0.0.1:$port"
for i in "${!devices[@]}"; do
  ours "$WORKER" --listen=127.0.0.1:0 --coordinator="127.0.0.1:$port" --device="${devices[$i]}" \
    > "$logs/worker$i.log" 2>&1 &
  pids+=($!)
done
# Every worker registered (shardctl workers: a header, then one line each).
for _ in $(seq 300); do
  registered=$(ours "$SHARDCTL" workers "$server" 2>/dev/null | tail -n +2 | grep -c .)
  [ "$registered" -ge "${#devices[@]}" ] && break
  sleep 0.1
done
[ "${registered:-0}" -ge "${#devices[@]}" ] ||
  fail "${registered:-0} of ${#devices[@]} workers registered: $(tail -q -n 2 "$logs"/worker*.log | tr '\n' ' ')"
ours "$SHARDCTL" submit "$server" --checkpoint "$checkpoint" --tp "${#devices[@]}" --backend "$backend" \
  --no-wait --watch > "$logs/submit.log" 2>&1 ||
  fail "the job did not become READY: $(tail -n 3 "$logs/submit.log" | tr '\n' ' ')"
job=$(head -n 1 "$logs/submit.log")
ours "$SHARDCTL" infer "$job" "$server" --input "$input" --output "$output" > "$logs/infer.log" 2>&1 ||
  fail "Infer failed: $(tail -n 3 "$logs/infer.log" | tr '\n' ' ')"
ours "$SHARDCTL" workers "$server" > "$logs/workers.txt" 2>&1
exit 0
