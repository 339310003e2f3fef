"""Parity of bertshard with HuggingFace's own BertModel on a real pretrained checkpoint
(sentence-transformers all-MiniLM-L6-v2, tools/fetch_model.sh), run by hf_parity_test.sh.

The reference is transformers' BertModel (eval, fp32, eager attention) on a padded batch of real
sentences tokenized by BertTokenizerFast from the same directory, plus the sentence embeddings that
sentence-transformers would compute for the checkpoint (mean pooling over the attention mask, then
L2 normalisation: the modules.json / 1_Pooling of the directory, checked below), written out here
exactly as sentence-transformers does (it is not installed).

bertshard is run in two ways, every output compared with the reference (max abs diff <= TOLERANCE;
last_hidden_state only where attention_mask is 1, padded positions are irrelevant):
  - `shardctl run --local` for several tensor / pipeline / sequence-parallel layouts;
  - a coordinator with workers (started by the .sh): `shardctl submit --watch`, `shardctl infer
    --input --output`, `shardctl cancel`, for a few jobs one after the other.

Every path returns a dict {output name: numpy array} (see outputs_from_hidden); compare() checks
whichever of the reference's outputs a path returned. A new path (e.g. `shardctl embed`, returning
only "sentence_embedding") is one more function returning such a dict, added to SERVICE_PATHS.
"""
import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.numpy import load_file
from transformers import BertModel, BertTokenizerFast
from transformers.utils import logging as hf_logging

TOLERANCE = 1e-4
# Reported, not checked: last_hidden_state at positions with attention 0.
PADDED = "hidden (padded, info)"

# Real sentences of different lengths: punctuation, accents (the uncased tokenizer strips them),
# digits, a hyphenated word, and one sentence pair (token_type_ids 1 on its second segment).
EXAMPLES = [
    ("Hello world!", None),
    ("The quick brown fox jumps over the lazy dog.", None),
    ("Café au lait, naïve résumé — déjà vu? Über-cool façade!", None),
    ("A man is playing a guitar on the street corner while people walk by.", None),
    ("How old are you?", "I am twenty-three years old, thank you for asking."),
    ("Sharding BERT over tensor- and pipeline-parallel ranks: does it still match HuggingFace really?", None),
    ("Yes.", None),
    ("In 1905, Einstein published four papers; each one changed physics forever.", None),
]

# (name, shardctl run flags, whether the sequence length must be even: split_gather with tp 2).
LOCAL_CONFIGS = [
    ("tp1_pp1", [], False),
    ("tp2", ["--tp", "2"], False),
    ("pp2", ["--pp", "2"], False),
    ("tp2_pp2", ["--tp", "2", "--pp", "2"], False),
    ("tp2_pp2_mb2", ["--tp", "2", "--pp", "2", "--micro-batches", "2"], False),
    ("tp2_split_gather", ["--tp", "2", "--sp-mode", "split_gather"], True),
]

# Jobs on the service (submit flags, even sequence length needed); run one after the other.
SERVICE_JOBS = [
    ("tp1_pp1", [], False),
    ("tp2_pp2", ["--tp", "2", "--pp", "2"], False),
    ("tp2_split_gather", ["--tp", "2", "--sp-mode", "split_gather"], True),
]


def log(message):
    print(message, flush=True)


def fail(message):
    raise AssertionError(message)


# ---------------------------------------------------------------------------------------------
# Inputs and the HuggingFace reference


def check_sentence_transformers_layout(model_dir):
    """The checkpoint's sentence-transformers pipeline is Transformer -> mean Pooling -> Normalize,
    which is what sentence_embedding() below reproduces."""
    with open(os.path.join(model_dir, "modules.json")) as f:
        modules = [m["type"] for m in json.load(f)]
    expected = ["sentence_transformers.models.Transformer", "sentence_transformers.models.Pooling",
                "sentence_transformers.models.Normalize"]
    if modules != expected:
        fail("modules.json of %s lists %s; this test reproduces %s" % (model_dir, modules, expected))
    with open(os.path.join(model_dir, "1_Pooling", "config.json")) as f:
        pooling = json.load(f)
    modes = sorted(k for k, v in pooling.items() if k.startswith("pooling_mode") and v)
    if modes != ["pooling_mode_mean_tokens"]:
        fail("1_Pooling/config.json of %s enables %s; this test reproduces mean pooling only" % (model_dir, modes))


