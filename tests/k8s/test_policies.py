"""The NetworkPolicies of deploy/k8s (the base's, and the local overlay's object store's) enforced on
the cluster, both ways (each pod's way in and out): a probe pod for each role, labelled as the
role's pods are, answers on the role's ports, as do a stranger of the namespace and the object
store; from each of them (a second pod of the role for its calls on its own), Prometheus from its
namespace, a pod calling itself Prometheus from another and an operator's API client, a
connection to every port of each is admitted exactly where tests/manifests.py's table says, and
refused everywhere else."""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
from manifests import MAY, METRICS_NAMESPACE, OBJECT_STORE, S3, SOURCES, destinations, render
from probes import Namespace, connects, probe_pod, start
from waiting import wait_until

from trillium.stack.k8s.cluster import kubectl

pytestmark = pytest.mark.k8s
DESTINATIONS = destinations(with_store=True)


def _policies() -> list[dict]:
    policies = [o for o in render("deploy/k8s/overlays/local") if o["kind"] == "NetworkPolicy"]
    for policy in policies:
        del policy["metadata"]["namespace"]  # into the test's namespace
    return policies


@pytest.fixture
def other_namespaces(cluster):
    """Prometheus's namespace (the policy names it: made here unless it is there) and another."""
    made = []
    names = {}
    for source in SOURCES:
        if source.namespace is None:
            continue
        name = source.namespace if source.namespace == METRICS_NAMESPACE else f"t-{uuid.uuid4().hex[:8]}"
        if not kubectl(cluster.layout, "get", "namespace", name, "--ignore-not-found", "-o", "name").strip():
            kubectl(cluster.layout, "create", "namespace", name)
            made.append(name)
        names[source.name] = Namespace(cluster, name)
    try:
        yield names
    finally:
        for name in made:
            kubectl(cluster.layout, "delete", "namespace", name, "--wait=false", check=False)


def test_every_pair_of_roles_is_admitted_or_refused_as_the_table_says(namespace, other_namespaces) -> None:
    namespace.apply(*_policies())
    where: dict[str, Namespace] = {}
    pods: dict[str, list[dict]] = {}
    for source in SOURCES:
        ports = DESTINATIONS[source.name][1] if source.name in DESTINATIONS else (9999,)
        home = other_namespaces.get(source.name, namespace)
        where[source.name] = home
        pods.setdefault(home.name, []).append(probe_pod(source.name, source.labels, ["serve", *map(str, ports)]))
    # A pod always reaches itself, whatever the policies: a role's calls on its own role (a PS
    # shard's on another) come from a second pod of it.
    for source in SOURCES:
        if source.name in DESTINATIONS:
            pods[namespace.name].append(probe_pod(f"{source.name}-peer", source.labels, ["serve", "9999"]))
            where[f"{source.name}-peer"] = namespace
    pods[namespace.name].append(probe_pod(OBJECT_STORE.name, OBJECT_STORE.labels, ["serve", str(S3)]))
    homes = {n.name: n for n in [namespace, *other_namespaces.values()]}
    for name, group in pods.items():
        start(homes[name], *group)
    ip = {name: namespace.kubectl("get", "pod", name, "-o", "jsonpath={.status.podIP}") for name in DESTINATIONS}

    def admitted(check: tuple[str, str, int]) -> bool:
        source, destination, port = check
        caller = f"{source}-peer" if source == destination else source
        return connects(where[caller], caller, f"{ip[destination]}:{port}")

    # kube-router programs each pod's rules within its sync: until a connection the table refuses
    # is refused at every destination, what a connection shows is not yet the policies'.
    for name, (_, ports) in DESTINATIONS.items():
        refused = next(s.name for s in SOURCES if ports[0] not in MAY.get((s.name, name), set()))
        wait_until(lambda c=(refused, name, ports[0]): not admitted(c), f"{name}'s policies", 90)
    checks = [(s.name, d, port) for s in SOURCES for d, (_, ports) in DESTINATIONS.items() for port in ports]
    with ThreadPoolExecutor(max_workers=8) as pool:
        results = dict(zip(checks, pool.map(admitted, checks), strict=True))
    wrong = [
        f"{s} -> {d}:{port} {'admitted' if got else 'refused'}"
        for (s, d, port), got in results.items()
        if got != (port in MAY.get((s, d), set()))
    ]
    print(f"\nk8s: {len(checks)} connections, {sum(results.values())} admitted, as the table says: {not wrong}")
    assert not wrong, "\n".join(wrong)
