#!/usr/bin/env bash
# Builds the offline base images from Debian's packages, for hosts that cannot pull from Docker Hub:
# debootstrap a Debian bookworm root file system with the named packages, trim it, and `docker import` it.
#
#   scripts/base-image.sh python   trillium/base-python:bookworm  python3 + venv (the Dockerfile's BASE)
#   scripts/base-image.sh jre      trillium/base-jre:bookworm     a Java 17 runtime (deploy/kafka/Dockerfile's BASE)
#   scripts/base-image.sh redis    trillium/redis:bookworm        Debian's redis-server, run as the redis user
#
# An image that exists is kept (`docker rmi` it to rebuild). Downloaded packages are kept in
# .cache/debootstrap, so a rebuild reads Debian's mirror only for what changed. Needs root and debootstrap.
set -euo pipefail
cd "$(dirname "$0")/.."
mirror=http://deb.debian.org/debian
cache=$PWD/.cache/debootstrap

case "${1:-}" in
  python) image=trillium/base-python:bookworm; packages=python3,python3-venv
          changes=('CMD ["python3"]') ;;
  jre)    image=trillium/base-jre:bookworm; packages=openjdk-17-jre-headless
          changes=('CMD ["java", "-version"]') ;;
  redis)  image=trillium/redis:bookworm; packages=redis-server,redis-tools
          changes=('USER redis' 'WORKDIR /data' 'CMD ["redis-server"]') ;;
  *) echo "usage: $0 python|jre|redis" >&2; exit 2 ;;
esac

if docker image inspect "$image" >/dev/null 2>&1; then
  echo "base-image: $image exists"
  exit 0
fi
[ "$(id -u)" = 0 ] || { echo "base-image: debootstrap needs root" >&2; exit 1; }
command -v debootstrap >/dev/null ||
  { echo "base-image: debootstrap not found (Debian: apt-get install debootstrap)" >&2; exit 1; }

root=$(mktemp -d /tmp/trillium-rootfs.XXXXXX)
trap 'rm -rf "$root"' EXIT
mkdir -p "$cache"
echo "base-image: debootstrap bookworm + $packages"
debootstrap --variant=minbase --include="$packages" --cache-dir="$cache" bookworm "$root" "$mirror" \
  > "$root.log" 2>&1 || { tail -20 "$root.log" >&2; rm -f "$root.log"; exit 1; }
rm -f "$root.log"
# Nothing at run time reads apt's lists, docs or man pages: an image a third smaller.
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/usr/share/{doc,man,info}/* "$root"/var/log/*
if [ "$1" = redis ]; then mkdir -p "$root/data" && chroot "$root" chown redis:redis /data; fi
args=(--change 'ENV LANG=C.UTF-8' --change 'LABEL org.opencontainers.image.vendor=trillium')
for c in "${changes[@]}"; do args+=(--change "$c"); done
tar -C "$root" -c . | docker import "${args[@]}" - "$image" >/dev/null
echo "base-image: $image ($(docker image inspect -f '{{.Size}}' "$image" | numfmt --to=iec))"
