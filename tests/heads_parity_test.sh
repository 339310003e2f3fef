#!/usr/bin/env bash
# Reranking and SPLADE sparse embeddings against HuggingFace transformers (tests/heads_parity_test.py),
# unsharded, TP 2, PP 2 and TP 2 x PP 2, on a coordinator with four workers started here: through
# shardctl (gRPC) and TEI's /embed_sparse and /rerank on the coordinator's HTTP port.
#
# Needs the HF venv (BERTSHARD_HF_VENV, from `tools/python_env.sh hf`), the SPLADE checkpoint
# (BERTSHARD_SPLADE_DIR, from `tools/fetch_model.sh splade-tiny`) and all-MiniLM-L6-v2 for its
# vocabulary (BERTSHARD_MODEL_DIR); tools/test.sh passes all three. Without them the test says
# SKIPPED and passes, except under CI=true, where it fails.
set -euo pipefail

source tests/skip_or_fail.sh
hf_venv="${BERTSHARD_HF_VENV:-}"
splade="${BERTSHARD_SPLADE_DIR:-}"
model="${BERTSHARD_MODEL_DIR:-}"
if [ -z "$hf_venv" ] || [ ! -x "$hf_venv/bin/python" ]; then
  skip heads_parity_test "no HF venv (BERTSHARD_HF_VENV='$hf_venv'; \`tools/python_env.sh hf\` makes it, tools/test.sh passes it)"
fi
if [ -z "$splade" ] || [ ! -f "$splade/model.safetensors" ]; then
  skip heads_parity_test "no SPLADE checkpoint (BERTSHARD_SPLADE_DIR='$splade'; \`tools/fetch_model.sh splade-tiny\` fetches it, tools/test.sh passes it)"
fi
if [ -z "$model" ] || [ ! -f "$model/vocab.txt" ]; then
  skip heads_parity_test "no all-MiniLM-L6-v2 (BERTSHARD_MODEL_DIR='$model'; tools/fetch_model.sh fetches it, tools/test.sh passes it)"
fi
"$hf_venv/bin/python" -c "import numpy, torch, transformers, tokenizers" 2>"$TEST_TMPDIR/import.err" ||
  skip heads_parity_test "$hf_venv cannot import the reference packages: $(tail -n 1 "$TEST_TMPDIR/import.err")"

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HOME="$TEST_TMPDIR/hf_home" TOKENIZERS_PARALLELISM=false

WORK="$TEST_TMPDIR"
COORDINATOR_BIN=server/bertshard-coordinator
WORKER_BIN=worker/shard-worker
source tools/local_cluster.sh
trap 'status=$?; stop_cluster || true; [ "$status" -eq 0 ] || tail -n 40 "$WORK"/*.log >&2; exit "$status"' EXIT
COORDINATOR_FLAGS="--http_listen=127.0.0.1:0"
start_coordinator
http_port=$(wait_for_logged_port "$WORK/coordinator.log" 's/^http listening on port \([0-9]*\).*/\1/p')
start_workers 4

mkdir -p "$WORK/heads"
"$hf_venv/bin/python" tests/heads_parity_test.py --shardctl "$PWD/client/shardctl" --server "$BERTSHARD_SERVER" \
  --http "127.0.0.1:$http_port" --splade "$splade" --vocab-from "$model" --work "$WORK/heads"
stop_cluster
