"""The report of bench/suite.sh: every figure and every ratio of issue 9's targets, from one run.

Standard library only (Debian's /usr/bin/python3). bench/suite.sh runs it with its work directory,
where each step left a line in runs.jsonl (kind: gemm, baseline, page_cache, forward, peers, real_model) and the
files that line names. Prints the report (markdown), writes it to --results, and, when --results-md
is given, rewrites that file (bench/RESULTS.md) with the header, the throughput table and the target
lines, and a link to the full report.

Definitions (they are printed with the figures, too):
  - forward time of a configuration: per iteration the slowest rank's forward_seconds_all; the
    first (warm-up) dropped; the median of the rest. seq/s = batch / that.
  - forward FLOPs of BERT: per layer and sequence 4*2*s*h*h (Q, K, V, output projections)
    + 2*2*s*h*i (FFN) + 2*2*s*s*h (scores and context), times batch and layers (embeddings, softmax,
    LayerNorm, GELU and the pooler not counted).
  - activations of a rank (an estimate): see activation_estimate().
"""
import argparse
import array
import datetime
import json
import math
import os
import statistics
import struct
import sys

REL_TOL_BF16 = 1e-2
PEER_TOL = 1e-4
NEAR_PAGE_CACHE = 2.0  # "near page-cache read speed": the suite's reading (the issue gives no number)
ELEMENT_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
CONFIG_SHAPES = {  # name: (tp, pp, sp_mode, what)
    "unsharded": (1, 1, "none", "unsharded"),
    "tp2": (2, 1, "none", "TP 2"),
    "pp2": (1, 2, "none", "PP 2"),
    "pp2_il": (1, 2, "none", "PP 2 interleaved"),
    "tp2_sg": (2, 1, "split_gather", "TP 2 + split_gather"),
    "tp2_gloo": (2, 1, "none", "TP 2 over Gloo TCP"),
}
MIB = 2**20


