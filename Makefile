# Trillium: `make demo` runs the main job, `make test` runs every test.
# Both set everything up first; every step is cached and skipped when up to date.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
KAFKA_LIBS := .cache/kafka/libs
KUSTOMIZE := .cache/bin/kustomize
NATIVE_SRC := $(shell find native/src native/stream/src native/transport/src -name '*.rs' 2>/dev/null) native/Cargo.toml \
              native/stream/Cargo.toml native/transport/Cargo.toml native/transport/build.rs native/Cargo.lock \
              native/pyproject.toml proto/embedding.proto
PROTOS := $(wildcard proto/*.proto)
PB := $(patsubst proto/%.proto,trillium/wire/pb/%_pb2.py,$(PROTOS))

.PHONY: setup demo test test-unit lint test-python test-native docs test-compose test-cluster test-nemesis images images-offline compose-env bench up down status clean peer \
        k8s-tools k8s-up k8s-down test-k8s
.DEFAULT_GOAL := setup

setup: $(VENV)/.installed $(VENV)/.native $(PB) $(KAFKA_LIBS)/.complete .cache/redis.ok $(KUSTOMIZE)

$(VENV)/.installed: pyproject.toml
	@scripts/require.sh $(PYTHON)
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || \
	  { echo "trillium setup: Python 3.11+ needed, $(PYTHON) is $$($(PYTHON) -V)" >&2; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[train,dev]'
	touch $@

$(VENV)/.native: $(VENV)/.installed $(NATIVE_SRC)
	@scripts/require.sh cargo
	cd native && VIRTUAL_ENV=$(abspath $(VENV)) $(abspath $(VENV))/bin/maturin develop --release -q
	touch $@

trillium/wire/pb/%_pb2.py: proto/%.proto $(VENV)/.installed
	$(PY) -m grpc_tools.protoc -Itrillium/wire/pb=proto --python_out=. --pyi_out=. --grpc_python_out=. trillium/wire/pb/$*.proto

$(KAFKA_LIBS)/.complete: deps/kafka/pom.xml
	@scripts/require.sh java mvn
	scripts/setup-kafka.sh $(KAFKA_LIBS)
	touch $@

# kustomize renders deploy/k8s for its test: built from the Go module proxy (scripts/go-tool.sh).
$(KUSTOMIZE):
	GOBIN=$(abspath .cache/bin) scripts/go-tool.sh go install sigs.k8s.io/kustomize/kustomize/v5@v5.5.0

.cache/redis.ok:
	@mkdir -p .cache
	@if [ -z "$$TRILLIUM_REDIS_URL" ]; then scripts/setup-redis.sh; fi
	touch $@

demo: setup
	$(VENV)/bin/trillium demo

test: setup lint docs test-native test-python

# The documentation site (mkdocs.yml) into .cache/site, strict: a broken link or anchor fails it.
docs: $(VENV)/.installed
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict -q

# One Python style (ruff: pyflakes, bugbear, async rules, import order; `ruff format`) and the native
# workspace's (both crates).
lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	cd native && cargo fmt --all --check && cargo clippy --release --workspace --all-targets -q -- -D warnings

test-python:
	$(PY) -m pytest -q; rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; fi; exit $$rc

# The edit-test loop's fast tier: the native crate's tests and every Python test that needs no
# broker (unit, native, deploy and security tests): 3 minutes here, where `make test` takes 17-28.
# Two workers: the tier has no broker, so its tests share nothing but the machine.
test-unit: setup test-native
	$(PY) -m pytest -q -n 2 -m "not broker and not compose and not cluster and not k8s"

test-native: $(VENV)/.native
	cd native && cargo test --release --workspace -q

# ---- a cluster of hosts on this machine (root; docs/operations.md, Running across hosts) ----
.cache/cluster-tools.ok:
	@mkdir -p .cache
	scripts/setup-cluster.sh
	touch $@

# Latency on a cluster's links, where the kernel has no netem (trillium/stack/links.py).
LINKDELAY := .cache/bin/linkdelay
$(LINKDELAY): scripts/linkdelay/main.go scripts/linkdelay/go.mod
	scripts/go-tool.sh -C scripts/linkdelay go build -o $(abspath $@) .

# The serving benches' second gRPC client, in Go (bench/serving.py, bench/grpc_transport.py).
GRPCLOAD := .cache/bin/grpcload
$(GRPCLOAD): scripts/grpcload/main.go scripts/grpcload/go.mod scripts/grpcload/go.sum
	scripts/go-tool.sh -C scripts/grpcload go build -o $(abspath $@) .

# An S3 object store for a cluster's models (trillium/stack/object_store.py): versitygw, built as kustomize is.
# Static (no cgo), so that the Kubernetes cluster's image of it is the one binary (trillium/stack/k8s).
VERSITYGW := .cache/bin/versitygw
$(VERSITYGW):
	GOBIN=$(abspath .cache/bin) CGO_ENABLED=0 scripts/go-tool.sh go install github.com/versity/versitygw/cmd/versitygw@v1.8.0

# Every process on a network namespace of its own; partitions, a slow link, a lossy one (tests/cluster).
test-cluster: setup .cache/cluster-tools.ok $(LINKDELAY) $(VERSITYGW)
	$(PY) -m pytest -q -m cluster tests/cluster

# Clock jumps on a cluster's hosts, where time namespaces move only the monotonic clocks (trillium/stack/clocks.py).
CLOCKJUMP := .cache/lib/clockjump.so
$(CLOCKJUMP): scripts/clockjump/clockjump.c
	@mkdir -p $(dir $@)
	cc -shared -fPIC -O2 -Wall -Wextra -Werror -o $@ $< -ldl
test-python test-unit: $(CLOCKJUMP)  # tests/unit/test_clocks.py

# A seeded random fault schedule on a cluster while jobs train, and its checker (bench/nemesis.py).
test-nemesis: setup .cache/cluster-tools.ok $(LINKDELAY) $(CLOCKJUMP)
	$(PY) bench/nemesis.py --minutes 4 --seed 1

# ---- a single-node Kubernetes cluster on this machine (trillium/stack/k8s, docs/deployment.md) ----
# Its binaries from the Go module proxy and gcc, its other parts from Debian (scripts/k8s/build.sh).
K8S_TOOLS := .cache/k8s/bin/.complete
k8s-tools: $(K8S_TOOLS)
$(K8S_TOOLS): scripts/k8s/build.sh scripts/k8s/go.mod scripts/k8s/go.sum scripts/k8s/probe/main.go
	scripts/k8s/build.sh
	touch $@

k8s-up: setup $(K8S_TOOLS) $(VERSITYGW)
	$(PY) -m trillium.stack.k8s up

k8s-down: $(VENV)/.installed
	$(PY) -m trillium.stack.k8s down

# Against a cluster `make k8s-up` started (tests/k8s), with a Docker engine's images (scripts/test-k8s.sh).
test-k8s: setup
	scripts/test-k8s.sh

# ---- containers (docker-compose.yml, docs/operations.md) ----
WHEELS := .cache/wheels
IMAGE_SRC := pyproject.toml scripts/wheels.sh $(shell git ls-files trillium services)

# What the images install, built here at the versions .venv runs (scripts/wheels.sh).
$(WHEELS)/.complete: $(VENV)/.native $(PB) $(NATIVE_SRC) $(IMAGE_SRC)
	scripts/wheels.sh
	touch $@

images: $(WHEELS)/.complete
	scripts/images.sh

# The same from Debian's packages and the Maven-resolved Kafka jars: for hosts without Docker Hub.
images-offline: $(WHEELS)/.complete $(KAFKA_LIBS)/.complete
	scripts/images.sh --offline

# .env for docker-compose.yml with fresh secrets; an existing .env is kept.
compose-env:
	@scripts/compose-env .env

# docker compose for real: engine, offline images, the Adult job through the published API, a crashed
# PS shard restarted, and nothing left behind (scripts/test-compose.sh).
test-compose: setup
	scripts/test-compose.sh

bench: setup
	$(PY) bench/embedding_store.py --json
	$(PY) bench/e2e.py --json
	$(PY) bench/data_loader.py --json

# TorchRec on CPU in an environment of its own, the anchor bench/peer.py trains beside the stack:
# bench/peer-requirements.txt, then torchrec without its dependencies (they name the CUDA fbgemm-gpu).
PEER_VENV := .cache/peer-venv
peer: $(PEER_VENV)/.installed

$(PEER_VENV)/.installed: bench/peer-requirements.txt
	test -x $(PEER_VENV)/bin/python || $(PYTHON) -m venv $(PEER_VENV)
	$(PEER_VENV)/bin/python -m pip install -q --upgrade pip
	$(PEER_VENV)/bin/python -m pip install -q -r bench/peer-requirements.txt
	$(PEER_VENV)/bin/python -m pip install -q --no-deps torchrec==1.9.2
	$(PEER_VENV)/bin/python -c 'import torchrec, fbgemm_gpu'
	touch $@

up: setup
	$(VENV)/bin/trillium up
status:
	$(VENV)/bin/trillium status
down:
	$(VENV)/bin/trillium down

clean:
	rm -rf $(VENV) .cache native/target trillium/wire/pb/*_pb2*
