#!/usr/bin/env bash
# `make test-compose`: docker-compose.yml for real on this machine. Installs Debian's docker.io,
# docker-compose and debootstrap when missing (as root), starts dockerd when none answers (and stops only
# the one it started), builds the images offline (`make images-offline`), then tests/compose brings the
# project up, trains Adult through the published API, crashes a PS shard, and takes it all down.
set -euo pipefail
cd "$(dirname "$0")/.."
export COMPOSE_PROJECT_NAME=trillium-test
logs=.cache/test-compose
mkdir -p "$logs"
started=$SECONDS

need=()
command -v docker-compose >/dev/null || need+=(docker-compose)
command -v debootstrap >/dev/null || need+=(debootstrap)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "test-compose: ${need[*]} missing: install them (Debian: sudo apt-get install ${need[*]})" >&2
    exit 1
  fi
  echo "test-compose: installing ${need[*]} (Debian)"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

. scripts/docker-engine.sh
cleanup() {
  # Whatever the test left (it takes the project down itself; this covers a crash), then our engine.
  label="label=com.docker.compose.project=$COMPOSE_PROJECT_NAME"
  ids=$(docker ps -aq --filter "$label" 2>/dev/null || true)
  [ -z "$ids" ] || docker rm -f $ids >/dev/null 2>&1 || true
  for kind in network volume; do
    ids=$(docker "$kind" ls -q --filter "$label" 2>/dev/null || true)
    [ -z "$ids" ] || docker "$kind" rm $ids >/dev/null 2>&1 || true
  done
  engine_stop test-compose
}
trap cleanup EXIT
engine_start test-compose "$logs"
engine_s=$((SECONDS - started))

make -s images-offline
images_s=$((SECONDS - started - engine_s))

.venv/bin/python -m pytest -q -s -m compose tests/compose
echo "test-compose: passed in $((SECONDS - started)) s (engine ${engine_s} s, images ${images_s} s," \
     "compose test $((SECONDS - started - engine_s - images_s)) s)"
