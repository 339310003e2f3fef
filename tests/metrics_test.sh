#!/usr/bin/env bash
# Starts a real coordinator and two workers on loopback, each with --metrics_listen, and runs
# tests/metrics_test.py against them: real requests through shardctl, then both kinds of /metrics
# scraped and parsed with prometheus_client's text parser (the reference client's), and the
# counters checked to have moved by exactly the requests sent; then a coordinator and a worker with a
# read token, whose /metrics need it.
#
# Needs the project venv (BERTSHARD_VENV, from tools/python_env.sh; tools/test.sh passes it).
# Without it the test says SKIPPED and passes, except under CI=true, where it fails.
set -euo pipefail

source tests/skip_or_fail.sh
require_venv metrics_test
"$venv/bin/python" -c "import prometheus_client.parser" 2>/dev/null ||
  skip metrics_test "prometheus_client is not in $venv (tools/requirements-test.txt)"

WORK="$TEST_TMPDIR"
COORDINATOR_BIN=server/bertshard-coordinator
WORKER_BIN=worker/shard-worker
METRICS_LISTEN=127.0.0.1:0
source tools/local_cluster.sh
# On failure, the servers' own words say most about why.
trap 'status=$?; stop_cluster || true; [ "$status" -eq 0 ] || tail -n 40 "$WORK"/*.log >&2; exit "$status"' EXIT
start_coordinator
start_workers 2
coordinator_metrics="127.0.0.1:$(wait_for_metrics_port "$WORK/coordinator.log")"
worker1_metrics="127.0.0.1:$(wait_for_metrics_port "$WORK/worker1.log")"
worker2_metrics="127.0.0.1:$(wait_for_metrics_port "$WORK/worker2.log")"

# A --metrics_listen that is not HOST:PORT, or that cannot be bound, stops a server at start.
refused() {  # EXPECTED_MESSAGE COMMAND...
  local expected="$1"
  shift
  if "$@" >"$WORK/refused.out" 2>&1; then
    echo "FAILED: accepted: $*" >&2
    exit 1
  fi
  grep -qF -e "$expected" "$WORK/refused.out" || { cat "$WORK/refused.out" >&2; exit 1; }
}
refused "--metrics_listen: INVALID_ARGUMENT: metrics address 'nonsense' is not HOST:PORT" \
  "$COORDINATOR_BIN" --listen=127.0.0.1:0 --data_dir="$WORK/refused" --metrics_listen=nonsense
refused "--metrics_listen: UNAVAILABLE: cannot serve metrics on $coordinator_metrics" \
  "$WORKER_BIN" --listen=127.0.0.1:0 --metrics_listen="$coordinator_metrics"

"$venv/bin/python" tests/metrics_test.py --shardctl client/shardctl --server "$BERTSHARD_SERVER" \
  --coordinator_metrics "$coordinator_metrics" --worker_metrics "$worker1_metrics,$worker2_metrics" \
  --model tests/testdata/model/bert_model
# Every server drains and exits 0 with its metrics endpoint running.
stop_cluster

# With a read token, /metrics (which names jobs) needs it, or the cluster token, as a bearer token:
# 401 without, as ListJobs is refused without. Prometheus sends it from bearer_token_file.
printf 'metrics-cluster-secret\n' >"$WORK/cluster.token"
printf 'metrics-read-secret\n' >"$WORK/read.token"
"$COORDINATOR_BIN" --listen=127.0.0.1:0 --data_dir="$WORK/tokens" --metrics_listen=127.0.0.1:0 \
  --auth_token_file="$WORK/cluster.token" --read_token_file="$WORK/read.token" --drain_timeout=1s \
  >"$WORK/token-coordinator.log" 2>&1 &
token_pids=($!)
"$WORKER_BIN" --listen=127.0.0.1:0 --metrics_listen=127.0.0.1:0 --auth_token_file="$WORK/cluster.token" \
  --read_token_file="$WORK/read.token" --drain_timeout=1s >"$WORK/token-worker.log" 2>&1 &
token_pids+=($!)
trap 'status=$?; kill "${token_pids[@]}" 2>/dev/null || true; [ "$status" -eq 0 ] || tail -n 40 "$WORK"/*.log >&2; exit "$status"' EXIT
for log in token-coordinator token-worker; do
  port=$(wait_for_metrics_port "$WORK/$log.log")
  "$venv/bin/python" - "127.0.0.1:$port" "$log" <<'PY'
import sys, urllib.error, urllib.request
address, name = sys.argv[1], sys.argv[2]
def status(token):
    request = urllib.request.Request("http://%s/metrics" % address)
    if token is not None:
        request.add_header("Authorization", "Bearer " + token)
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status
    except urllib.error.HTTPError as e:
        return e.code
for token, expected in ((None, 401), ("wrong", 401), ("metrics-read-secret", 200), ("metrics-cluster-secret", 200)):
    got = status(token)
    assert got == expected, "%s /metrics with token %r: %d, expected %d" % (name, token, got, expected)
print("metrics_test: %s /metrics needs the read token" % name)
PY
done
kill -TERM "${token_pids[@]}"
wait "${token_pids[@]}"
