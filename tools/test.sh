#!/usr/bin/env bash
# Runs the whole test suite: installs the Debian packages it needs, builds everything (including
# the benchmark binary) and runs every test. Works on a fresh Debian 12 machine.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install_deps.sh

log=$(mktemp)
status=0
bazel test //... --test_output=errors --nocache_test_results 2>&1 | tee "$log" || status=$?
# The NCCL backend is optional (--config=cuda); where CUDA and NCCL are installed, compile and link
# it and run its tests (they skip the GPU parts without a GPU).
if [ "$status" -eq 0 ] && [ -f "${CUDA_HOME:-/usr/local/cuda}/include/nccl.h" ]; then
  bazel test --config=cuda //worker:nccl_collectives_test --test_output=errors --nocache_test_results 2>&1 |
    tee -a "$log" || status=$?
  bazel build --config=cuda //worker:shard-rank 2>&1 | tail -1 || status=$?
fi
passed=$(grep -cE '^//.* PASSED in' "$log" || true)
failed=$(grep -cE '^//.* (FAILED|TIMEOUT|NO STATUS|FAILED TO BUILD)' "$log" || true)
rm -f "$log"
if [ "$status" -ne 0 ] && [ "$failed" -eq 0 ]; then
  failed=1  # the build itself failed
fi
echo "${passed} passed, ${failed} failed"
exit "$status"
