#!/usr/bin/env bash
# The coordinator's HTTP port (--http_listen, docs/http.md) driven by clients we did not write:
# OpenAI's Python SDK (`openai`: client.embeddings.create with floats, base64, dimensions and
# token ids; a wrong key -> AuthenticationError; models.list) and `requests` on every TEI route,
# for their success and error shapes (400 empty input, 413 over the batch or payload limit, 422
# malformed, 429 under overload, 401 without the token). Embeddings must equal the gRPC Embed's
# (`shardctl embed --format json`). A real checkpoint (all-MiniLM-L6-v2) served TP 2 x PP 2 as "minilm",
# and a small classifier from tests/testdata, unsharded, as "sentiment" for /predict, and a random
# one-label classifier as "reranker" for /rerank.
#
# The overload is made, not hoped for: with --max_concurrent_requests=1 the first request is held
# on its workers' forward (the worker_forward pause point, common/fault_point.h) while a second one
# is sent.
#
# Needs the project venv (BERTSHARD_VENV: openai, requests), the HF venv for InferenceClient
# (BERTSHARD_HF_VENV: huggingface_hub) and the checkpoint (BERTSHARD_MODEL_DIR); SKIPPED without
# them (the InferenceClient part alone without the HF venv), FAILED under CI=true.
set -euo pipefail

source tests/skip_or_fail.sh
require_venv http_clients_test
"$venv/bin/python" -c "import openai, requests" 2>/dev/null ||
  skip http_clients_test "openai or requests is not in $venv (tools/requirements-test.txt)"
require_model http_clients_test

WORK="$TEST_TMPDIR"
SHARDCTL=client/shardctl
export BERTSHARD_FAULT_DIR="$WORK/faults"
mkdir -p "$BERTSHARD_FAULT_DIR"
printf 'http-cluster-secret\n' >"$WORK/cluster.token"
printf 'http-read-secret\n' >"$WORK/read.token"

# The classifier: tests/testdata's random BertForSequenceClassification with a vocabulary of its
# 99 ids (it ships none), so that /predict takes text.
classifier="$WORK/classifier"
mkdir -p "$classifier"
cp tests/testdata/model/sequence_classification_f16/config.json \
  tests/testdata/model/sequence_classification_f16/model.safetensors "$classifier/"
{
  printf '%s\n' '[PAD]' '[UNK]' '[CLS]' '[SEP]' '[MASK]'
  for i in $(seq 5 98); do printf 'w%d\n' "$i"; done
} >"$classifier/vocab.txt"

# minilm served from a copy whose config_sentence_transformers.json names two prompts (and no
# default, so that every other check sees the texts as they are): /embed_all and /tokenize put them
# before the text themselves (InferenceBackend::Prompt), /embed through Embed.
cp -r "$model" "$WORK/minilm"
chmod -R u+w "$WORK/minilm"
cat >"$WORK/minilm/config_sentence_transformers.json" <<'JSON'
{"__version__": {"sentence_transformers": "2.0.0"}, "prompts": {"query": "query: ", "passage": "passage: "},
 "default_prompt_name": null}
JSON
model="$WORK/minilm"

# A re-ranker: a random one-label BertForSequenceClassification (sentence-transformers' CrossEncoder
# shape) with BERT's vocabulary.
"$SHARDCTL" init-checkpoint --variant BertForSequenceClassification --seed 3 --out "$WORK/reranker" \
  --vocab tests/testdata/vocab/bert-base-uncased-vocab.txt \
  --config '{"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64,
             "max_position_embeddings": 64, "num_labels": 1}' >"$WORK/init-reranker.out"

pids=()
trap 'status=$?; rm -f "$BERTSHARD_FAULT_DIR"/*.hold; for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done;
      wait 2>/dev/null || true; [ "$status" -eq 0 ] || tail -n 30 "$WORK"/*.log >&2; exit "$status"' EXIT
server/bertshard-coordinator --listen=127.0.0.1:0 --http_listen=127.0.0.1:0 --data_dir="$WORK/coordinator" \
  --auth_token_file="$WORK/cluster.token" --read_token_file="$WORK/read.token" --default_job=minilm \
  --max_concurrent_requests=1 --max_client_batch_size=4 --payload_limit=65536 --drain_timeout=2s \
  >"$WORK/coordinator.log" 2>&1 &
pids+=($!)
source tools/local_cluster.sh
grpc_port=$(wait_for_port "$WORK/coordinator.log")
http_port=$(wait_for_logged_port "$WORK/coordinator.log" 's/^http listening on port \([0-9]*\).*/\1/p')
export BERTSHARD_SERVER="127.0.0.1:$grpc_port"
for i in 1 2 3 4 5 6; do
  worker/shard-worker --listen=127.0.0.1:0 --coordinator="$BERTSHARD_SERVER" --threads=1 \
    --auth_token_file="$WORK/cluster.token" --drain_timeout=2s >"$WORK/worker$i.log" 2>&1 &
  pids+=($!)
