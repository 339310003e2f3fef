#!/usr/bin/env bash
# Prints a CUDA_HOME (include/, lib64/) with the CUDA runtime and NCCL headers and libraries taken
# from the pinned, hash-checked NVIDIA wheels of tools/requirements-cuda.txt. Made once, outside the
# tree, keyed by the requirements' hash. For compiling and linking the NCCL backend where no CUDA
# toolkit is installed; running it on a GPU still needs the NVIDIA driver (libcuda.so).
set -euo pipefail
cd "$(dirname "$0")/.."
req=tools/requirements-cuda.txt
key=$(sha256sum "$req" | cut -c1-12)
home="${BERTSHARD_CUDA_WHEELS_ROOT:-$HOME/.cache/bertshard}/cuda-$key"
if [ ! -f "$home/.complete" ]; then
  rm -rf "$home" "$home.tmp"
  mkdir -p "$home.tmp/wheels" "$home.tmp/x"
  echo "cuda_from_wheels: downloading $(grep -c '^nvidia' "$req") wheels into $home" >&2
  /usr/bin/python3 -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --require-hashes --platform manylinux2014_x86_64 --python-version 3.11 -r "$req" -d "$home.tmp/wheels" >&2
  for wheel in "$home.tmp/wheels"/*.whl; do
    /usr/bin/python3 -m zipfile -e "$wheel" "$home.tmp/x"
  done
  mkdir -p "$home.tmp/include" "$home.tmp/lib64"
  cp -r "$home.tmp/x/nvidia/cuda_runtime/include/." "$home.tmp/x/nvidia/nccl/include/." "$home.tmp/include/"
  cp -r "$home.tmp/x/nvidia/cuda_nvcc/include/crt" "$home.tmp/x/nvidia/cuda_cccl/include/nv" "$home.tmp/include/"
  cp "$home.tmp/x/nvidia/cuda_runtime/lib/libcudart.so.12" "$home.tmp/x/nvidia/nccl/lib/libnccl.so.2" "$home.tmp/lib64/"
  # The wheels carry only the versioned sonames; the linker's -lcudart/-lnccl want the plain names.
  ln -s libcudart.so.12 "$home.tmp/lib64/libcudart.so"
  ln -s libnccl.so.2 "$home.tmp/lib64/libnccl.so"
  rm -rf "$home.tmp/wheels" "$home.tmp/x"
  touch "$home.tmp/.complete"
  mv "$home.tmp" "$home"
fi
echo "$home"
