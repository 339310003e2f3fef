#!/usr/bin/env bash
# Installs the Debian 12 packages bertshard builds and tests with. Idempotent: when everything is
# already installed it returns without touching apt. Needs root (or sudo).
# BERTSHARD_DEPS=build installs only what building needs (the container image's build stage), not
# the test references (PyTorch for HF transformers, the text corpus); BERTSHARD_DEPS=fuzz adds clang
# and libFuzzer for tools/fuzz.sh.
set -euo pipefail

PACKAGES=(
  # Toolchain: Bazel (Debian's bootstrap build pulls in g++/build-essential and a JDK).
  bazel-bootstrap bazel-rules-java bazel-platforms g++
  # gRPC, protobuf, Abseil (headers and libraries), and the standard protos (health, reflection).
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler libabsl-dev grpc-proto
  # The model: LibTorch (CPU) with c10d/Gloo, and OpenBLAS (Debian's LibTorch otherwise falls
  # back to the reference BLAS, ~20x slower).
  libtorch-dev libgloo-dev libopenblas0-pthread
  # The tokenizer: Unicode categories, NFD and case mapping.
  libicu-dev
  # The coordinator's durable job table.
  libsqlite3-dev
  # The metrics endpoints: a small embeddable HTTP server (Prometheus text format written by hand).
  libcivetweb-dev
  # The rendezvous handshake: HMAC-SHA256 and CRYPTO_memcmp from libcrypto (worker/auth_store.h),
  # named here rather than left to come with libgrpc++-dev.
  libssl-dev
  # Tests and benchmarks; clang-format checks the C++ style (tools/check_format.sh).
  clang-format
  libgtest-dev libgmock-dev libbenchmark-dev nlohmann-json3-dev
  # A gRPC client we did not write (tests/python_client_test.sh).
  python3 python3-grpcio python3-grpc-tools python3-protobuf python3-pkg-resources
  # A virtual environment for the pinned PyPI test packages (tools/python_env.sh).
  python3-venv python3-pip
  # Deployment: rendering the Kubernetes manifests, making the container base image.
  debootstrap
  # `git clone` of this repository on a fresh machine, and TLS for apt mirrors.
  ca-certificates git
  # TLS tests make their certificates at test time (common/grpc_tls_test).
  openssl
)

if [ "${BERTSHARD_DEPS:-all}" != "build" ]; then
  PACKAGES+=(
    # The reference implementation for parity tests: HuggingFace transformers (PyPI, pinned in
    # tools/requirements-hf.txt) runs on Debian's PyTorch 1.13 through a venv with system packages.
    python3-torch
    # Real text for the tokenizer parity test: Debian's fortune databases (English, German,
    # Spanish, Italian, Russian, Chinese).
    fortunes fortunes-de fortunes-es fortunes-it fortunes-ru fortunes-zh
  )
fi

# `kubectl kustomize` renders the Kubernetes manifests: Debian's kubernetes-client, unless a kubectl
# is installed already (some images carry a newer one from another package that owns the path).
# Fuzzing (tools/fuzz.sh): clang with libFuzzer; only on request (BERTSHARD_DEPS=fuzz), being large.
if [ "${BERTSHARD_DEPS:-all}" = "fuzz" ]; then
  PACKAGES+=(clang libclang-rt-14-dev)
fi

command -v kubectl >/dev/null || PACKAGES+=(kubernetes-client)

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || { echo "install_deps: run as root (or install sudo)" >&2; exit 1; }
  SUDO="sudo"
fi
echo "install_deps: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
