#!/usr/bin/env bash
# Builds a tool with Go, its module downloads and build cache in a directory of their own that is
# removed after (about 1 GB for kustomize, linkdelay and versitygw together): the tools are built
# once, and CI's disk must hold the images after the tests.
#   scripts/go-tool.sh [-C DIR] go install|build ARGS...
set -euo pipefail
scripts/require.sh go
scratch=$(mktemp -d "${TMPDIR:-/tmp}/trillium-go.XXXXXX")
cleanup() {
  GOMODCACHE="$scratch/mod" go clean -modcache 2>/dev/null || true  # module files are read-only
  rm -rf "$scratch"
}
trap cleanup EXIT
dir=.
if [ "${1:-}" = -C ]; then dir=$2; shift 2; fi
cd "$dir" && GOCACHE="$scratch/build" GOMODCACHE="$scratch/mod" "$@"
