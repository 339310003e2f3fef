#!/usr/bin/env bash
# bertshard's CPU forward next to two peers on the same weights and the same tokens, fp32:
#   - bertshard: `shardctl run --local`, unsharded (1 rank), --threads THREADS (-c opt build);
#   - PyTorch eager: HF transformers' BertModel (eager attention) on Debian's torch 1.13;
#   - ONNX Runtime: the HF model exported with torch.onnx.export and put through ORT's BERT graph
#     optimiser (fused Attention, SkipLayerNormalization, BiasGelu, ...), intra-op THREADS threads.
# The peers run in bench/peers.py (venv: tools/python_env.sh bench), which also writes the tokens it
# used (seeded random ids in [1000, vocab), attention all ones) for bertshard to run. Prints a table
# of seq/s and the ratios bertshard/eager and bertshard/ORT, and writes it with the machine's CPU,
# the versions and the command to bench/results/peers-<date>[-minilm].md.
#
#   bash bench/peers_benchmark.sh                 # random BERT-base (init-checkpoint), ~1 min on 2 cores
#   MODEL=minilm bash bench/peers_benchmark.sh    # all-MiniLM-L6-v2 (tools/fetch_model.sh), ~30 s
#
# Environment: MODEL (bert-base, default, or minilm: $BERTSHARD_MODEL_DIR, else fetched), BATCH (8),
# SEQ (128), THREADS (nproc), ITERATIONS (timed forwards per engine after one warm-up, default 5;
# each figure is batch / median forward), SEED (1: the tokens, and the random checkpoint's weights),
# RESULTS (output file).
#
# Each engine is checked against HF eager on the same batch (last_hidden_state, max abs diff <= 1e-4);
# a larger one fails the run. Figures only: the exit status is 0 unless something fails.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-bert-base}
BATCH=${BATCH:-8}
SEQ=${SEQ:-128}
THREADS=${THREADS:-$(nproc)}
ITERATIONS=${ITERATIONS:-5}
SEED=${SEED:-1}
case "$MODEL" in
  bert-base) suffix="" ;;
  minilm) suffix="-minilm" ;;
  *) echo "peers_benchmark: unknown MODEL '$MODEL' (bert-base or minilm)" >&2; exit 2 ;;
esac
RESULTS=${RESULTS:-bench/results/peers-$(date +%Y-%m-%d)$suffix.md}
command="$(for v in MODEL BATCH SEQ THREADS ITERATIONS SEED; do printf '%s=%s ' "$v" "${!v}"; done)bash bench/peers_benchmark.sh"

python=$(bash tools/python_env.sh bench)/bin/python || {
  echo "peers_benchmark: the bench venv (tools/python_env.sh bench) could not be made: no PyPI?" >&2
  exit 1
}
echo "peers_benchmark: building (-c opt)" >&2
bazel build -c opt //client:shardctl //worker:shard-rank >/dev/null 2>&1 || {
  echo "peers_benchmark: build failed; run: bazel build -c opt //client:shardctl //worker:shard-rank" >&2
  exit 1
}
work=$(mktemp -d)
monitor_pid=
trap '[ -z "$monitor_pid" ] || kill "$monitor_pid" 2>/dev/null || true; rm -rf "$work"' EXIT
# Private copies of the opt binaries: a later build (any config) moves bazel-bin, and may rewrite
# them, while this runs. shard-rank sits next to shardctl, where `run --local` looks for it.
mkdir -p "$work/bin"
for b in client/shardctl worker/shard-rank; do
  cp "bazel-out/k8-opt/bin/$b" "$work/bin/"
done
shardctl=$work/bin/shardctl

if [ "$MODEL" = minilm ]; then
  model_dir=${BERTSHARD_MODEL_DIR:-$(bash tools/fetch_model.sh all-MiniLM-L6-v2)}
  model_name="all-MiniLM-L6-v2 ($model_dir)"
