#!/usr/bin/env bash
# Builds the bertshard image with the classic Docker builder (no BuildKit needed).
#
#   bash deploy/docker/build-image.sh [--tag bertshard:dev] [--seed-cache [DIR]] [--rev GIT_REV]
#                                     [--dockerfile deploy/docker/Dockerfile] [-- DOCKER_BUILD_ARGS...]
#
# - Makes the base image first when it is missing (deploy/docker/base-image.sh: nothing is pulled).
# - Stages the build context: the files git tracks or would track (tracked + untracked, minus
#   .gitignore), or with --rev the tree of that commit; Docker then applies .dockerignore. Scratch
#   files and Bazel output trees never reach the daemon, and unchanged sources keep the image
#   layers cached.
# - --seed-cache [DIR]: serves a Bazel disk cache (default ~/.cache/bertshard-bazel-disk, the one
#   .bazelrc fills) read-only over HTTP on the Docker bridge for the duration of the build; the
#   in-image `bazel build` takes every action it finds there instead of compiling it. Nothing of the
#   cache goes into any image layer. Without it (or when the cache is cold) the Dockerfile builds
#   from nothing, exactly as `docker build -f deploy/docker/Dockerfile .` does.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
tag=bertshard:dev
dockerfile=deploy/docker/Dockerfile
seed=""
rev=""
extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --tag) tag=$2; shift 2 ;;
    --dockerfile) dockerfile=$2; shift 2 ;;
    --rev) rev=$2; shift 2 ;;
    --seed-cache)
      if [ $# -gt 1 ] && [ -d "$2" ]; then seed=$2; shift 2; else seed=${BAZEL_DISK_CACHE:-$HOME/.cache/bertshard-bazel-disk}; shift; fi ;;
    --) shift; extra=("$@"); break ;;
    -h|--help) sed -n '2,/^set -e/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "build-image: unknown argument $1 (--help)" >&2; exit 2 ;;
  esac
done

command -v docker >/dev/null && docker info >/dev/null 2>&1 || { echo "build-image: no Docker daemon answers" >&2; exit 1; }
base=$(sed -n 's/^FROM \([^ ]*\).*/\1/p' "$repo/$dockerfile" | grep -v -x -e build -e cuda-base | sort -u | head -1)
if [ "$base" = "debian:bookworm-slim" ] && ! docker image inspect "$base" >/dev/null 2>&1; then
  bash "$repo/deploy/docker/base-image.sh"
fi

ctx=$(mktemp -d /var/tmp/bertshard-context.XXXXXX)
server_pid=""
cleanup() {
  local status=$?
  if [ -n "$server_pid" ]; then kill "$server_pid" 2>/dev/null || true; wait "$server_pid" 2>/dev/null || true; fi
  rm -rf "$ctx"
  exit "$status"
}
trap cleanup EXIT
if [ -n "$rev" ]; then
  git -C "$repo" archive "$rev" | tar -x -C "$ctx"
  revision=$(git -C "$repo" rev-parse "$rev")
else
  # Tracked files as they are in the working tree, and new files not ignored; deleted ones skipped.
  (cd "$repo" && git ls-files -z --cached --others --exclude-standard |
    while IFS= read -r -d '' f; do [ -e "$f" ] || [ -L "$f" ] && printf '%s\0' "$f"; done |
    tar --null -T - -c) | tar -x -C "$ctx"
  revision=$(git -C "$repo" rev-parse HEAD 2>/dev/null || echo unknown)
  git -C "$repo" diff --quiet HEAD 2>/dev/null || revision="${revision}-dirty"
fi
# Every stage of the build sees one mtime, so the context (and the COPY layer) depends on content only.
find "$ctx" -exec touch -h -d @0 {} + 2>/dev/null || true

args=(--build-arg "REVISION=$revision" --label "org.opencontainers.image.created=$(date -u +%Y-%m-%dT%H:%M:%SZ)")
if [ -n "$seed" ]; then
  if [ -d "$seed/ac" ] && [ -d "$seed/cas" ]; then
    # The bridge gateway is the host as seen from the build containers.
    gateway=$(docker network inspect bridge -f '{{range .IPAM.Config}}{{.Gateway}}{{end}}' 2>/dev/null || true)
    gateway=${gateway:-172.17.0.1}
    portfile="$ctx.port"
    # A fixed port where free: the URL is a build argument, and an unchanged one keeps the build
    # step cached when the sources did not change either.
    python3 "$repo/deploy/docker/cache_server.py" --root "$seed" --bind "$gateway" --port 47651 --port-file "$portfile" &
    server_pid=$!
    for _ in $(seq 50); do [ -s "$portfile" ] && break; sleep 0.1; done
    [ -s "$portfile" ] || { echo "build-image: the cache server did not start" >&2; exit 1; }
    port=$(cat "$portfile"); rm -f "$portfile"
    echo "build-image: seeding the in-image Bazel build from $seed (http://$gateway:$port)" >&2
    # Bazel keys actions on the PATH of the `bazel` command that ran them; the in-image build takes
    # the host's (BAZEL_ACTION_PATH: the PATH of the shell that filled the cache, default this one).
    args+=(--build-arg "BAZEL_REMOTE_CACHE=http://$gateway:$port" --build-arg "BAZEL_ACTION_PATH=${BAZEL_ACTION_PATH:-$PATH}")
  else
    echo "build-image: no Bazel disk cache at $seed; building from nothing" >&2
  fi
fi

echo "build-image: docker build -f $dockerfile -t $tag (context: $(du -sh "$ctx" | cut -f1))" >&2
DOCKER_BUILDKIT=0 docker build --rm --force-rm -f "$repo/$dockerfile" -t "$tag" "${args[@]}" "${extra[@]}" "$ctx"
docker image ls "$tag" >&2