def tokenize(tokenizer, multiple_of):
    """The examples as one batch padded to the longest (and to a multiple of `multiple_of`)."""
    encodings = [tokenizer(text, pair) for text, pair in EXAMPLES]
    batch = tokenizer.pad(encodings, padding=True, pad_to_multiple_of=multiple_of, return_tensors="pt")
    return {k: batch[k].to(torch.int64) for k in ("input_ids", "attention_mask", "token_type_ids")}


def st_pooling(last_hidden_state, attention_mask, mode, normalize):
    """sentence-transformers' Pooling for cls / max / mean (models/Pooling.py), then Normalize."""
    h = torch.as_tensor(last_hidden_state, dtype=torch.float32)
    mask = torch.as_tensor(attention_mask).unsqueeze(-1).expand(h.size()).float()
    if mode == "cls":
        v = h[:, 0]
    elif mode == "max":
        v = torch.max(h.masked_fill(mask == 0, -1e9), 1)[0]
    else:
        v = torch.sum(h * mask, 1) / torch.clamp(mask.sum(1), min=1e-9)
    return (F.normalize(v, p=2, dim=1) if normalize else v).numpy()


def sentence_embedding(last_hidden_state, attention_mask):
    """sentence-transformers' Pooling (mean tokens) then Normalize: the checkpoint's modules."""
    return st_pooling(last_hidden_state, attention_mask, "mean", True)


def outputs_from_hidden(last_hidden_state, pooler_output, attention_mask):
    """Everything compared, from a path's last_hidden_state and pooler_output."""
    return {
        "last_hidden_state": np.asarray(last_hidden_state, dtype=np.float32),
        "pooler_output": np.asarray(pooler_output, dtype=np.float32),
        "sentence_embedding": sentence_embedding(last_hidden_state, attention_mask),
    }


def reference_outputs(model, batch):
    with torch.no_grad():
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                    token_type_ids=batch["token_type_ids"])
    return outputs_from_hidden(out.last_hidden_state.numpy(), out.pooler_output.numpy(), batch["attention_mask"])


def write_input_json(batch, path):
    with open(path, "w") as f:
        json.dump({k: v.tolist() for k, v in batch.items()}, f)


# ---------------------------------------------------------------------------------------------
# bertshard paths


def run_tool(args, timeout=300):
    started = time.time()
    try:
        result = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        fail("timed out after %ds: %s\nstdout:\n%s\nstderr:\n%s" % (timeout, " ".join(args), e.stdout, e.stderr))
    if result.returncode != 0:
        fail("exit %d: %s\nstdout:\n%s\nstderr:\n%s" % (result.returncode, " ".join(args), result.stdout, result.stderr))
    return result.stdout, time.time() - started


def read_outputs(path, batch):
    tensors = load_file(path)
    for name in ("last_hidden_state", "pooler_output"):
        if name not in tensors:
            fail("%s has no %s (it has %s)" % (path, name, sorted(tensors)))
    return outputs_from_hidden(tensors["last_hidden_state"], tensors["pooler_output"], batch["attention_mask"])


def local_run_outputs(opts, flags, batch, input_json, name):
    """`shardctl run --local` with FLAGS."""
    output = os.path.join(opts.work, "local_%s.safetensors" % name)
    _, seconds = run_tool([opts.shardctl, "run", "--local", "--checkpoint", opts.model, "--rank-binary", opts.rank,
                           "--input", input_json, "--output", output, "--timeout", "240"] + flags)
    log("  local %-18s %5.1f s" % (name, seconds))
    return read_outputs(output, batch)


def service_infer_outputs(opts, job, batch, input_json, name):
    """`shardctl infer JOB --input --output` on the coordinator."""
    output = os.path.join(opts.work, "service_%s.safetensors" % name)
    _, seconds = run_tool([opts.shardctl, "infer", job, "--input", input_json, "--output", output,
                           "--server", opts.server])
    log("  service infer %-10s %5.1f s" % (name, seconds))
    return read_outputs(output, batch)


