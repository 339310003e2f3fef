#!/usr/bin/env bash
# Renders the Kubernetes manifests (deploy/k8s) with `kubectl kustomize`, validates them against
# the Kubernetes OpenAPI schemas (kubernetes-validate), runs checkov on them and checks them against
# the binaries (tests/k8s_manifests_test.py says what exactly).
#
# Needs the project venv (BERTSHARD_VENV, from tools/python_env.sh; tools/test.sh passes it) and a
# kubectl. Without either it says SKIPPED and passes, except under CI=true, where it fails.
# KUBECTLS="kubectl /path/to/other/kubectl" renders with each and also compares their renders
# (e.g. Debian 12's kubectl 1.20, kustomize v2.0.3, next to a current one).
set -euo pipefail

source tests/skip_or_fail.sh
require_venv k8s_manifests_test
for tool in kubernetes-validate checkov; do
  [ -x "$venv/bin/$tool" ] || skip k8s_manifests_test "$tool is not in $venv (tools/requirements-test.txt)"
done
kubectls=()
for k in ${KUBECTLS:-kubectl}; do
  if command -v "$k" >/dev/null 2>&1; then
    kubectls+=("$(command -v "$k")")
  else
    skip k8s_manifests_test "no kubectl '$k' (Debian: apt-get install kubernetes-client; tools/install_deps.sh)"
  fi
done

exec "$venv/bin/python" tests/k8s_manifests_test.py \
  --manifests deploy/k8s \
  --coordinator server/bertshard-coordinator \
  --worker worker/shard-worker \
  --venv "$venv" \
  "${kubectls[@]}"
