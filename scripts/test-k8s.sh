#!/usr/bin/env bash
# `make test-k8s`: tests/k8s against the cluster `make k8s-up` started. Starts dockerd when none
# answers (and stops only the one it started), builds the images offline (`make images-offline`;
# the node imports those it lacks or holds another build of), then the tests check the cluster,
# every NetworkPolicy pair, and deploy/k8s/overlays/local: Adult trained, a PS killed and
# recovered, the model served.
set -euo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
. scripts/docker-engine.sh
trap 'engine_stop test-k8s' EXIT
engine_start test-k8s .cache/test-k8s
make -s images-offline
images_s=$((SECONDS - started))
.venv/bin/python -m pytest -q -s -m k8s tests/k8s
echo "test-k8s: passed in $((SECONDS - started)) s (engine and images ${images_s} s, tests $((SECONDS - started - images_s)) s)"
