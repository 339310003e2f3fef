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
WORK="$TEST_TMPDIR"
COORDINATOR_BIN=server/bertshard-coordinator
WORKER_BIN=worker/shard-worker
source tools/local_cluster.sh
trap stop_cluster EXIT
start_coordinator
start_workers 2
PYTHONPATH="$gen" /usr/bin/python3 tests/python_client.py "$BERTSHARD_SERVER"
stop_cluster