def safetensors_header(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


def read_f32(path, name):
    """A float32 tensor of a safetensors file, as array('f')."""
    header, offset = safetensors_header(path)
    info = header[name]
    if info["dtype"] != "F32":
        raise ValueError(f"{path}:{name} is {info['dtype']}, not F32")
    start, end = info["data_offsets"]
    values = array.array("f")
    with open(path, "rb") as f:
        f.seek(offset + start)
        values.frombytes(f.read(end - start))
    if sys.byteorder != "little":
        values.byteswap()
    return values


def read_npy_f32(path):
    """A little-endian float32 .npy (numpy.save of a C-ordered array), as array('f')."""
    with open(path, "rb") as f:
        if f.read(6) != b"\x93NUMPY":
            raise ValueError(f"{path} is not a .npy file")
        major = f.read(2)[0]
        (n,) = struct.unpack("<H" if major == 1 else "<I", f.read(2 if major == 1 else 4))
        header = f.read(n).decode("latin1")
        if "'<f4'" not in header or "'fortran_order': False" not in header:
            raise ValueError(f"{path}: not a C-ordered <f4 array ({header.strip()})")
        values = array.array("f")
        values.frombytes(f.read())
    if sys.byteorder != "little":
        values.byteswap()
    return values


def compare(a, b):
    """(max abs diff, relative L2 ||a - b|| / ||b||, max abs diff / max |b|) of equal-length arrays."""
    if len(a) != len(b):
        raise ValueError(f"lengths differ: {len(a)} vs {len(b)}")
    max_diff = max((abs(x - y) for x, y in zip(a, b)), default=0.0)
    diff2 = math.fsum((x - y) * (x - y) for x, y in zip(a, b))
    ref2 = math.fsum(y * y for y in b)
    max_ref = max((abs(y) for y in b), default=0.0)
    return max_diff, math.sqrt(diff2 / ref2) if ref2 else float("inf"), max_diff / max_ref if max_ref else float("inf")


def forward_flops(cfg, batch, seq):
    h, i, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    per_layer = 4 * 2 * seq * h * h + 2 * 2 * seq * h * i + 2 * 2 * seq * seq * h
    return per_layer * batch * layers


ACTIVATION_FORMULA = (
    "activations of a rank (estimate, bytes) = e x [max(attention, FFN) + oneDNN copies + B*s*h] + float32 outputs, "
    "with R = (B / micro-batches) * s rows per forward step, tp the TP size, a heads, e the dtype's element size: "
    "attention = 2*R*h (block input, residual sum) + 3*R*h/tp (Q, K, V) + 2*(B/mb)*(a/tp)*s*s (scores, "
    "probabilities) + R*h/tp (context); FFN = 2*R*h + 2*R*i/tp (intermediate before and after GELU); oneDNN copies "
    "(a rank on the oneDNN path) = R*(h + i/tp) (a linear's input in oneDNN's layout and its product before "
    "to_dense); B*s*h: the whole batch's hidden states a rank holds (embeddings output, collected outputs); float32 "
    "outputs (the rank that writes them) = 4*(B*s*h + B*h) for the copy written, twice when the dtype is not fp32 "
    "(the conversion too)")


def activation_estimate(cfg, name, dtype, rank, batch, seq, micro_batches):
    tp, pp, _, _ = CONFIG_SHAPES[name]
    mb = micro_batches if pp > 1 else 1
    h, i, a = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"]
    bm = math.ceil(batch / mb)
    r = bm * seq
    attention = 2 * r * h + 3 * r * h / tp + 2 * bm * (a / tp) * seq * seq + r * h / tp
    ffn = 2 * r * h + 2 * r * i / tp
    copies = r * (h + i / tp) if rank.get("gemm") == "onednn" else 0
    e = DTYPE_BYTES.get(dtype, 4)
    total = e * (max(attention, ffn) + copies + batch * seq * h)
    if rank.get("wrote_outputs"):
        total += 4 * (batch * seq * h + batch * h) * (1 if dtype == "fp32" else 2)
    return total


def slice_bytes(plan, rank, ckpt_header):
    """Bytes of the checkpoint's tensors (in its own dtypes) that the plan gives this rank, padding excluded."""
    entry = next(r for r in plan["ranks"] if r["rank"] == rank)
    total, seen, missing = 0, set(), []
    for t in entry["tensors"]:
        name = t["name"]
        key = next((k for k in (name, "bert." + name, name.removeprefix("bert.")) if k in ckpt_header), None)
        if key is None:
            missing.append(name)
            continue
        if key in seen:
            continue
        seen.add(key)
        shape = t["local_shape"]
        elements = math.prod(shape)
        d = t.get("split_dim", -1)
        if t.get("padding") and d is not None and d >= 0 and shape[d]:
            elements -= t["padding"] * elements // shape[d]
        total += elements * ELEMENT_BYTES[ckpt_header[key]["dtype"]]
    return total, missing


def verdict(ok):
    return "PASS" if ok else "MISS"


def fmt(x, spec=".2f", none="n/a"):
    return none if x is None else format(x, spec)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag in ("--work", "--runs", "--notes", "--results", "--command", "--busy-before", "--smoke"):
        p.add_argument(flag, required=True)
    p.add_argument("--results-md", default="")
    for flag in ("--iterations", "--threads", "--rank-threads", "--batch", "--seq", "--micro-batches"):
        p.add_argument(flag, type=int, required=True)
    o = p.parse_args()
    smoke = o.smoke == "1"
    records = [json.loads(line) for line in open(o.runs) if line.strip()]
    notes = [line.rstrip("\n") for line in open(o.notes) if line.strip()]
    cfg = json.load(open(os.path.join(o.work, "model", "config.json")))
    ckpt_path = os.path.join(o.work, "model", "model.safetensors")
    ckpt_header, _ = safetensors_header(ckpt_path)
    today = datetime.date.today().isoformat()

    gemm = {int(r["threads"]): json.load(open(r["file"])) for r in records if r["kind"] == "gemm"}
    gemm_foreign = {int(r["threads"]): int(r["foreign_percent"]) for r in records if r["kind"] == "gemm"}
    baseline = {int(r["threads"]): json.load(open(r["file"]))["baseline_rss_bytes"]
                for r in records if r["kind"] == "baseline"}
    pc = next(r for r in records if r["kind"] == "page_cache")
    pc_bytes, pc_seconds = int(pc["bytes"]), max(1e-9, float(pc["end"]) - float(pc["start"]))
    pc_rate = pc_bytes / pc_seconds
    cpu = next(iter(gemm.values()))["cpu"]
    has_amx = bool(cpu.get("amx_bf16") or cpu.get("amx_tile"))
    flag_names = [f for f in ("amx_bf16", "amx_tile", "amx_int8", "avx512_bf16", "avx512_fp16", "avx512f", "avx2", "fma")
                  if cpu.get(f)]

    # Forwards.
    runs = {}
    for r in records:
        if r["kind"] != "forward":
            continue
        run = dict(r)
        if r["status"] == "ok":
            ranks = sorted(json.load(open(r["report"])), key=lambda x: x["rank"])
            n = len(ranks[0]["forward_seconds_all"])
            per_iter = [max(k["forward_seconds_all"][j] for k in ranks) for j in range(n)]
            steady = per_iter[1:] or per_iter
            run.update(ranks=ranks, steady=steady, median=statistics.median(steady),
                       seq_per_s=o.batch / statistics.median(steady), plan=json.load(open(r["plan"])))
        runs[(r["config"], r["dtype"])] = run
    dtypes = []
    for (_, d) in runs:
        if d not in dtypes:
            dtypes.append(d)
    ok = lambda c, d: runs.get((c, d), {}).get("status") == "ok"  # noqa: E731

    # Outputs: each run's last_hidden_state.
    outputs = {}
    for key, run in runs.items():
        if run["status"] == "ok" and os.path.exists(run["output"]):
            outputs[key] = read_f32(run["output"], "last_hidden_state")

    flops = forward_flops(cfg, o.batch, o.seq)
    lines = []
    P = lines.append
    title = "bertshard benchmark suite" + (" -- SMOKE run (tiny model: not the issue's figures)" if smoke else "")
    P(f"# {title} ({today})")
    P("")
    P(f"- Machine: {cpu['model_name']}, {os.cpu_count()} CPUs; flags: {' '.join(flag_names) or 'none of note'}; "
      f"AMX: {'yes' if has_amx else 'NO (no amx_bf16/amx_tile in /proc/cpuinfo)'}; LibTorch MKL-DNN: "
      f"{next(iter(gemm.values()))['mkldnn']}")
    P(f"- Model: BertModel, random weights (shardctl init-checkpoint --seed), {cfg['num_hidden_layers']} layers, "
      f"hidden {cfg['hidden_size']}, {cfg['num_attention_heads']} heads, intermediate {cfg['intermediate_size']}, "
      f"vocab {cfg['vocab_size']}; checkpoint {pc_bytes / MIB:.1f} MiB ({', '.join(sorted({v['dtype'] for v in ckpt_header.values()}))})")
    P(f"- Input: batch {o.batch} x seq {o.seq} (bench/peers.py's tokens: seeded random ids, attention all ones); "
      f"{o.iterations} forwards per configuration, the first dropped; forward = median over the rest of the slowest "
      f"rank's forward; seq/s = batch / forward")
    P(f"- Threads: unsharded 1 process x {o.threads}; sharded 2 processes x {o.rank_threads}; peers {o.threads}")
    P(f"- CPU busy before the run: {o.busy_before}%" + (" (the figures are skewed)" if int(o.busy_before) >= 10 else ""))
    P(f"- Command: `{o.command}`")
    for n in notes:
        P(f"- **NOTE: {n}**")
    P("")

    # GEMM peaks.
    P("## GEMM peaks (GFLOP/s, best run after a warm-up; M x K x N = x[M,K] w[N,K]^T, 2MKN flop)")
    P("")
    threads_list = sorted(gemm)
    P("| path | " + " | ".join(f"{t} thread{'s' if t > 1 else ''}: peak" for t in threads_list) + " | per shape |")
    P("|---|" + "---:|" * len(threads_list) + "---|")
    for path in next(iter(gemm.values()))["paths"]:
        cells, detail = [], []
        for t in threads_list:
            g = gemm[t]["paths"][path]
            cells.append(fmt(g.get("peak_gflops"), ".1f", "null"))
            for s in g.get("shapes", []):
                detail.append(f"{t}T {s['shape']}: " + (fmt(s.get("gflops"), ".1f") if s.get("gflops") else
                                                         f"skipped ({s.get('skipped', '')})"))
            if g.get("error"):
                detail.append(f"{t}T: {g['error']}")
        P(f"| {path} | " + " | ".join(cells) + " | " + "; ".join(detail) + " |")
    best_fp32 = {t: max([gemm[t]["paths"][p].get("peak_gflops") or 0 for p in ("fp32_mm", "fp32_onednn")
                         if p in gemm[t]["paths"]] or [0]) for t in threads_list}
    P("")
    P("fp32_mm: at::mm (LibTorch's BLAS: OpenBLAS); fp32_onednn/bf16_onednn: model/gemm.h's OneDnnLinear on a weight "
      "made once by PackOneDnnWeight (float32: transposed for dnnl_sgemm; bf16: oneDNN's layout, with its per-call layout copies), as in the model; bf16_linear: at::linear in bfloat16. "
      + "".join(f"Other processes used {gemm_foreign[t]}% of the CPUs during the {t}-thread run. " for t in threads_list))
    P("")

    # Forward throughput.
    P(f"## Forward throughput (forward FLOPs {flops / 1e9:.2f} GFLOP per batch)")
    P("")
    P("| configuration | processes x threads | dtype | seq/s | forward ms | GFLOP/s | vs unsharded | GEMM picked | other CPU use |")
    P("|---|---|---|---:|---:|---:|---:|---|---:|")
    for name, (tp, pp, sp, what) in CONFIG_SHAPES.items():
        for d in dtypes:
            run = runs.get((name, d))
            if run is None:
                continue
            if run["status"] != "ok":
                P(f"| {what} | | {d} | FAILED | | | | {run.get('log_tail', '').splitlines()[-1:] or ''} | |")
                continue
            procs = "1 x %d" % o.threads if name == "unsharded" else "2 x %d" % o.rank_threads
            if pp > 1:
                procs += f", {o.micro_batches} micro-batches"
            base = runs.get(("unsharded", d))
            vs = run["seq_per_s"] / base["seq_per_s"] if base and base["status"] == "ok" else None
            picks = ", ".join(f"r{k['rank']} {k.get('gemm', '?')}" for k in run["ranks"])
            foreign = int(run.get("foreign_percent", 0))
            P(f"| {what} | {procs} | {d} | {run['seq_per_s']:.2f} | {run['median'] * 1000:.1f} | "
              f"{flops / run['median'] / 1e9:.1f} | {fmt(vs)}x | {picks} | {foreign}%{' (skewed)' if foreign >= 5 else ''} |")
    P("")
    P("GFLOP/s = forward FLOPs / forward time; forward FLOPs = batch x layers x (4*2*s*h*h + 2*2*s*h*i + 2*2*s*s*h): "
      "the Q/K/V/output projections, the FFN's two products, attention scores and context (embeddings, softmax, "
      "LayerNorm, GELU and the pooler not counted).")
    P("")

    # Per rank: memory, checkpoint, load.
    P("## Per rank: peak RSS, checkpoint bytes read, load time")
    P("")
    P(f"Page-cache read of the checkpoint (`cat` twice, the second timed): {pc_bytes / MIB:.1f} MiB in "
      f"{pc_seconds * 1000:.1f} ms = {pc_rate / MIB:.0f} MiB/s. Empty LibTorch process (bench:gemm_peak "
      "--baseline_rss: at::ones({1}) + one tiny at::linear, VmHWM): "
      + ", ".join(f"{baseline[t] / MIB:.1f} MiB with {t} thread{'s' if t > 1 else ''}" for t in sorted(baseline)) + ".")
    P("")
    P("| configuration | dtype | rank | peak RSS MiB | params MiB | activations (est.) MiB | empty process MiB | "
      "RSS / sum | RSS - empty - params MiB | read MiB | slice MiB | read / slice | load s | page-cache s | load / page-cache |")
    P("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    rank_checks = []  # (name, dtype, rank, rss_ratio, read_ratio, load_ratio)
    for name, (tp, pp, sp, what) in CONFIG_SHAPES.items():
        for d in dtypes:
            run = runs.get((name, d))
            if not run or run["status"] != "ok":
                continue
            threads = o.threads if name == "unsharded" else o.rank_threads
            empty = baseline.get(threads, 0)
            for k in run["ranks"]:
                act = activation_estimate(cfg, name, d, k, o.batch, o.seq, o.micro_batches)
                bound = k["param_bytes"] + act + empty
                sl, missing = slice_bytes(run["plan"], k["rank"], ckpt_header)
                read = k["checkpoint_bytes_read"]
                page = read / pc_rate
                rss_ratio, read_ratio = k["peak_rss_bytes"] / bound, read / sl if sl else None
                load_ratio = k["load_seconds"] / page if page else None
                rank_checks.append((name, d, k["rank"], rss_ratio, read_ratio, load_ratio))
                P(f"| {what} | {d} | {k['rank']} | {k['peak_rss_bytes'] / MIB:.1f} | {k['param_bytes'] / MIB:.1f} | "
                  f"{act / MIB:.1f} | {empty / MIB:.1f} | {rss_ratio:.2f} | "
                  f"{(k['peak_rss_bytes'] - empty - k['param_bytes']) / MIB:.1f} | {read / MIB:.1f} | {sl / MIB:.1f}"
                  f"{' (' + str(len(missing)) + ' plan tensors not in the checkpoint)' if missing else ''} | "
                  f"{fmt(read_ratio, '.3f')} | {k['load_seconds']:.3f} | {page:.3f} | {fmt(load_ratio, '.1f')}x |")
    P("")
    P("params = the rank's param_bytes (in its dtype, from its report); slice = the bytes of the checkpoint tensors the "
      "plan gives the rank, in the checkpoint's dtype, without padding; load = the rank's load_seconds (plan, inputs, "
      "checkpoint, weights made and packed; not the GEMM pick); page-cache s = the bytes it read at the page-cache "
      f"rate above. {ACTIVATION_FORMULA}.")
    P("")

    # Outputs: bf16 vs fp32, and each configuration vs unsharded.
    P("## Outputs (last_hidden_state)")
    P("")
    P("| configuration | dtype | vs | max abs diff | relative L2 | max diff / max abs |")
    P("|---|---|---|---:|---:|---:|")
    accuracy = {}
    for name, (_, _, _, what) in CONFIG_SHAPES.items():
        for d in dtypes:
            refs = []
            if d != "fp32" and (name, "fp32") in outputs:
                refs.append((f"{what} fp32", (name, "fp32")))
            if name != "unsharded" and ("unsharded", d) in outputs:
                refs.append((f"unsharded {d}", ("unsharded", d)))
            for label, ref in refs:
                if (name, d) not in outputs:
                    continue
                m, rel, rel_max = compare(outputs[(name, d)], outputs[ref])
                if ref[1] == "fp32" and d != "fp32":
                    accuracy[(name, d)] = rel
                P(f"| {what} | {d} | {label} | {m:.2e} | {rel:.2e} | {rel_max:.2e} |")
    P("")

    # Peers.
    peers_rec = next((r for r in records if r["kind"] == "peers"), None)
    peers = json.load(open(peers_rec["file"])) if peers_rec else None
    bs_vs_ref = None
    P("## Peers (fp32, the same weights and tokens)")
    P("")
    if peers:
        v = peers["versions"]
        eager, ort = peers["pytorch_eager"], peers["onnxruntime"]
        if ("unsharded", "fp32") in outputs:
            ref = read_npy_f32(peers_rec["reference"])
            bs_vs_ref = compare(outputs[("unsharded", "fp32")], ref)[0]
        P("| engine | seq/s | median forward ms |")
        P("|---|---:|---:|")
        if ok("unsharded", "fp32"):
            bs = runs[("unsharded", "fp32")]
            P(f"| bertshard unsharded fp32 (1 x {o.threads} threads, --gemm auto) | {bs['seq_per_s']:.2f} | {bs['median'] * 1000:.1f} |")
        P(f"| PyTorch eager (HF BertModel, torch {v['torch']}, {peers['threads']} threads) | {eager['seq_per_s']:.2f} | "
          f"{eager['median_forward_s'] * 1000:.1f} |")
        P(f"| ONNX Runtime {v['onnxruntime']} (BERT-optimised graph, intra-op {peers['threads']}) | {ort['seq_per_s']:.2f} | "
          f"{ort['median_forward_s'] * 1000:.1f} |")
        fused = ", ".join(f"{k} {n}" for k, n in ort["fused_operators"].items() if n) or "none"
        P("")
        P(f"ORT fused: {fused}{'' if ort['fully_optimized'] else ' (NOT fully optimised)'}; ORT vs eager max abs diff "
          f"{ort['max_abs_diff_vs_eager']:.2e}; bertshard vs eager max abs diff {fmt(bs_vs_ref, '.2e')} (must be <= "
          f"{PEER_TOL:g}); transformers {v['transformers']}, onnx {v['onnx']}, numpy {v['numpy']}, torch BLAS "
          f"{v['torch_blas']}. Other processes used {peers_rec.get('foreign_percent', '?')}% of the CPUs meanwhile.")
    else:
        P("**SKIPPED** (see the notes above): no PyTorch-eager or ONNX Runtime figures in this run.")
    P("")

    # Targets.
    P("## Targets (issue 9, item 4)")
    P("")
    targets = []
    T = targets.append
    t_unsharded = o.threads
    if ok("unsharded", "fp32"):
        bs = runs[("unsharded", "fp32")]
        achieved = flops / bs["median"] / 1e9
        best = best_fp32.get(t_unsharded)
        if best:
            r = achieved / best
            T(f"- {verdict(r >= 0.5)}: unsharded fp32 forward {achieved:.1f} GFLOP/s = {100 * r:.0f}% of the best measured "
              f"fp32 GEMM rate with {t_unsharded} threads ({best:.1f} GFLOP/s) (target >= 50%)")
        else:
            T(f"- NOT MEASURED: the fp32 GEMM peak with {t_unsharded} threads")
        if peers:
            valid = bs_vs_ref is not None and bs_vs_ref <= PEER_TOL
            tag = "" if valid else f" [INVALID: bertshard's output differs from eager's by {fmt(bs_vs_ref, '.2e')}]"
            r = bs["seq_per_s"] / peers["pytorch_eager"]["seq_per_s"]
            T(f"- {verdict(r >= 3 and valid)}: unsharded fp32 / PyTorch eager = {r:.2f}x (target >= 3x){tag}")
            r = bs["seq_per_s"] / peers["onnxruntime"]["seq_per_s"]
            T(f"- {verdict(r >= 1.0 and valid)}: unsharded fp32 / ONNX Runtime = {r:.2f}x (target >= 1.0x){tag}")
        else:
            T("- NOT MEASURED (peers SKIPPED): unsharded fp32 / PyTorch eager (target >= 3x) and / ONNX Runtime (target >= 1.0x)")
    else:
        T("- NOT MEASURED: the unsharded fp32 forward (failed or not run)")
    for d in dtypes:
        if not ok("unsharded", d):
            T(f"- NOT MEASURED: unsharded {d} (failed)")
            continue
        base = runs[("unsharded", d)]["seq_per_s"]
        # Both pipeline schedules are held to the PP 2 target; TP over Gloo shows what shared memory saves.
        for name, target in (("tp2", 0.9), ("pp2", 0.85), ("pp2_il", 0.85), ("tp2_sg", None), ("tp2_gloo", None)):
            if not ok(name, d):
                T(f"- NOT MEASURED: {CONFIG_SHAPES[name][3]} {d} (failed)")
                continue
            r = runs[(name, d)]["seq_per_s"] / base
            if target is None:
                T(f"- INFO: {CONFIG_SHAPES[name][3]} ({2} x {o.rank_threads}) / unsharded (1 x {o.threads}), {d} = {r:.2f}x (no target)")
            else:
                T(f"- {verdict(r >= target)}: {CONFIG_SHAPES[name][3]} (2 x {o.rank_threads}) / unsharded (1 x {o.threads}), "
                  f"{d} = {r:.2f}x (target >= {target}x)")
    if "bf16" in dtypes and ok("unsharded", "bf16") and ok("unsharded", "fp32"):
        r = runs[("unsharded", "bf16")]["seq_per_s"] / runs[("unsharded", "fp32")]["seq_per_s"]
        if has_amx:
            T(f"- {verdict(r >= 1.5)}: unsharded bf16 / fp32 = {r:.2f}x (target >= 1.5x where the CPU has AMX; it has)")
        else:
            T(f"- N/A (this CPU has NO AMX: no amx_bf16/amx_tile in /proc/cpuinfo): unsharded bf16 / fp32 = {r:.2f}x "
              "(the >= 1.5x target applies where the CPU has AMX)")
        for name, (_, _, _, what) in CONFIG_SHAPES.items():
            if name != "unsharded" and ok(name, "bf16") and ok(name, "fp32"):
                r = runs[(name, "bf16")]["seq_per_s"] / runs[(name, "fp32")]["seq_per_s"]
                T(f"- INFO: {what} bf16 / fp32 = {r:.2f}x")
    elif "bf16" not in dtypes:
        T("- NOT MEASURED: bf16 (not in this run: DTYPES, or see the notes) -- bf16 / fp32 >= 1.5x with AMX, outputs within 1e-2")
    order = list(CONFIG_SHAPES)
    for (name, d), rel in sorted(accuracy.items(), key=lambda kv: (order.index(kv[0][0]), kv[0][1])):
        T(f"- {verdict(rel <= REL_TOL_BF16)}: {CONFIG_SHAPES[name][3]} {d} output vs fp32: relative L2 error {rel:.2e} "
          f"(target <= {REL_TOL_BF16:g}; ||y_{d} - y_fp32|| / ||y_fp32|| over last_hidden_state)")
    real = {(r["config"], r["dtype"]): r["output"] for r in records if r["kind"] == "real_model"}
    for name in ("unsharded", "tp2"):
        if (name, "fp32") in real and (name, "bf16") in real:
            _, rel, _ = compare(read_f32(real[(name, "bf16")], "last_hidden_state"),
                                read_f32(real[(name, "fp32")], "last_hidden_state"))
            T(f"- {verdict(rel <= REL_TOL_BF16)}: real model (all-MiniLM-L6-v2, 8 English sentences), {CONFIG_SHAPES[name][3]} "
              f"bf16 vs fp32: relative L2 error {rel:.2e} (target <= {REL_TOL_BF16:g}; over last_hidden_state)")
    if ("unsharded", "fp32") in real and ("tp2", "fp32") in real:
        m, rel, _ = compare(read_f32(real[("tp2", "fp32")], "last_hidden_state"),
                            read_f32(real[("unsharded", "fp32")], "last_hidden_state"))
        T(f"- INFO: real model TP 2 vs unsharded, fp32: max abs diff {m:.2e}, relative L2 {rel:.2e}")
    if not real:
        T("- NOT MEASURED: the real-model bf16 check (skipped or failed: see the notes)")
    if rank_checks:
        worst = max(rank_checks, key=lambda c: c[3])
        n_miss = sum(1 for c in rank_checks if c[3] > 1.1)
        T(f"- {verdict(n_miss == 0)}: peak RSS per rank <= 1.1 x (params + activations (est.) + empty process): "
          f"{len(rank_checks) - n_miss} of {len(rank_checks)} ranks; worst {worst[3]:.2f}x ({CONFIG_SHAPES[worst[0]][3]} "
          f"{worst[1]} rank {worst[2]})")
        reads = [c for c in rank_checks if c[4] is not None]
        if reads:
            worst = max(reads, key=lambda c: c[4])
            n_miss = sum(1 for c in reads if c[4] > 1.05)
            T(f"- {verdict(n_miss == 0)}: checkpoint bytes read per rank <= 1.05 x its slice: {len(reads) - n_miss} of "
              f"{len(reads)} ranks; worst {worst[4]:.3f}x ({CONFIG_SHAPES[worst[0]][3]} {worst[1]} rank {worst[2]})")
        loads = [c for c in rank_checks if c[5] is not None]
        if loads:
            worst = max(loads, key=lambda c: c[5])
            n_miss = sum(1 for c in loads if c[5] > NEAR_PAGE_CACHE)
            T(f"- {verdict(n_miss == 0)}: shard loading near page-cache read speed (the suite's reading: load time <= "
              f"{NEAR_PAGE_CACHE:g} x a page-cache read of the bytes the rank read): {len(loads) - n_miss} of {len(loads)} "
              f"ranks; worst {worst[5]:.1f}x ({CONFIG_SHAPES[worst[0]][3]} {worst[1]} rank {worst[2]})")
    lines.extend(targets)
    if smoke:
        P("")
        P("(SMOKE run: a tiny model; the targets are about BERT-base, `bash bench/suite.sh`.)")
    P("")
    text = "\n".join(lines)
    print(text)
    with open(o.results, "w") as f:
        f.write(text)
    print(f"suite: written to {o.results}", file=sys.stderr)

    if o.results_md:
        table_start = lines.index(next(line for line in lines if line.startswith("## Forward throughput")))
        table_end = lines.index("", table_start + 2)
        rel = os.path.relpath(o.results, os.path.dirname(os.path.abspath(o.results_md)) or ".")
        md = [
            "# Benchmark results",
            "",
            f"Latest run of `bash bench/suite.sh` ({today}); the full report, with the GEMM peaks, the per-rank memory, "
            f"checkpoint and load figures, the outputs and the peers: [{rel}]({rel}).",
            "",
            f"- Machine: {cpu['model_name']}, {os.cpu_count()} CPUs; flags: {' '.join(flag_names) or 'none of note'}; "
            f"AMX: {'yes' if has_amx else 'no'}",
            f"- Date: {today}",
            f"- Command: `{o.command}`",
            f"- CPU busy before the run: {o.busy_before}%",
            *[f"- **NOTE: {n}**" for n in notes],
            "",
            *lines[table_start:table_end],
            "",
            "## Targets",
            "",
            *targets,
            "",
        ]
        with open(o.results_md, "w") as f:
            f.write("\n".join(md))
        print(f"suite: {o.results_md} rewritten", file=sys.stderr)


if __name__ == "__main__":
    main()
