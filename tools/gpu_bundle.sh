#!/usr/bin/env bash
# Makes gpu-bundle/: what tools/gpu_check.sh needs on a GPU host that has no Bazel, apt or network
# (only a CUDA PyTorch in its python3, CMake, ninja and nvcc). Run here, on the build machine:
#
#   bash tools/gpu_bundle.sh        # then copy the repository (with gpu-bundle/) to the GPU host
#
# It builds shardctl, shard-rank, the coordinator and shard-worker (the service step) and the two
# GPU test binaries (every NCCL collective; out of memory as a status) with --config=cuda -c opt
# against the pinned PyTorch 2.11 /
# CUDA 13 wheel (tools/libtorch_from_wheel.sh), the build GPU hosts run, and copies them with the
# shared libraries they need that such a host lacks (abseil, protobuf, ...; not glibc, libstdc++,
# LibTorch or CUDA, which come from the host and its PyTorch). gpu_check.sh points LD_LIBRARY_PATH
# at bundle/lib and at the host's PyTorch. Kept under 48 MiB, so that a copy of the repository
# with it stays under 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
libtorch=$(bash tools/libtorch_from_wheel.sh)
cuda_home=$(bash tools/libtorch_from_wheel.sh --cuda-home)
# A second output base: the wheel's LibTorch beside Debian's, neither evicting the other's cache.
output_base="${BERTSHARD_GPU_BUNDLE_OUTPUT_BASE:-$HOME/.cache/bertshard/bazel-gpu-bundle}"
targets=(//client:shardctl //worker:shard-rank //server:bertshard-coordinator //worker:shard-worker
         //worker:nccl_collectives_test //model:torch_status_test)
build() {
  BERTSHARD_LIBTORCH="$libtorch" CUDA_HOME="$cuda_home" bazel --output_base="$output_base" "$@" --config=cuda -c opt
}
build build "${targets[@]}" >&2
rm -rf gpu-bundle.tmp
mkdir -p gpu-bundle.tmp/bin gpu-bundle.tmp/lib
# Where Bazel put them (relative to the execution root), asked rather than assumed.
execroot=$(build info execution_root 2>/dev/null)
# (Debian's Bazel predates --output=files: the Starlark output says the same.)
for file in $(build cquery --output=starlark --starlark:expr='" ".join([f.path for f in target.files.to_list()])' \
    "$(IFS=+; echo "${targets[*]}")" 2>/dev/null); do
  cp "$execroot/$file" gpu-bundle.tmp/bin/
done
for target in "${targets[@]}"; do
  [ -x "gpu-bundle.tmp/bin/${target##*:}" ] ||
    { echo "gpu_bundle: bazel cquery did not name the binary of $target" >&2; exit 1; }
done
chmod u+w gpu-bundle.tmp/bin/*
# The libraries the binaries load, as resolved here, less those the GPU host provides itself.
host_provided='^(libc|libm|libdl|librt|libutil|libpthread|libstdc\+\+|libgcc_s|libgomp|ld-linux-x86-64|linux-vdso)\.so'
torch_provided='^(libtorch[a-z_]*|libc10[a-z_]*|libcudart|libcupti|libnccl|libnvshmem[a-z_]*)\.so'
libs=$(for binary in gpu-bundle.tmp/bin/*; do
  LD_LIBRARY_PATH="$libtorch/lib:$libtorch/../nvidia/cu13/lib:$libtorch/../nvidia/nccl/lib" ldd "$binary"
done)
# A library unresolved here would be missing there too, silently: stop instead. (LibTorch's CUDA
# libraries, which the wheel leaves to other packages, come from the GPU host's PyTorch.)
unresolved=$(echo "$libs" | grep "not found" | awk '{print $1}' | grep -vE '^lib(cublas|cublasLt|cudnn|cufft|curand|cusolver|cusparse|cusparseLt|nvJitLink|nvrtc|nvToolsExt|cufile|nvshmem_host)[a-zA-Z_]*\.so' || true)
if [ -n "$unresolved" ]; then
  echo "gpu_bundle: the binaries need libraries not found here: $unresolved" >&2
  exit 1
fi
echo "$libs" | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}' | sort -u | while read -r name path; do
  if [[ "$name" =~ $host_provided || "$name" =~ $torch_provided ]]; then continue; fi
  cp -L "$path" "gpu-bundle.tmp/lib/$name"
done
# ICU's data (the coordinator's tokenizer) is 30 MiB, most of the bundle's budget: carried
# xz-compressed (7 MiB), and unpacked by gpu_check.sh with python3's lzma.
for data in gpu-bundle.tmp/lib/libicudata.so.*; do
  [ -f "$data" ] || continue
  /usr/bin/python3 -c 'import lzma, sys; open(sys.argv[1] + ".xz", "wb").write(lzma.compress(open(sys.argv[1], "rb").read(), preset=9))' "$data"
  rm "$data"
done
{
  echo "built $(date -u +%Y-%m-%dT%H:%M:%SZ) from $(git rev-parse --short HEAD)$(git diff --quiet || echo '+changes')"
  echo "against $(basename "$(dirname "$(dirname "$libtorch")")") (tools/requirements-libtorch.txt)"
  (cd gpu-bundle.tmp && find . -type f -printf '%s %p\n' | sort -k2)
} > gpu-bundle.tmp/MANIFEST
size_kib=$(du -sk gpu-bundle.tmp | cut -f1)
if [ "$size_kib" -gt $((48 * 1024)) ]; then
  echo "gpu_bundle: gpu-bundle is ${size_kib} KiB, over the 48 MiB it must stay under" >&2
  exit 1
fi
rm -rf gpu-bundle
mv gpu-bundle.tmp gpu-bundle
echo "gpu_bundle: gpu-bundle/ is ready (${size_kib} KiB; see gpu-bundle/MANIFEST)" >&2
