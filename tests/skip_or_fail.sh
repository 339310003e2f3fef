# Sourced by shell tests that need something outside Debian's packages (the project venv, Docker):
# `skip NAME REASON` says SKIPPED loudly and passes, except under CI=true, where it fails;
# `require_venv NAME` skips unless BERTSHARD_VENV (tools/python_env.sh, passed by tools/test.sh)
# points at a usable virtual environment, and sets `venv`; `require_model NAME` skips unless
# BERTSHARD_MODEL_DIR (tools/fetch_model.sh) is a checkpoint directory, and sets `model`.

skip() {
  local name="$1"
  shift
  if [ "${CI:-}" = "true" ]; then
    echo "FAILED (CI=true, so no skipping): $name: $*" >&2
    exit 1
  fi
  echo "=====================================================================" >&2
  echo "SKIPPED: $name: $*" >&2
  echo "=====================================================================" >&2
  exit 0
}

require_venv() {
  venv="${BERTSHARD_VENV:-}"
  if [ -z "$venv" ] || [ ! -x "$venv/bin/python" ]; then
    skip "$1" "no project venv (BERTSHARD_VENV='$venv'; tools/python_env.sh makes it, tools/test.sh passes it)"
  fi
}

require_model() {
  model="${BERTSHARD_MODEL_DIR:-}"
  if [ -z "$model" ] || [ ! -f "$model/config.json" ]; then
    skip "$1" "no real checkpoint (BERTSHARD_MODEL_DIR='$model'; tools/fetch_model.sh makes it)"
  fi
}
