#!/usr/bin/env bash
# Creates (once) a virtual environment with pinned PyPI packages and prints its path.
#
#   tools/python_env.sh                  # tools/requirements-test.txt (metrics parser, validators)
#   tools/python_env.sh hf               # tools/requirements-hf.txt (transformers, tokenizers), with
#                                        # system site packages: Debian's python3-torch and numpy
#   tools/python_env.sh bench            # tools/requirements-bench.txt (hf's, plus onnxruntime and
#                                        # onnx for bench/peers_benchmark.sh, sentence-transformers for
#                                        # bench/http_benchmark.sh), system site packages too
#   tools/python_env.sh infinity         # tools/requirements-infinity.txt (infinity-emb and its own
#                                        # torch 2.5, ~5.6 GB), no system site packages
#
# The environment lives outside the tree, keyed by the requirements' hash (with those of the files it
# includes with -r), so a changed pin builds a new one and an unchanged one is reused. Needs
# python3-venv (install_deps.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
req=tools/requirements-test.txt
venv_flags=()
name=venv
case "${1:-}" in
  "") ;;
  hf) req=tools/requirements-hf.txt; venv_flags=(--system-site-packages); name=venv-hf ;;
  bench) req=tools/requirements-bench.txt; venv_flags=(--system-site-packages); name=venv-bench ;;
  infinity) req=tools/requirements-infinity.txt; name=venv-infinity ;;
  *) echo "python_env: unknown environment '$1' (known: hf, bench, infinity)" >&2; exit 2 ;;
esac
# The requirements file and those it includes (-r FILE, relative to it; one level deep).
req_files=("$req")
while read -r included; do
  req_files+=("$(dirname "$req")/$included")
done < <(sed -n 's/^-r[[:space:]]*\([^[:space:]#]*\).*/\1/p' "$req")
key=$(cat "${req_files[@]}" | sha256sum | cut -c1-12)
venv="${BERTSHARD_VENV_ROOT:-$HOME/.cache/bertshard}/$name-$key"
if [ ! -x "$venv/bin/python" ] || [ ! -f "$venv/.complete" ]; then
  rm -rf "$venv"
  mkdir -p "$(dirname "$venv")"
  echo "python_env: creating $venv from $req" >&2
  /usr/bin/python3 -m venv "${venv_flags[@]}" "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check -r "$req" >&2
  touch "$venv/.complete"
fi
echo "$venv"
