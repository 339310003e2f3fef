"""Forward throughput of two peers of bertshard on one HF BERT checkpoint, CPU, fp32:

  - PyTorch eager: HuggingFace transformers' BertModel (eager attention) on this Python's torch
    (Debian's python3-torch), under torch.inference_mode with torch.set_num_threads(threads);
  - ONNX Runtime: the same model exported with torch.onnx.export (no download), put through ORT's
    BERT graph optimiser (onnxruntime.transformers.optimizer.optimize_model, model_type "bert"),
    run by an InferenceSession on the CPU with intra_op_num_threads=threads, inter_op 1, sequential.

Inputs are deterministic: batch x seq ids drawn by random.Random(seed) from [1000, vocab_size),
attention_mask all ones, token_type_ids all zeros. They are written to --inputs-json in the format
`shardctl run --local --input` reads, so that bertshard runs exactly the same tokens.

Each peer does one warm-up forward, then --iterations timed forwards; seq/s = batch / median time.
ORT's last_hidden_state must be within 1e-4 (max abs) of HF's or this script fails (exit 1).

Run with the bench venv's python (`bash tools/python_env.sh bench`); bench/peers_benchmark.sh does.
  python bench/peers.py --checkpoint DIR --batch 8 --seq 128 --threads 2 --iterations 5 --json OUT

--inputs-only writes just the tokens (--inputs-json) and exits; it needs nothing but the standard
library (numpy, torch and the rest are imported after it), so bench/suite.sh makes the tokens every
engine runs with Debian's /usr/bin/python3 and the peers later draw the very same ones.
  /usr/bin/python3 bench/peers.py --inputs-only --checkpoint DIR --batch 8 --seq 128 --inputs-json OUT
"""
import argparse
import json
import os
import platform
import random
import re
import statistics
import sys
import tempfile
import time

TOLERANCE = 1e-4


def log(message):
    print("peers: " + message, file=sys.stderr, flush=True)


def fail(message):
    print("peers: FAILED: " + message, file=sys.stderr, flush=True)
    sys.exit(1)


def make_inputs(vocab_size, batch, seq, seed):
    """The benchmark's tokens: reproducible from (seed, vocab_size, batch, seq) alone."""
    if vocab_size <= 1000:
        fail("vocab_size %d leaves no ids in [1000, vocab_size)" % vocab_size)
    rng = random.Random(seed)
    ids = [[rng.randrange(1000, vocab_size) for _ in range(seq)] for _ in range(batch)]
    return {
        "input_ids": ids,
        "attention_mask": [[1] * seq for _ in range(batch)],
        "token_type_ids": [[0] * seq for _ in range(batch)],
    }


def time_forwards(forward, iterations):
    """One warm-up forward, then `iterations` timed ones; returns (seconds per forward, last output)."""
    out = forward()
    seconds = []
    for _ in range(iterations):
        start = time.perf_counter()
        out = forward()
        seconds.append(time.perf_counter() - start)
    return seconds, out


def summary(seconds, batch):
    median = statistics.median(seconds)
    return {
        "seq_per_s": batch / median,
        "median_forward_s": median,
        "forward_seconds": seconds,
    }


def torch_blas():
    """The BLAS this torch was built with (Debian's: OpenBLAS), from its build configuration."""
    import torch

    match = re.search(r"BLAS_INFO=([^,\s]+)", torch.__config__.show())
    return match.group(1) if match else "?"


def load_hf(checkpoint):
    from transformers import BertModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # loading problems are checked here, not warned about
    model, loading = BertModel.from_pretrained(checkpoint, attn_implementation="eager", output_loading_info=True)
    # A checkpoint of a head variant (bert.* names) loads into BertModel with the head's weights
    # unexpected; what matters is that no BertModel weight is missing (left random).
    if loading["missing_keys"] or loading["mismatched_keys"] or loading["error_msgs"]:
        fail("%s does not load into BertModel: %s" % (checkpoint, loading))
    return model.eval().float()


def export_onnx(model, inputs, path):
    """torch.onnx.export of the HF model (TorchScript exporter of torch 1.13), dynamic batch and seq."""
    import torch

    names = ["input_ids", "attention_mask", "token_type_ids"]
    axes = {n: {0: "batch", 1: "seq"} for n in names}
    axes["last_hidden_state"] = {0: "batch", 1: "seq"}
    axes["pooler_output"] = {0: "batch"}
    with torch.no_grad():
        torch.onnx.export(model, tuple(inputs[n] for n in names), path, input_names=names,
                          output_names=["last_hidden_state", "pooler_output"], dynamic_axes=axes,
                          opset_version=14, do_constant_folding=True)


