#!/usr/bin/env bash
# Creates (once) the virtual environment with the pinned test packages of tools/requirements-test.txt
# and prints its path. The environment lives outside the tree, keyed by the requirements' hash, so a
# changed pin builds a new one and an unchanged one is reused. Needs python3-venv (install_deps.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
req=tools/requirements-test.txt
key=$(sha256sum "$req" | cut -c1-12)
venv="${BERTSHARD_VENV_ROOT:-$HOME/.cache/bertshard}/venv-$key"
if [ ! -x "$venv/bin/python" ] || [ ! -f "$venv/.complete" ]; then
  rm -rf "$venv"
  mkdir -p "$(dirname "$venv")"
  echo "python_env: creating $venv from $req" >&2
  /usr/bin/python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check -r "$req" >&2
  touch "$venv/.complete"
fi
echo "$venv"
