#!/usr/bin/env bash
# Prints a LibTorch directory (include/, lib/) for BERTSHARD_LIBTORCH, taken from the pinned,
# hash-checked PyTorch wheel of tools/requirements-libtorch.txt: the `torch/` directory of the wheel,
# with the CUDA runtime and CUPTI libraries its libtorch_cpu.so needs beside it, where its RPATH
# looks (../../nvidia/cu13/lib). Made once, outside the tree, keyed by the requirements' hash.
#
#   BERTSHARD_LIBTORCH=$(bash tools/libtorch_from_wheel.sh) bazel test //...
#   CUDA_HOME=$(bash tools/libtorch_from_wheel.sh --cuda-home) BERTSHARD_LIBTORCH=... bazel build --config=cuda //...
#
# --cuda-home prints instead a CUDA_HOME (include/, lib64/) of the CUDA 13 headers and NCCL the
# wheel was built with, for compiling and linking the NCCL backend against it; running that needs a
# GPU host's own PyTorch (BERTSHARD_LIBTORCH pointing at it), which has the rest of CUDA.
#
# The wheel is the cp311 manylinux_2_28 one whatever the host's Python (the C++ libraries are the
# same in every cp* wheel); nothing is imported, so no Python 3.11 is needed.
set -euo pipefail
cd "$(dirname "$0")/.."
req=tools/requirements-libtorch.txt
key=$(sha256sum "$req" | cut -c1-12)
root="${BERTSHARD_LIBTORCH_ROOT:-$HOME/.cache/bertshard}/libtorch-$key"
if [ ! -f "$root/.complete" ]; then
  rm -rf "$root" "$root.tmp"
  mkdir -p "$root.tmp/wheels" "$root.tmp/site-packages"
  echo "libtorch_from_wheel: downloading $(grep -cE '^[a-z]' "$req") wheels (about 550 MB) into $root" >&2
  /usr/bin/python3 -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --require-hashes --python-version 3.11 --platform manylinux_2_28_x86_64 --platform manylinux_2_25_x86_64 \
    --platform manylinux_2_18_x86_64 --platform manylinux_2_17_x86_64 -r "$req" -d "$root.tmp/wheels" >&2
  for wheel in "$root.tmp/wheels"/*.whl; do
    # Only the C++ parts: headers, shared libraries, CMake files (not the Python package).
    /usr/bin/python3 - "$wheel" "$root.tmp/site-packages" <<'PY'
import sys, zipfile
wheel, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    keep = [n for n in z.namelist()
            if n.startswith(("torch/include/", "torch/lib/", "torch/share/cmake/", "nvidia/"))]
    z.extractall(out, keep)
PY
  done
  rm -rf "$root.tmp/wheels"
  # The shared libraries lose their execute bits in a zip; the loader does not need them, but
  # some tools (ldd) do.
  find "$root.tmp/site-packages" -name '*.so*' -exec chmod a+rx {} +
  # A CUDA_HOME for --config=cuda (third_party/cuda.bzl): headers, and the plain library names the
  # linker's -lcudart/-lnccl look for.
  sp="$root.tmp/site-packages"
  mkdir -p "$root.tmp/cuda/include" "$root.tmp/cuda/lib64"
  cp -r "$sp/nvidia/cu13/include/." "$sp/nvidia/nccl/include/." "$root.tmp/cuda/include/"
  ln -s ../../site-packages/nvidia/cu13/lib/libcudart.so.13 "$root.tmp/cuda/lib64/libcudart.so"
  ln -s ../../site-packages/nvidia/nccl/lib/libnccl.so.2 "$root.tmp/cuda/lib64/libnccl.so"
  touch "$root.tmp/.complete"
  mv "$root.tmp" "$root"
fi
if [ "${1:-}" = "--cuda-home" ]; then
  echo "$root/cuda"
else
  echo "$root/site-packages/torch"
fi