done
"$SHARDCTL" submit --token-file="$WORK/cluster.token" --checkpoint="$model" --tp=2 --pp=2 --name=minilm --watch \
  >"$WORK/submit-minilm.out"
"$SHARDCTL" submit --token-file="$WORK/cluster.token" --checkpoint="$classifier" --name=sentiment --watch \
  >"$WORK/submit-sentiment.out"
"$SHARDCTL" submit --token-file="$WORK/cluster.token" --checkpoint="$WORK/reranker" --name=reranker --watch \
  >"$WORK/submit-reranker.out"

"$venv/bin/python" tests/http_clients_test.py --http "127.0.0.1:$http_port" --shardctl "$SHARDCTL" \
  --read_token_file "$WORK/read.token" --fault_dir "$BERTSHARD_FAULT_DIR"

# Hugging Face's InferenceClient (huggingface_hub, pinned in tools/requirements-hf.txt; the HF venv)
# posts to the server's URL, which answers with the default job's task: feature_extraction equals
# /embed's vector.
hf_venv="${BERTSHARD_HF_VENV:-}"
if [ -n "$hf_venv" ] && "$hf_venv/bin/python" -c "import huggingface_hub" 2>/dev/null; then
  "$hf_venv/bin/python" - "127.0.0.1:$http_port" "$WORK/read.token" <<'PY'
import json, sys, urllib.request
from huggingface_hub import InferenceClient
address, token = sys.argv[1], open(sys.argv[2]).read().strip()
text = "What is Deep Learning?"
vector = InferenceClient(model="http://" + address, token=token, timeout=60).feature_extraction(text)
request = urllib.request.Request("http://%s/embed" % address, data=json.dumps({"inputs": text}).encode(),
                                 headers={"Authorization": "Bearer " + token, "Content-Type": "application/json"})
with urllib.request.urlopen(request, timeout=60) as answer:
    reference = json.load(answer)[0]
assert vector.shape == (1, len(reference)), vector.shape
worst = max(abs(float(a) - b) for a, b in zip(vector[0], reference))
assert worst <= 1e-6, worst
print("http_clients_test: huggingface_hub InferenceClient.feature_extraction equals /embed")
PY
elif [ "${CI:-}" = "true" ]; then
  echo "FAILED (CI=true, so no skipping): http_clients_test: no HF venv with huggingface_hub (BERTSHARD_HF_VENV='$hf_venv')" >&2
  exit 1
else
  echo "=====================================================================" >&2
  echo "SKIPPED (this part only): InferenceClient: no HF venv (BERTSHARD_HF_VENV='$hf_venv')" >&2
  echo "=====================================================================" >&2
fi

# Every server drains and exits 0 with HTTP requests behind it.
for p in "${pids[@]}"; do kill -TERM "$p"; done
for p in "${pids[@]}"; do wait "$p"; done
pids=()

# HTTPS is absent on the HTTP port (http/http_server.h): beside the gRPC port's TLS files the
# coordinator refuses --http_listen at start (exit 2, saying what to do), never serving the same
# tokens in the clear.
bash tools/make_test_certs.sh "$WORK/certs"
set +e
server/bertshard-coordinator --listen=127.0.0.1:0 --http_listen=127.0.0.1:0 --data_dir="$WORK/tls" \
  --tls_cert="$WORK/certs/server.pem" --tls_key="$WORK/certs/server.key" \
  --auth_token_file="$WORK/cluster.token" --read_token_file="$WORK/read.token" >"$WORK/tls-coordinator.log" 2>&1
rc=$?
set -e
if [ "$rc" -ne 2 ] || ! grep -q "serves plain HTTP only" "$WORK/tls-coordinator.log"; then
  echo "FAILED: --http_listen beside TLS files: exit $rc, not 2 with the reason:" >&2
  cat "$WORK/tls-coordinator.log" >&2
  exit 1
fi
echo "http_clients_test: --http_listen beside the gRPC port's TLS files refused at start"
echo "http_clients_test: PASSED"