else
  model_dir=$work/bert-base
  "$shardctl" init-checkpoint --variant BertModel --seed "$SEED" --out "$model_dir" >/dev/null
  model_name="BERT-base shape, random weights (shardctl init-checkpoint --variant BertModel --seed $SEED)"
fi

# Share of the CPUs busy before the run, and the CPU other processes use while it runs.
BENCH_NAME=peers_benchmark
source bench/cpu_watch.sh  # (the script runs from the repo root)

echo "peers_benchmark: $MODEL, batch $BATCH x seq $SEQ, $THREADS threads, $ITERATIONS forwards per engine after a warm-up" >&2
# The same thread count for the peers' BLAS/OpenMP pools as shardctl gives its ranks (ORT uses its own).
OMP_NUM_THREADS=$THREADS OPENBLAS_NUM_THREADS=$THREADS "$python" bench/peers.py --checkpoint "$model_dir" --batch "$BATCH" --seq "$SEQ" --threads "$THREADS" \
  --iterations "$ITERATIONS" --seed "$SEED" --json "$work/peers.json" --inputs-json "$work/input.json" \
  --reference "$work/reference.npy"
echo "peers: bertshard: $ITERATIONS+1 forwards (shardctl run --local, unsharded, --threads $THREADS)" >&2
"$shardctl" run --local --checkpoint "$model_dir" --input "$work/input.json" --output "$work/out.safetensors" \
  --report "$work/run.json" --iterations $((ITERATIONS + 1)) --threads "$THREADS" \
  --rank-binary "$work/bin/shard-rank" > "$work/run.txt" || { cat "$work/run.txt" >&2; exit 1; }
kill "$monitor_pid" 2>/dev/null || true
wait "$monitor_pid" 2>/dev/null || true
monitor_pid=

cpu=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n 1)
flags=$(sed -n 's/^flags[[:space:]]*: //p' /proc/cpuinfo | head -n 1)
# The BLAS behind Debian's torch (BLAS_INFO=generic: libblas.so.3, an alternatives link).
libblas=$(readlink -f "$(ldconfig -p | awk '/libblas\.so\.3 /{print $NF; exit}')" 2>/dev/null || echo "?")
mkdir -p "$(dirname "$RESULTS")"
"$python" - "$work" "$RESULTS" "$command" "$model_name" "$cpu" "$flags" "$libblas" "$busy_before" "$(cat "$work/foreign" 2>/dev/null || echo "0 0")" <<'PY'
import datetime, json, os, statistics, sys
import numpy as np
from safetensors.numpy import load_file

work, results, command, model_name, cpu, flags, libblas, busy_before, foreign = sys.argv[1:]
peers = json.load(open(os.path.join(work, "peers.json")))
ranks = json.load(open(os.path.join(work, "run.json")))
batch = peers["batch"]
# bertshard: the slowest rank's forward per iteration (one rank here), the warm-up dropped.
per_iter = [max(r["forward_seconds_all"][i] for r in ranks) for i in range(len(ranks[0]["forward_seconds_all"]))]
steady = per_iter[1:] or per_iter
bs = {"seq_per_s": batch / statistics.median(steady), "median_forward_s": statistics.median(steady),
      "forward_seconds": steady}
eager, ort = peers["pytorch_eager"], peers["onnxruntime"]

# bertshard's output against HF eager's on the same tokens: the same weights and inputs, or a failure.
reference = np.load(os.path.join(work, "reference.npy")).astype(np.float64)
hidden = load_file(os.path.join(work, "out.safetensors"))["last_hidden_state"].astype(np.float64)
bs_diff = float(np.max(np.abs(hidden - reference)))

flag_set = set(flags.split())
isa = [f for f in sorted(flag_set) if f.startswith(("avx512", "amx"))]
f_ticks, e_ticks = (int(x) for x in foreign.split())
foreign_pct = 100 * f_ticks / max(1, e_ticks)
v = peers["versions"]
gemm = ", ".join(sorted({str(r.get("gemm", "?")) for r in ranks}))

