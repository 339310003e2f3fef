#!/usr/bin/env bash
# A stranger against a live job's rendezvous (issue 21, item 1): a coordinator and two workers on
# loopback with a cluster token, a TP 2 job submitted, and tests/rendezvous_stranger_test.py
# attacking every port the workers open for it with torch.distributed.TCPStore (Debian's
# python3-torch) while it loads and once it is READY.
set -euo pipefail

source tests/skip_or_fail.sh
/usr/bin/python3 -c "import torch.distributed" 2>/dev/null ||
  skip rendezvous_stranger_test "Debian's python3-torch is not installed (tools/install_deps.sh)"

WORK="$TEST_TMPDIR"
COORDINATOR_BIN=server/bertshard-coordinator
WORKER_BIN=worker/shard-worker
# Tokens on: what the stranger could not get through gRPC it must not get through the rendezvous.
export BERTSHARD_TOKEN="rendezvous-stranger-test-token"
source tools/local_cluster.sh
trap 'status=$?; stop_cluster || true; [ "$status" -eq 0 ] || tail -n 40 "$WORK"/*.log >&2; exit "$status"' EXIT
start_coordinator
start_workers 2
/usr/bin/python3 tests/rendezvous_stranger_test.py --shardctl client/shardctl --server "$BERTSHARD_SERVER" \
  --worker_pids "${CLUSTER_PIDS[1]},${CLUSTER_PIDS[2]}" --model tests/testdata/model/bert_model
stop_cluster
