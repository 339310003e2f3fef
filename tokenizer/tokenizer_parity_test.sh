#!/usr/bin/env bash
# Token-for-token parity of the C++ WordPiece tokenizer (tokenize_tool) with HuggingFace tokenizers:
# tokenizer/tokenizer_parity_test.py says what is compared (Debian's fortune databases in six
# languages, generated edge cases, every Unicode code point, truncation, decoding), uncased with
# bert-base-uncased's vocabulary and cased with bert-base-cased's.
#
# Needs the HF venv (BERTSHARD_HF_VENV, from `tools/python_env.sh hf`; tools/test.sh passes it) and
# the fortune packages (tools/install_deps.sh). Without the venv the test says SKIPPED and passes,
# except under CI=true, where it fails.
set -euo pipefail

source tests/skip_or_fail.sh
hf_venv="${BERTSHARD_HF_VENV:-}"
if [ -z "$hf_venv" ] || [ ! -x "$hf_venv/bin/python" ]; then
  skip tokenizer_parity_test "no HF venv (BERTSHARD_HF_VENV='$hf_venv'; \`tools/python_env.sh hf\` makes it, tools/test.sh passes it)"
fi
"$hf_venv/bin/python" -c "import tokenizers, transformers" 2>"$TEST_TMPDIR/import.err" ||
  skip tokenizer_parity_test "$hf_venv cannot import tokenizers and transformers: $(tail -n 1 "$TEST_TMPDIR/import.err")"

# Offline, and nothing written outside the test's directory.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HOME="$TEST_TMPDIR/hf_home"
# Uncased and cased configurations, each with its own real vocabulary (tests/testdata/vocab/README.md).
exec "$hf_venv/bin/python" tokenizer/tokenizer_parity_test.py --tool tokenizer/tokenize_tool \
  --uncased_vocab tests/testdata/vocab/bert-base-uncased-vocab.txt \
  --cased_vocab tests/testdata/vocab/bert-base-cased-vocab.txt
