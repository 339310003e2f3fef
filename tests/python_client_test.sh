#!/usr/bin/env bash
# Runs tests/python_client.py against a real coordinator process on loopback.
set -euo pipefail
gen="$TEST_TMPDIR/gen"
mkdir -p "$gen/stdproto"
# grpc.health.v1 / grpc.reflection.v1alpha would land in a `grpc` package that shadows grpcio's own:
# copy them under another directory (their proto packages, hence service names, are unchanged).
cp /usr/share/grpc-proto/grpc/health/v1/health.proto "$gen/stdproto/health.proto"
cp /usr/share/grpc-proto/grpc/reflection/v1alpha/reflection.proto "$gen/stdproto/reflection.proto"
/usr/bin/python3 -m grpc_tools.protoc -Iproto -I"$gen" --python_out="$gen" --grpc_python_out="$gen" \
  proto/bertshard/v1/model_config.proto proto/bertshard/v1/plan.proto proto/bertshard/v1/job.proto \
  proto/bertshard/v1/worker.proto proto/bertshard/v1/coordinator.proto \
  "$gen/stdproto/health.proto" "$gen/stdproto/reflection.proto"
server/bertshard-coordinator --listen=127.0.0.1:0 --data_dir="$TEST_TMPDIR/coordinator" >"$TEST_TMPDIR/coordinator.out" 2>&1 &
coordinator=$!
trap 'kill "$coordinator" 2>/dev/null || true' EXIT
port=""
for _ in $(seq 200); do
  port=$(sed -n 's/.*listening on port \([0-9]*\).*/\1/p' "$TEST_TMPDIR/coordinator.out")
  [ -n "$port" ] && break
  sleep 0.05
done
[ -n "$port" ] || { cat "$TEST_TMPDIR/coordinator.out"; exit 1; }
workers=()
for i in 1 2; do
  worker/shard-worker --listen=127.0.0.1:0 --coordinator="127.0.0.1:$port" >"$TEST_TMPDIR/worker$i.out" 2>&1 &
  workers+=($!)
done
trap 'kill "$coordinator" "${workers[@]}" 2>/dev/null || true' EXIT
PYTHONPATH="$gen" /usr/bin/python3 tests/python_client.py "127.0.0.1:$port"
kill -TERM "${workers[@]}" "$coordinator"
wait "$coordinator"