def embed_json(opts, args):
    out, seconds = run_tool([opts.shardctl, "embed"] + args + ["--format", "json", "--server", opts.server])
    response = json.loads(out)
    vectors = np.asarray([e["values"] for e in response["embeddings"]], dtype=np.float32)
    return response, vectors, seconds


def service_embed_outputs(opts, job, batch, input_json, name):
    """`shardctl embed JOB --input` (token rows): the checkpoint's pooling (mean, then normalised)."""
    response, vectors, seconds = embed_json(opts, [job, "--input", input_json])
    log("  service embed %-10s %5.1f s" % (name, seconds))
    if response.get("pooling") not in ("POOLING_MEAN", 1) or not response.get("normalized"):
        fail("Embed did not apply the checkpoint's pooling (mean, normalised): %s" % {
            k: v for k, v in response.items() if k != "embeddings"})
    return {"sentence_embedding": vectors}


# The ways a READY job is asked for outputs: (path name, function(opts, job, batch, input_json, name)).
SERVICE_PATHS = [
    ("infer", service_infer_outputs),
    ("embed", service_embed_outputs),
]


def check_text_embeddings(opts, job, tokenizer, model):
    """`shardctl embed JOB TEXT...` tokenises on the coordinator: the vectors equal
    sentence-transformers' for the same texts (its tokenizer, its pooling), for the checkpoint's
    pooling and for overrides. Returns [(where, {output: diff})] and failures."""
    texts = [text for text, pair in EXAMPLES if pair is None]
    encoded = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**{k: encoded[k] for k in ("input_ids", "attention_mask", "token_type_ids")}).last_hidden_state
    results, failures = [], []
    for pooling, normalize in ((None, None), ("cls", False), ("max", True), ("mean", False)):
        args = [job] + texts
        if pooling:
            args += ["--pooling", pooling, "--normalize", "true" if normalize else "false"]
        response, vectors, _ = embed_json(opts, args)
        counts = [int(c) for c in response.get("token_counts", [])]
        if counts != encoded["attention_mask"].sum(1).tolist():
            failures.append("embed text: token counts %s, HF tokenizer %s" % (counts, encoded["attention_mask"].sum(1).tolist()))
        expected = st_pooling(hidden, encoded["attention_mask"], pooling or "mean", True if normalize is None else normalize)
        diff = float(np.abs(vectors.astype(np.float64) - expected).max()) if vectors.shape == expected.shape else float("inf")
        where = "service embed text %s" % (pooling or "default")
        results.append((where, {"sentence_embedding": diff}))
        if not diff <= TOLERANCE:
            failures.append("%s: differs from sentence-transformers by %.3g (shapes %s, %s)" % (
                where, diff, vectors.shape, expected.shape))
    return results, failures


# ---------------------------------------------------------------------------------------------
# Comparison


def compare(reference, got, attention_mask, where):
    """Max abs diff per output that GOT has; last_hidden_state over positions with attention 1.
    Returns {output: diff} and a list of failures."""
    mask = np.asarray(attention_mask).astype(bool)
    diffs, failures = {}, []
    for name, expected in reference.items():
        if name not in got:
            continue
        actual = got[name]
        if actual.shape != expected.shape:
            failures.append("%s: %s has shape %s, HuggingFace %s" % (where, name, actual.shape, expected.shape))
            continue
        if not np.all(np.isfinite(actual)):
            failures.append("%s: %s has non-finite values" % (where, name))
            continue
        error = np.abs(actual.astype(np.float64) - expected.astype(np.float64))
        if name == "last_hidden_state":
            if (~mask).any():  # padded positions: informational only, HF leaves them unspecified
                diffs[PADDED] = float(error[~mask].max())
            error = error[mask]  # [valid tokens, hidden]
        diff = float(error.max())
        diffs[name] = diff
        if not diff <= TOLERANCE:
            index = np.unravel_index(int(np.argmax(error)), error.shape)
            failures.append("%s: %s differs from HuggingFace by %.3g > %.0e (at %s%s)" % (
                where, name, diff, TOLERANCE, "valid token/hidden " if name == "last_hidden_state" else "", index))
    if not diffs:
        failures.append("%s: no output to compare (got %s)" % (where, sorted(got)))
    return diffs, failures


