"""deploy/k8s as kustomize renders it, the table of who may talk to whom that its NetworkPolicies
must say, and those policies evaluated as Kubernetes does. The table is the oracle of the
evaluation (tests/deploy) and of the policies' enforcement on a real cluster (tests/k8s), written
from docs/operations.md's "Kubernetes", not from the policies."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
KUSTOMIZE = REPO / ".cache/bin/kustomize"  # built by `make setup` from the Go module proxy


def render(path: str) -> list[dict]:
    """Every object `kustomize build` renders of `path` (relative to the repository)."""
    assert KUSTOMIZE.exists(), f"{KUSTOMIZE} missing: `make setup` builds it"
    out = subprocess.run([str(KUSTOMIZE), "build", str(REPO / path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


ROLES = ("coordinator", "embedding-ps", "embedding-worker", "nn-worker", "data-loader", "serving")
HTTP, GRPC, PICKED = 8080, 50051, 41234  # PICKED: a port chosen at run time (the NN ranks' store, gloo)
PORTS = (HTTP, GRPC, PICKED)
S3 = 7070  # the local overlay's object store (deploy/k8s/overlays/local/object-store.yaml)
# Who keeps state there: checkpoints' parts and model versions (every role but the embedding workers).
STORE_CLIENTS = ("coordinator", "embedding-ps", "nn-worker", "data-loader", "serving")


METRICS_NAMESPACE = "monitoring"  # the base's metrics policy's


@dataclass(frozen=True)
class Pod:
    name: str
    labels: dict[str, str] = field(hash=False)
    namespace: str | None = None  # None: the stack's own

    @property
    def namespace_labels(self) -> dict[str, str]:
        """The labels Kubernetes gives its namespace (the name, since 1.22), the stack's as `trillium`."""
        return {"kubernetes.io/metadata.name": self.namespace or "trillium"}


def role(name: str) -> Pod:
    return Pod(name, {"app.kubernetes.io/name": name, "app.kubernetes.io/part-of": "trillium"})


STRANGER = Pod("stranger", {"app.kubernetes.io/name": "someone-elses"})  # a pod of the namespace, not the stack's
SOURCES = [
    *(role(r) for r in ROLES),
    STRANGER,
    Pod("prometheus", {"app.kubernetes.io/name": "prometheus"}, namespace=METRICS_NAMESPACE),
    # A pod that labels itself Prometheus elsewhere: nothing of the stack's.
    Pod("impostor", {"app.kubernetes.io/name": "prometheus"}, namespace="elsewhere"),
    Pod("api-client", {"trillium.io/api-client": "true"}),
]

# (source, destination role) -> the ports it may reach there; every other pair and port: refused.
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
    # Predictions: every pod of the namespace but the stack's own, which call no replica.
    **{(s.name, "serving"): {HTTP, GRPC} for s in SOURCES if s.namespace is None and s.name not in ROLES},
    **{(r, "object-store"): {S3} for r in STORE_CLIENTS},
    # A pod no policy selects (another stranger, for the stranger), called by pods no policy limits;
    # the stack's pods reach no such pod.
    **{(s.name, STRANGER.name): set(PORTS) for s in SOURCES if s.name not in ROLES},
}
OBJECT_STORE = Pod("object-store", {"app.kubernetes.io/name": "object-store"})


def destinations(with_store: bool) -> dict[str, tuple[Pod, tuple[int, ...]]]:
    """The pods connections go to, and their ports: every role's, the stranger's and (the local
    overlay's) the object store's."""
    out = {r: (role(r), PORTS) for r in ROLES} | {STRANGER.name: (STRANGER, PORTS)}
    return out | ({OBJECT_STORE.name: (OBJECT_STORE, (S3,))} if with_store else {})


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


def _peer(peer: dict[str, Any], pod: Pod) -> bool:
    if "ipBlock" in peer:
        return False  # pods are not addressed by blocks here
    if "namespaceSelector" in peer:
        namespace = _selects(peer["namespaceSelector"], pod.namespace_labels)
    else:
        namespace = pod.namespace is None
    pods = _selects(peer["podSelector"], pod.labels) if "podSelector" in peer else True
    return namespace and pods


def _lets(policies: list[dict[str, Any]], kind: str, selected: Pod, other: Pod, port: int) -> bool:
    """Whether the policies of the stack's namespace let `selected` take (Ingress) or make
    (Egress) a connection with `other` on `port`: yes when none of that kind selects it, else when
    a rule of one that does names the port (or none) and a peer matching `other` (or none)."""
    if selected.namespace is not None:
        return True  # the stack's policies select no pod of another namespace
    selecting = [
        p
        for p in policies
        if kind in p["spec"].get("policyTypes", ["Ingress"]) and _selects(p["spec"]["podSelector"], selected.labels)
    ]
    peers = "from" if kind == "Ingress" else "to"
    for policy in selecting:
        for rule in policy["spec"].get(kind.lower(), []):
            if "ports" in rule and port not in [p["port"] for p in rule["ports"]]:
                continue
            if peers not in rule or any(_peer(peer, other) for peer in rule[peers]):
                return True
    return not selecting


def admitted(policies: list[dict[str, Any]], source: Pod, destination: Pod, port: int) -> bool:
    """Whether a connection from `source` to `destination`'s `port` is let through: its way out
    of the source and its way into the destination."""
    return _lets(policies, "Egress", source, destination, port) and _lets(
        policies, "Ingress", destination, source, port
    )