def optimize(onnx_path, optimized_path, config):
    from onnxruntime.transformers.optimizer import optimize_model

    optimized = optimize_model(onnx_path, model_type="bert", num_heads=config.num_attention_heads,
                               hidden_size=config.hidden_size)
    fused = {k: int(v) for k, v in optimized.get_fused_operator_statistics().items()}
    fully = bool(optimized.is_fully_optimized(fused))
    optimized.save_model_to_file(optimized_path)
    op_counts = {}
    for node in optimized.model.graph.node:
        op_counts[node.op_type] = op_counts.get(node.op_type, 0) + 1
    return fused, fully, op_counts


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="HF BERT directory (config.json + model.safetensors)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--iterations", type=int, default=5, help="timed forwards per peer, after one warm-up")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", help="where to write the figures (required unless --inputs-only)")
    parser.add_argument("--inputs-json", help="write the inputs here, in shardctl run --local --input format")
    parser.add_argument("--reference", help="write HF's last_hidden_state here (.npy), to check other runs against")
    parser.add_argument("--work-dir", help="keep the exported and optimised ONNX graphs here (default: a temp dir)")
    parser.add_argument("--inputs-only", action="store_true",
                        help="write the tokens to --inputs-json (vocab_size from the checkpoint's config.json) and exit")
    opts = parser.parse_args()
    if min(opts.batch, opts.seq, opts.threads, opts.iterations) < 1:
        fail("--batch, --seq, --threads and --iterations must be positive")
    if opts.inputs_only:
        if not opts.inputs_json:
            fail("--inputs-only needs --inputs-json")
        with open(os.path.join(opts.checkpoint, "config.json")) as f:
            config = json.load(f)
        if opts.seq > config.get("max_position_embeddings", opts.seq):
            fail("--seq %d exceeds max_position_embeddings %d" % (opts.seq, config["max_position_embeddings"]))
        with open(opts.inputs_json, "w") as f:
            json.dump(make_inputs(config["vocab_size"], opts.batch, opts.seq, opts.seed), f)
        return
    if not opts.json:
        fail("--json is required")

    import numpy as np
    import onnxruntime as ort
    import torch
    import transformers

    torch.set_num_threads(opts.threads)
    model = load_hf(opts.checkpoint)
    config = model.config
    if opts.seq > config.max_position_embeddings:
        fail("--seq %d exceeds max_position_embeddings %d" % (opts.seq, config.max_position_embeddings))
    inputs = make_inputs(config.vocab_size, opts.batch, opts.seq, opts.seed)
    if opts.inputs_json:
        with open(opts.inputs_json, "w") as f:
            json.dump(inputs, f)
    torch_inputs = {k: torch.tensor(v, dtype=torch.int64) for k, v in inputs.items()}
    np_inputs = {k: np.asarray(v, dtype=np.int64) for k, v in inputs.items()}

    log("PyTorch eager: %d+1 forwards of %dx%d, %d threads" % (opts.iterations, opts.batch, opts.seq, opts.threads))

    def hf_forward():
        with torch.inference_mode():
            return model(**torch_inputs).last_hidden_state

    hf_seconds, hf_hidden = time_forwards(hf_forward, opts.iterations)
    hf_hidden = hf_hidden.numpy()
    if opts.reference:
        np.save(opts.reference, hf_hidden)

    with tempfile.TemporaryDirectory() as tmp:
        work = opts.work_dir or tmp
        os.makedirs(work, exist_ok=True)
        onnx_path = os.path.join(work, "bert.onnx")
        optimized_path = os.path.join(work, "bert.opt.onnx")
        log("exporting to ONNX (torch.onnx.export, opset 14)")
        start = time.perf_counter()
        export_onnx(model, torch_inputs, onnx_path)
        export_s = time.perf_counter() - start
        del model  # its weights are in the graph now
        log("ORT BERT optimiser (optimize_model, model_type bert, %d heads, hidden %d)"
            % (config.num_attention_heads, config.hidden_size))
        start = time.perf_counter()
        fused, fully, op_counts = optimize(onnx_path, optimized_path, config)
        optimize_s = time.perf_counter() - start
        log("fused operators: %s%s" % (", ".join("%s %d" % kv for kv in fused.items() if kv[1]) or "none",
                                        "" if fully else " (NOT fully optimised)"))
        if not fused.get("Attention") and not fused.get("MultiHeadAttention"):
            fail("ORT's optimiser fused no attention: the exported graph's pattern was not recognised (%s)" % fused)

        so = ort.SessionOptions()
        so.intra_op_num_threads = opts.threads
        so.inter_op_num_threads = 1
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        session = ort.InferenceSession(optimized_path, so, providers=["CPUExecutionProvider"])
        feed = {i.name: np_inputs[i.name] for i in session.get_inputs()}
        log("ONNX Runtime: %d+1 forwards" % opts.iterations)
        ort_seconds, ort_out = time_forwards(lambda: session.run(["last_hidden_state"], feed), opts.iterations)
        ort_hidden = ort_out[0]

    diff = float(np.max(np.abs(ort_hidden.astype(np.float64) - hf_hidden.astype(np.float64))))
    result = {
        "checkpoint": os.path.abspath(opts.checkpoint),
        "config": {k: getattr(config, k) for k in ("num_hidden_layers", "hidden_size", "num_attention_heads",
                                                   "intermediate_size", "vocab_size")},
        "batch": opts.batch,
        "seq": opts.seq,
        "threads": opts.threads,
        "iterations": opts.iterations,
        "seed": opts.seed,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "onnxruntime": ort.__version__,
            "onnx": __import__("onnx").__version__,
            "numpy": np.__version__,
            "torch_blas": torch_blas(),
        },
        "pytorch_eager": summary(hf_seconds, opts.batch),
        "onnxruntime": dict(summary(ort_seconds, opts.batch), fused_operators=fused, fully_optimized=fully,
                            optimized_graph_ops=op_counts, export_seconds=export_s, optimize_seconds=optimize_s,
                            max_abs_diff_vs_eager=diff),
    }
    with open(opts.json, "w") as f:
        json.dump(result, f, indent=2)
    log("PyTorch eager %.2f seq/s, ONNX Runtime %.2f seq/s, ORT vs eager max abs diff %.2e"
        % (result["pytorch_eager"]["seq_per_s"], result["onnxruntime"]["seq_per_s"], diff))
    if not diff <= TOLERANCE:
        fail("ONNX Runtime's last_hidden_state differs from HF eager's by %.3e (> %g)" % (diff, TOLERANCE))


if __name__ == "__main__":
    main()
