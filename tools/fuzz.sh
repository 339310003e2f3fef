#!/usr/bin/env bash
# Runs every libFuzzer target of //fuzz for SECONDS each (default 60) on its corpus, with clang,
# ASan and UBSan (--config=fuzz). New inputs that add coverage go to a scratch corpus (the
# repository's seeds stay as they are); a crash stops the target, and the crashing input is kept as
# fuzz/corpus/<target>/crash-<hash> so that `bazel test //fuzz:all` replays it from then on (give it
# a name that says what it broke, and fix the code). Prints executions and new coverage per target.
#
#   bash tools/fuzz.sh [SECONDS] [TARGET...]     targets: plan_request hf_config safetensors tokenizer infer_request http_api kserve_raw
# Needs clang and libclang-rt-14-dev: BERTSHARD_DEPS=fuzz bash tools/install_deps.sh installs them.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-60}
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(plan_request hf_config safetensors tokenizer infer_request http_api kserve_raw)
if ! command -v clang++ >/dev/null || ! ls /usr/lib/llvm-14/lib/clang/*/lib/linux/libclang_rt.fuzzer-x86_64.a >/dev/null 2>&1; then
  echo "fuzz: clang and libFuzzer are missing: BERTSHARD_DEPS=fuzz bash tools/install_deps.sh" >&2
  exit 2
fi
bazel build --config=fuzz $(printf '//fuzz:%s_fuzzer ' "${targets[@]}") > /dev/null 2>&1 || {
  echo "fuzz: the --config=fuzz build failed: bazel build --config=fuzz //fuzz:all" >&2
  exit 1
}
status=0
for t in "${targets[@]}"; do
  scratch=$(mktemp -d)
  log=$(mktemp)
  echo "fuzz: $t for ${seconds}s"
  if ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
      "bazel-bin/fuzz/${t}_fuzzer" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
      -artifact_prefix="fuzz/corpus/$t/" "$scratch" "fuzz/corpus/$t" > "$log" 2>&1; then
    # libFuzzer's last status line (executions, coverage, corpus) and its run count.
    { grep -E "^#[0-9]+" "$log" | tail -n 1; grep -E "^Done [0-9]+ runs" "$log" | tail -n 1; } | sed "s/^/fuzz: $t: /" || true
  else
    status=1
    echo "fuzz: $t FOUND A CRASH:" >&2
    grep -E "ERROR|SUMMARY|runtime error|crash-" "$log" | head -n 20 >&2
  fi
  rm -rf "$scratch" "$log"
done
exit $status