rows = [("bertshard (shardctl run --local, unsharded)", bs),
        (f"PyTorch eager (HF BertModel, torch {v['torch']})", eager),
        (f"ONNX Runtime {v['onnxruntime']} (BERT-optimised graph)", ort)]
table = ["| engine | seq/s | median forward | forwards (s) |", "|---|---:|---:|---|"]
for name, r in rows:
    table.append(f"| {name} | {r['seq_per_s']:.2f} | {r['median_forward_s'] * 1000:.0f} ms | "
                 + ", ".join(f"{s:.3f}" for s in r["forward_seconds"]) + " |")
ratios = (f"**bertshard / PyTorch eager: {bs['seq_per_s'] / eager['seq_per_s']:.2f}x**, "
          f"**bertshard / ONNX Runtime: {bs['seq_per_s'] / ort['seq_per_s']:.2f}x**")
fused = ", ".join(f"{k} {n}" for k, n in ort["fused_operators"].items() if n) or "none"
c = peers["config"]
lines = [
    f"# bertshard vs PyTorch eager vs ONNX Runtime, CPU fp32 ({datetime.date.today().isoformat()})",
    "",
    f"Model: {model_name}: {c['num_hidden_layers']} layers, hidden {c['hidden_size']}, "
    f"{c['num_attention_heads']} heads, intermediate {c['intermediate_size']}, vocab {c['vocab_size']}. "
    f"Batch {batch} x seq {peers['seq']} (random ids in [1000, vocab), seed {peers['seed']}, attention all ones), "
    f"{peers['threads']} threads for every engine, {peers['iterations']} forwards each after one warm-up; "
    "seq/s = batch / median forward.",
    "",
    *table,
    "",
    ratios,
    "",
    f"- bertshard: 1 rank, --threads {peers['threads']}, GEMM path {gemm}; max abs diff of last_hidden_state vs HF eager "
    f"{bs_diff:.2e}",
    f"- ONNX Runtime: torch.onnx.export (opset 14) then onnxruntime.transformers.optimizer.optimize_model "
    f"(model_type bert); fused: {fused}{'' if ort['fully_optimized'] else ' (NOT fully optimised)'}; "
    f"intra-op {peers['threads']}, inter-op 1, sequential; max abs diff vs HF eager {ort['max_abs_diff_vs_eager']:.2e}",
    f"- Versions: python {v['python']}, torch {v['torch']} (Debian), transformers {v['transformers']}, "
    f"onnxruntime {v['onnxruntime']}, onnx {v['onnx']}, numpy {v['numpy']}; torch's BLAS: "
    f"BLAS_INFO={v['torch_blas']}, libblas.so.3 -> {libblas}",
    f"- Machine: {cpu}, {os.cpu_count()} CPUs; AVX-512: {'yes' if any(f.startswith('avx512') for f in isa) else 'no'}, "
    f"AMX: {'yes' if any(f.startswith('amx') for f in isa) else 'no'}"
    + (f" ({' '.join(isa)})" if isa else "")
    + f"; AVX2: {'yes' if 'avx2' in flag_set else 'no'}, FMA: {'yes' if 'fma' in flag_set else 'no'}",
    f"- CPU busy before the run: {busy_before}%; used by other processes while it ran: {foreign_pct:.0f}%"
    + (" (the figures are skewed)" if foreign_pct >= 5 or int(busy_before) >= 10 else ""),
    f"- Command: `{command}`",
    "",
]
text = "\n".join(lines)
with open(results, "w") as f:
    f.write(text)
print(text)
print(f"written to {results}", file=sys.stderr)
if not bs_diff <= 1e-4:
    print(f"peers_benchmark: FAILED: bertshard's last_hidden_state differs from HF eager's by {bs_diff:.3e} (> 1e-4)",
          file=sys.stderr)
    sys.exit(1)
PY
