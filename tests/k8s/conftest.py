"""The single-node Kubernetes cluster (`make k8s-up`; trillium/stack/k8s): the tests here apply
objects to it through its API server and watch what the cluster does. Run by `make test-k8s`
against the cluster `make k8s-up` started; `make test` leaves them out (the `k8s` marker)."""

from __future__ import annotations

import uuid

import pytest
from probes import Namespace

from trillium.stack.k8s.cluster import Cluster, kubectl
from trillium.stack.procs import pid_alive


@pytest.fixture(scope="session")
def cluster() -> Cluster:
    running = Cluster()
    pids = running.read_state().get("pids", {})
    exited = [name for name, pid in pids.items() if not pid_alive(pid)]
    if not pids or exited:
        pytest.fail(f"no cluster running ({', '.join(exited) or 'none started'}): make k8s-up first", pytrace=False)
    return running


@pytest.fixture
def namespace(cluster: Cluster):
    name = f"t-{uuid.uuid4().hex[:8]}"
    kubectl(cluster.layout, "create", "namespace", name)
    try:
        yield Namespace(cluster, name)
    finally:
        kubectl(cluster.layout, "delete", "namespace", name, "--wait=false", check=False)
