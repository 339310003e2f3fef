#!/usr/bin/env bash
# Makes the base image the Dockerfiles start from, `debian:bookworm-slim`, locally: where no
# registry can be reached nothing can be pulled, so this builds an equivalent of Debian's official
# slim image with debootstrap (minbase variant) and `docker import`s it under the same name. The
# Dockerfiles then build unchanged, here or (with the real image pulled) anywhere else.
#
#   bash deploy/docker/base-image.sh            # no-op when debian:bookworm-slim exists
#   bash deploy/docker/base-image.sh --force    # rebuild and re-tag it
#
# Needs root, debootstrap (tools/install_deps.sh installs it) and a Debian mirror
# (DEBIAN_MIRROR, default http://deb.debian.org/debian). Takes 2-5 minutes.
set -euo pipefail

IMAGE=${BASE_IMAGE:-debian:bookworm-slim}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
SECURITY_MIRROR=${DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}
force=0
[ "${1:-}" = "--force" ] && force=1

if [ "$force" -eq 0 ] && docker image inspect "$IMAGE" >/dev/null 2>&1; then
  echo "base-image: $IMAGE exists (--force to rebuild)" >&2
  exit 0
fi
[ "$(id -u)" -eq 0 ] || { echo "base-image: debootstrap needs root" >&2; exit 1; }
command -v debootstrap >/dev/null || { echo "base-image: install debootstrap (tools/install_deps.sh)" >&2; exit 1; }

rootfs=$(mktemp -d /var/tmp/bertshard-rootfs.XXXXXX)
trap 'rm -rf --one-file-system "$rootfs"' EXIT

echo "base-image: debootstrap --variant=minbase bookworm from $MIRROR" >&2
debootstrap --variant=minbase --arch=amd64 bookworm "$rootfs" "$MIRROR" >"$rootfs.log" 2>&1 ||
  { tail -30 "$rootfs.log" >&2; rm -f "$rootfs.log"; exit 1; }
rm -f "$rootfs.log"

# What Debian's official slim image (debuerreotype) does on top of minbase: apt sources in deb822
# form with updates and security, no apt caches, no documentation, man pages or translations.
rm -f "$rootfs/etc/apt/sources.list"
cat >"$rootfs/etc/apt/sources.list.d/debian.sources" <<SOURCES
Types: deb
URIs: $MIRROR
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: $SECURITY_MIRROR
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SOURCES
cat >"$rootfs/etc/apt/apt.conf.d/docker-clean" <<'APT'
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
APT
echo 'Acquire::Languages "none";' >"$rootfs/etc/apt/apt.conf.d/docker-no-languages"
echo 'Acquire::GzipIndexes "true";' >"$rootfs/etc/apt/apt.conf.d/docker-gzip-indexes"
echo 'APT::AutoRemove::SuggestsImportant "false";' >"$rootfs/etc/apt/apt.conf.d/docker-autoremove-suggests"
cat >"$rootfs/etc/dpkg/dpkg.cfg.d/docker" <<'DPKG'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/groff/*
path-exclude /usr/share/info/*
path-exclude /usr/share/lintian/*
path-exclude /usr/share/linda/*
path-exclude /usr/share/locale/*
DPKG
find "$rootfs/usr/share/doc" -mindepth 1 -not -name copyright -not -type d -delete 2>/dev/null || true
find "$rootfs/usr/share/doc" -mindepth 1 -type d -empty -delete 2>/dev/null || true
rm -rf "$rootfs"/usr/share/{man,info,groff,lintian,linda,locale}/* "$rootfs"/var/lib/apt/lists/* \
  "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/log/*.log \
  "$rootfs"/tmp/* "$rootfs"/root/.bash_history
: >"$rootfs/etc/machine-id"
echo "debian" >"$rootfs/etc/hostname"

echo "base-image: docker import as $IMAGE" >&2
tar --numeric-owner --xattrs -C "$rootfs" -c . |
  docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["bash"]' \
    --message "debootstrap --variant=minbase bookworm ($MIRROR), made by bertshard deploy/docker/base-image.sh" \
    - "$IMAGE" >/dev/null
docker image ls "$IMAGE" >&2
