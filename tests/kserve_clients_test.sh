#!/usr/bin/env bash
# KServe v2 (docs/http.md) driven by Triton's own client, unchanged: tritonclient.http against the
# coordinator's /v2 routes and tritonclient.grpc against inference.GRPCInferenceService on its gRPC
# port (tests/kserve_clients_test.py): metadata, readiness, infer with INT64 ids and with BYTES text,
# outputs equal to bertshard.v1 Infer's (`shardctl infer --output`), bad input refused while the job
# keeps serving. A real checkpoint (all-MiniLM-L6-v2) served TP 2 x PP 2 as "minilm".
#
# Needs the project venv (BERTSHARD_VENV: tritonclient[http,grpc], tools/requirements-test.txt)
# and the checkpoint (BERTSHARD_MODEL_DIR); SKIPPED without them, FAILED under CI=true.
set -euo pipefail

source tests/skip_or_fail.sh
require_venv kserve_clients_test
"$venv/bin/python" -c "import tritonclient.http, tritonclient.grpc" 2>/dev/null ||
  skip kserve_clients_test "tritonclient is not in $venv (tools/requirements-test.txt)"
require_model kserve_clients_test

WORK="$TEST_TMPDIR"
SHARDCTL=client/shardctl
printf 'kserve-cluster-secret\n' >"$WORK/cluster.token"
printf 'kserve-read-secret\n' >"$WORK/read.token"

pids=()
trap 'status=$?; for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done;
      wait 2>/dev/null || true; [ "$status" -eq 0 ] || tail -n 30 "$WORK"/*.log >&2; exit "$status"' EXIT
server/bertshard-coordinator --listen=127.0.0.1:0 --http_listen=127.0.0.1:0 --data_dir="$WORK/coordinator" \
  --auth_token_file="$WORK/cluster.token" --read_token_file="$WORK/read.token" --default_job=minilm \
  --drain_timeout=2s >"$WORK/coordinator.log" 2>&1 &
pids+=($!)
source tools/local_cluster.sh
grpc_port=$(wait_for_port "$WORK/coordinator.log")
http_port=$(wait_for_logged_port "$WORK/coordinator.log" 's/^http listening on port \([0-9]*\).*/\1/p')
export BERTSHARD_SERVER="127.0.0.1:$grpc_port"
for i in 1 2 3 4; do
  worker/shard-worker --listen=127.0.0.1:0 --coordinator="$BERTSHARD_SERVER" --threads=1 \
    --auth_token_file="$WORK/cluster.token" --drain_timeout=2s >"$WORK/worker$i.log" 2>&1 &
  pids+=($!)
done
"$SHARDCTL" submit --token-file="$WORK/cluster.token" --checkpoint="$model" --tp=2 --pp=2 --name=minilm --watch \
  >"$WORK/submit-minilm.out"

"$venv/bin/python" tests/kserve_clients_test.py --http "127.0.0.1:$http_port" --grpc "127.0.0.1:$grpc_port" \
  --shardctl "$SHARDCTL" --read_token_file "$WORK/read.token"

# Every server drains and exits 0 with KServe requests behind it.
for p in "${pids[@]}"; do kill -TERM "$p"; done
for p in "${pids[@]}"; do wait "$p"; done
pids=()
echo "kserve_clients_test: PASSED"
