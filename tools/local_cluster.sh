# Shell helpers to run a coordinator and workers on loopback; sourced by tools/demo.sh,
# bench/service_benchmark.sh and tests/python_client_test.sh. Needs COORDINATOR_BIN, WORKER_BIN
# and WORK (a scratch directory); collects child pids in CLUSTER_PIDS. With METRICS_LISTEN set
# (e.g. 127.0.0.1:0) every server also serves Prometheus metrics there (see wait_for_metrics_port).

CLUSTER_PIDS=()

# The first port that sed script SCRIPT prints from LOG, waiting up to ~10 s.
wait_for_logged_port() {
  local port=""
  for _ in $(seq 100); do
    port=$(sed -n "$2" "$1" | head -n 1)
    [ -n "$port" ] && { echo "$port"; return 0; }
    sleep 0.1
  done
  cat "$1" >&2
  return 1
}

# The port a server printed ("listening on port N") in LOG; not its metrics or HTTP line.
wait_for_port() {
  wait_for_logged_port "$1" '/^\(metrics\|http\) /!s/.*listening on port \([0-9]*\).*/\1/p'
}

# The metrics port a server printed ("metrics listening on port N") in LOG.
wait_for_metrics_port() {
  wait_for_logged_port "$1" 's/^metrics listening on port \([0-9]*\).*/\1/p'
}

# Starts a coordinator on a free loopback port and exports BERTSHARD_SERVER.
start_coordinator() {
  # shellcheck disable=SC2086  # COORDINATOR_FLAGS: extra flags, split on spaces
  "$COORDINATOR_BIN" --listen=127.0.0.1:0 --data_dir="$WORK/coordinator" \
    ${METRICS_LISTEN:+--metrics_listen="$METRICS_LISTEN"} ${COORDINATOR_FLAGS:-} >"$WORK/coordinator.log" 2>&1 &
  CLUSTER_PIDS+=($!)
  local port
  port=$(wait_for_port "$WORK/coordinator.log") || return 1
  export BERTSHARD_SERVER="127.0.0.1:${port}"
}

# Starts N workers registered with the coordinator.
start_workers() {
  for i in $(seq "$1"); do
    "$WORKER_BIN" --listen=127.0.0.1:0 --coordinator="$BERTSHARD_SERVER" --threads=1 \
      ${METRICS_LISTEN:+--metrics_listen="$METRICS_LISTEN"} >"$WORK/worker$i.log" 2>&1 &
    CLUSTER_PIDS+=($!)
  done
}

# SIGTERM everything started here and wait for it (each drains and exits 0); fails if any did not.
stop_cluster() {
  local status=0
  for p in "${CLUSTER_PIDS[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for p in "${CLUSTER_PIDS[@]}"; do wait "$p" || status=1; done
  CLUSTER_PIDS=()
  return "$status"
}
