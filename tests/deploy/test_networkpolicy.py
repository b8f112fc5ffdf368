"""The rendered NetworkPolicies, evaluated as Kubernetes does (a pod no policy selects accepts
everything; one that some policy selects accepts what any of them admits) for every pair of
roles, a stranger pod of the namespace, Prometheus from another namespace and an operator's API
client, against the table of who may talk to whom. No cluster runs them here."""

from __future__ import annotations

from typing import Any

import pytest
from test_k8s import _render

ROLES = ("coordinator", "embedding-ps", "embedding-worker", "nn-worker", "data-loader", "serving")
HTTP, GRPC, PICKED = 8080, 50051, 41234  # PICKED: a port chosen at run time (the NN ranks' store, gloo)
PORTS = (HTTP, GRPC, PICKED)


class Pod:
    def __init__(self, name: str, labels: dict[str, str], same_namespace: bool = True) -> None:
        self.name, self.labels, self.same_namespace = name, labels, same_namespace


def role(name: str) -> Pod:
    return Pod(name, {"app.kubernetes.io/name": name, "app.kubernetes.io/part-of": "trillium"})


SOURCES = [
    *(role(r) for r in ROLES),
    Pod("stranger", {"app.kubernetes.io/name": "someone-elses"}),
    Pod("prometheus", {"app.kubernetes.io/name": "prometheus"}, same_namespace=False),
    Pod("api-client", {"trillium.io/api-client": "true"}),
]

# (source, destination role) -> the ports it may reach there; every other pair and port: refused.
EVERY_ROLE = dict.fromkeys(ROLES, {HTTP})
MAY = {
    **{(r, "coordinator"): {HTTP} for r in ROLES},
    **{("coordinator", r): {HTTP} for r in ROLES},
    ("embedding-worker", "embedding-ps"): {GRPC},
    ("coordinator", "embedding-ps"): {HTTP, GRPC},
    ("embedding-ps", "embedding-ps"): {GRPC},
    ("nn-worker", "embedding-worker"): {GRPC},
    ("coordinator", "embedding-worker"): {HTTP, GRPC},
    ("nn-worker", "nn-worker"): {HTTP, GRPC, PICKED},  # any port: the collectives pick theirs
    **{("prometheus", r): {HTTP} for r in ROLES},
    ("api-client", "coordinator"): {HTTP},
    # Predictions: every pod of the namespace.
    **{(s.name, "serving"): {HTTP, GRPC} for s in SOURCES if s.same_namespace},
}


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        value = labels.get(e["key"])
        ok = {
            "In": value in e.get("values", []),
            "NotIn": value not in e.get("values", []),
            "Exists": value is not None,
            "DoesNotExist": value is None,
        }[e["operator"]]
        if not ok:
            return False
    return True


def _peer(peer: dict[str, Any], source: Pod) -> bool:
    if "ipBlock" in peer:
        return False  # pods are not addressed by blocks here
    namespace = _selects(peer["namespaceSelector"], {}) if "namespaceSelector" in peer else source.same_namespace
    pods = _selects(peer["podSelector"], source.labels) if "podSelector" in peer else True
    return namespace and pods


def admitted(policies: list[dict[str, Any]], source: Pod, destination: Pod, port: int) -> bool:
    selecting = [
        p
        for p in policies
        if "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
        and _selects(p["spec"]["podSelector"], destination.labels)
    ]
    if not selecting:
        return True
    for policy in selecting:
        for rule in policy["spec"].get("ingress", []):
            if "ports" in rule and port not in [p["port"] for p in rule["ports"]]:
                continue
            if "from" not in rule or any(_peer(peer, source) for peer in rule["from"]):
                return True
    return False


@pytest.fixture(scope="module", params=["deploy/k8s/base", "deploy/k8s/overlays/production"])
def policies(request) -> list[dict[str, Any]]:
    return [o for o in _render(request.param) if o["kind"] == "NetworkPolicy"]


def test_who_may_talk_to_whom(policies) -> None:
    wrong = []
    for source in SOURCES:
        for name in ROLES:
            allowed = MAY.get((source.name, name), set())
            for port in PORTS:
                if admitted(policies, source, role(name), port) != (port in allowed):
                    wrong.append(f"{source.name} -> {name}:{port} {'admitted' if port not in allowed else 'refused'}")
    assert not wrong, "\n".join(wrong)


def test_the_evaluation_can_fail() -> None:
    """A policy that admits any source (the old one) is caught."""
    open_to_all = {"kind": "NetworkPolicy", "spec": {"podSelector": {}, "ingress": [{"ports": [{"port": GRPC}]}]}}
    assert admitted([open_to_all], SOURCES[-3], role("embedding-ps"), GRPC)  # the stranger
    assert not admitted([open_to_all], SOURCES[-3], role("embedding-ps"), HTTP)
