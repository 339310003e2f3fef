#!/usr/bin/env bash
# Parity with HuggingFace transformers on a real pretrained checkpoint: tests/hf_parity_test.py
# compares `shardctl run --local` (several TP / PP / SP layouts) and a coordinator with four workers
# started here (submit, infer, cancel) against BertModel and sentence-transformers' embeddings.
#
# Needs the HF venv (BERTSHARD_HF_VENV, from `tools/python_env.sh hf`) and the checkpoint
# (BERTSHARD_MODEL_DIR, from tools/fetch_model.sh); tools/test.sh passes both. Without them the test
# says SKIPPED and passes, except under CI=true, where it fails.
set -euo pipefail

source tests/skip_or_fail.sh
hf_venv="${BERTSHARD_HF_VENV:-}"
model="${BERTSHARD_MODEL_DIR:-}"
if [ -z "$hf_venv" ] || [ ! -x "$hf_venv/bin/python" ]; then
  skip hf_parity_test "no HF venv (BERTSHARD_HF_VENV='$hf_venv'; \`tools/python_env.sh hf\` makes it, tools/test.sh passes it)"
fi
if [ -z "$model" ] || [ ! -f "$model/config.json" ] || [ ! -f "$model/model.safetensors" ]; then
  skip hf_parity_test "no pretrained checkpoint (BERTSHARD_MODEL_DIR='$model'; tools/fetch_model.sh fetches it, tools/test.sh passes it)"
fi
"$hf_venv/bin/python" -c "import numpy, torch, transformers, tokenizers, safetensors.numpy" 2>"$TEST_TMPDIR/import.err" ||
  skip hf_parity_test "$hf_venv cannot import the reference packages: $(tail -n 1 "$TEST_TMPDIR/import.err")"

# Offline: the reference reads the checkpoint directory only.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HOME="$TEST_TMPDIR/hf_home" TOKENIZERS_PARALLELISM=false

WORK="$TEST_TMPDIR"
COORDINATOR_BIN=server/bertshard-coordinator
WORKER_BIN=worker/shard-worker
source tools/local_cluster.sh
# On failure, the servers' own words say most about why.
trap 'status=$?; stop_cluster || true; [ "$status" -eq 0 ] || tail -n 40 "$WORK"/*.log >&2; exit "$status"' EXIT
start_coordinator
start_workers 4

mkdir -p "$WORK/parity"
"$hf_venv/bin/python" tests/hf_parity_test.py --shardctl "$PWD/client/shardctl" --rank "$PWD/worker/shard-rank" \
  --model "$model" --work "$WORK/parity" --server "$BERTSHARD_SERVER"
stop_cluster
