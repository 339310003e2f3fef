#!/usr/bin/env bash
# tools/gpu_check.sh as far as a machine without a GPU can take it (issue 11: "dry-run ... it must
# fail with a clear message, not a stack trace, where there is no GPU"):
#   - without a GPU it exits 2 saying why, with the reason in $OUT/report.txt;
#   - its comparison (tools/gpu_check.py parity) is run for real on the CPU: our unsharded fp32
#     forward (Gloo) against HF's BertModel passes, and another model's outputs fail it;
#   - its input maker gives rows of the asked shape within the vocabulary;
#   - its service step (tools/service_parity.sh: a coordinator, one worker per device, a TP job over
#     them, Infer) runs with CPU workers and Gloo, and its outputs pass the same comparison.
# The comparison needs the HF venv (BERTSHARD_HF_VENV): SKIPPED without it (a failure under CI=true).
set -euo pipefail
source tests/skip_or_fail.sh
work="$TEST_TMPDIR"

# 1. No GPU: a clear refusal. /usr/bin/python3 holds Debian's CPU-only torch (install_deps.sh).
set +e
OUT="$work/out" BERTSHARD_GPU_PYTHON=/usr/bin/python3 bash tools/gpu_check.sh > "$work/nogpu.log" 2>&1
status=$?
set -e
[ "$status" = 2 ] || { echo "FAIL: without a GPU gpu_check exited $status, not 2"; cat "$work/nogpu.log"; exit 1; }
grep -q "gpu_check: FAILED: no usable GPU: torch .* sees no CUDA device" "$work/out/report.txt" ||
  { echo "FAIL: the report does not say why"; cat "$work/out/report.txt"; exit 1; }
if grep -q "Traceback" "$work/nogpu.log"; then echo "FAIL: a stack trace"; cat "$work/nogpu.log"; exit 1; fi

hf_venv="${BERTSHARD_HF_VENV:-}"
if [ -z "$hf_venv" ] || [ ! -x "$hf_venv/bin/python" ]; then
  skip gpu_check_test "no HF venv for the comparison (BERTSHARD_HF_VENV='$hf_venv'; tools/test.sh passes it)"
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HOME="$work/hf_home" BERTSHARD_GPU_CHECK_DEVICE=cpu
config='{"vocab_size": 3000, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128,
         "num_hidden_layers": 2, "max_position_embeddings": 64}'
client/shardctl init-checkpoint --variant BertModel --seed 1 --config "$config" --out "$work/a" > /dev/null
client/shardctl init-checkpoint --variant BertModel --seed 2 --config "$config" --out "$work/b" > /dev/null

# 2. The input maker: 3 rows of 16 ids, each inside the vocabulary.
"$hf_venv/bin/python" tools/gpu_check.py input "$work/a" 16 3 "$work/input.json"
"$hf_venv/bin/python" - "$work/input.json" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))
assert len(j["input_ids"]) == 3 and all(len(r) == 16 for r in j["input_ids"]), j
assert all(0 < t < 3000 for r in j["input_ids"] for t in r), j
PY

# 3. The comparison: ours against HF on the same weights passes; on other weights it fails.
for model in a b; do
  client/shardctl run --local --checkpoint "$work/$model" --input "$work/input.json" \
    --output "$work/ours-$model.safetensors" --rank-binary worker/shard-rank > /dev/null
done
"$hf_venv/bin/python" tools/gpu_check.py parity "$work/a" "$work/input.json" "$work/ours-a.safetensors" fp32 |
  tee "$work/pass.log"
grep -q "parity fp32: PASS" "$work/pass.log"
set +e
"$hf_venv/bin/python" tools/gpu_check.py parity "$work/a" "$work/input.json" "$work/ours-b.safetensors" fp32 \
  > "$work/fail.log" 2>&1
status=$?
set -e
cat "$work/fail.log"
[ "$status" = 1 ] && grep -q "parity fp32: FAIL" "$work/fail.log" ||
  { echo "FAIL: other weights passed the comparison (exit $status)"; exit 1; }

# 4. The service step (tools/service_parity.sh), as gpu_check runs it with GPU workers and NCCL,
# here with two CPU workers and Gloo: a coordinator, TP 2 over the workers, Infer, against HF.
SHARDCTL=client/shardctl COORDINATOR=server/bertshard-coordinator WORKER=worker/shard-worker \
  bash tools/service_parity.sh gloo "$work/a" "$work/input.json" "$work/service.safetensors" "$work/service-logs" \
  cpu cpu || { echo "FAIL: the service step"; tail -n 5 "$work"/service-logs/*.log; exit 1; }
"$hf_venv/bin/python" tools/gpu_check.py parity "$work/a" "$work/input.json" "$work/service.safetensors" fp32 |
  tee "$work/service.log"
grep -q "parity fp32: PASS" "$work/service.log" || { echo "FAIL: the service's outputs differ from HF"; exit 1; }
echo "PASS"