# ---------------------------------------------------------------------------------------------


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shardctl", required=True)
    parser.add_argument("--rank", required=True, help="the shard-rank binary")
    parser.add_argument("--model", required=True)
    parser.add_argument("--work", required=True)
    parser.add_argument("--server", help="coordinator with >= 4 free workers; without it the service is not checked")
    opts = parser.parse_args()
    started = time.time()
    torch.set_num_threads(2)

    check_sentence_transformers_layout(opts.model)
    hf_logging.set_verbosity_error()  # loading problems are checked below, not warned about
    tokenizer = BertTokenizerFast.from_pretrained(opts.model)
    model, loading = BertModel.from_pretrained(opts.model, attn_implementation="eager", output_loading_info=True)
    model = model.eval().float()
    if loading["missing_keys"] or loading["mismatched_keys"] or loading["error_msgs"]:
        fail("HuggingFace did not load %s fully: %s" % (opts.model, loading))

    # Two batches: padded to the longest, and padded on to an even length (split_gather with tp 2).
    batches, inputs, references = {}, {}, {}
    for even in (False, True):
        batch = tokenize(tokenizer, 2 if even else None)
        batches[even] = batch
        inputs[even] = os.path.join(opts.work, "input_%s.json" % ("even" if even else "longest"))
        write_input_json(batch, inputs[even])
        references[even] = reference_outputs(model, batch)
    lengths = batches[False]["attention_mask"].sum(1).tolist()
    pair_row = [i for i, (_, pair) in enumerate(EXAMPLES) if pair is not None]
    if not all(batches[False]["token_type_ids"][i].max() == 1 for i in pair_row):
        fail("the sentence pair has no token_type_ids 1")
    if len(set(lengths)) < 2:
        fail("the examples do not need padding")
    if batches[False]["input_ids"].shape[1] % 2 == 0:
        fail("the longest example should have an odd token count, so that split_gather pads further")
    log("HuggingFace reference: %d examples, token counts %s, seq %d (even batch: %d); %.1f s" % (
        len(EXAMPLES), lengths, batches[False]["input_ids"].shape[1], batches[True]["input_ids"].shape[1],
        time.time() - started))

    results = []  # (where, {output: diff})
    failures = []

    def check(where, even, got):
        diffs, problems = compare(references[even], got, batches[even]["attention_mask"], where)
        results.append((where, diffs))
        failures.extend(problems)

    for name, flags, even in LOCAL_CONFIGS:
        check("run --local " + name, even, local_run_outputs(opts, flags, batches[even], inputs[even], name))

    if opts.server:
        for name, flags, even in SERVICE_JOBS:
            out, seconds = run_tool([opts.shardctl, "submit", "--checkpoint", opts.model, "--watch",
                                     "--server", opts.server] + flags)
            job = out.splitlines()[0].strip()
            log("  service job %s (%s) READY in %.1f s" % (job, name, seconds))
            try:
                for path, function in SERVICE_PATHS:
                    check("service %s %s" % (path, name), even, function(opts, job, batches[even], inputs[even], name))
                if name == "tp2_pp2":
                    more, problems = check_text_embeddings(opts, job, tokenizer, model)
                    results.extend(more)
                    failures.extend(problems)
            except BaseException:
                # Free the workers, but let the first failure be the one reported.
                subprocess.run([opts.shardctl, "cancel", job, "--server", opts.server], timeout=60)
                raise
            run_tool([opts.shardctl, "cancel", job, "--server", opts.server])  # frees the workers for the next job

    log("")
    outputs = list(references[False]) + [PADDED]
    log("max abs diff vs HuggingFace (tolerance %.0e; last_hidden_state over attention-1 positions):" % TOLERANCE)
    log("  %-32s %s" % ("", " ".join("%21s" % o for o in outputs)))
    for where, diffs in results:
        log("  %-32s %s" % (where, " ".join("%21s" % ("%.3e" % diffs[o] if o in diffs else "-") for o in outputs)))
    log("total %.1f s" % (time.time() - started))
    if failures:
        log("")
        for f in failures:
            log("MISMATCH: " + f)
        fail("%d mismatch(es) with HuggingFace, see above" % len(failures))
    log("PASSED")


if __name__ == "__main__":
    try:
        main()
    except AssertionError as e:
        print("FAILED: %s" % e, file=sys.stderr, flush=True)
        sys.exit(1)
