#!/usr/bin/env bash
# Builds the images docker-compose.yml runs, from the wheels in .cache/wheels (scripts/wheels.sh):
#   scripts/images.sh             trillium/lean:dev and trillium/full:dev on python:3.11-slim-bookworm
#   scripts/images.sh --offline   the same on trillium/base-python:bookworm, plus trillium/kafka:3.9.2 and
#                                 trillium/redis:bookworm: every base from Debian's packages (scripts/base-image.sh)
# The builds themselves run without a network (--network none).
set -euo pipefail
cd "$(dirname "$0")/.."
base=python:3.11-slim-bookworm
if [ "${1:-}" = --offline ]; then
  for b in python jre redis; do scripts/base-image.sh "$b"; done
  base=trillium/base-python:bookworm
fi
# The Dockerfile bind-mounts the wheels, which needs BuildKit: a client with buildx, or Docker 20.10's own.
docker=(docker)
if ! docker buildx version >/dev/null 2>&1; then
  [ -x /usr/bin/docker ] && /usr/bin/docker version -f '{{.Client.Version}}' 2>/dev/null | grep -q '^20\.10\.' ||
    { echo "images: BuildKit needed: install docker-buildx (or Debian's docker.io)" >&2; exit 1; }
  docker=(/usr/bin/docker)
fi
# Each image's layers are its wheels unpacked (torch's CUDA libraries: gigabytes). A build that runs
# out of disk fails halfway inside pip with ENOSPC: say so first, in numbers, unless they are built.
if ! docker image inspect trillium/full:dev >/dev/null 2>&1; then
  need_mb=$(.venv/bin/python -c 'import pathlib, zipfile
wheels = pathlib.Path(".cache/wheels").glob("*/*.whl")
print(sum(i.file_size for w in wheels for i in zipfile.ZipFile(w).infolist()) >> 20)')
  need_mb=$((need_mb + 2048))  # the Debian bases, Kafka's image and the build's own room
  root=$(docker info -f '{{.DockerRootDir}}')
  free_mb=$(df -Pm "$root" | awk 'NR == 2 {print $4}')
  if [ "$free_mb" -lt "$need_mb" ]; then
    echo "images: about $((need_mb / 1024)) GiB needed under $root (Docker's data root), $((free_mb / 1024)) GiB" \
         "free: free some (docker system prune, old test directories under ${TMPDIR:-/tmp})" >&2
    exit 1
  fi
fi
export DOCKER_BUILDKIT=1
build() {
  "${docker[@]}" build -q --network none "$@" >/dev/null
}
build --build-arg BASE="$base" --target lean -t trillium/lean:dev .
build --build-arg BASE="$base" --target full -t trillium/full:dev .
if [ "${1:-}" = --offline ]; then
  build -f deploy/kafka/Dockerfile -t trillium/kafka:3.9.2 .cache/kafka
fi
docker image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep '^trillium/' | sed 's/^/images: /'
