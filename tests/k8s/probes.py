"""A namespace of a test's own, pods of the probe (scripts/k8s/probe: a server, a client and a
resolver in one static binary) that the cluster tests start there, and a connection tried from
inside one."""

from __future__ import annotations

from deployment import manifest_of

from trillium.stack.k8s.cluster import Cluster, kubectl
from trillium.stack.k8s.configs import PROBE_IMAGE

ALL_CAPABILITIES_DROPPED = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "runAsNonRoot": True,
    "capabilities": {"drop": ["ALL"]},
}


class Namespace:
    """A namespace of the cluster (a test's own: the `namespace` fixture deletes it), kubectl within it."""

    def __init__(self, cluster: Cluster, name: str) -> None:
        self.cluster = cluster
        self.name = name

    def kubectl(self, *args: str, check: bool = True, timeout: float = 120.0, stdin: str | None = None) -> str:
        return kubectl(self.cluster.layout, "-n", self.name, *args, check=check, timeout=timeout, stdin=stdin)

    def apply(self, *objects: dict) -> None:
        self.kubectl("apply", "-f", "-", stdin=manifest_of(list(objects)))


def probe_pod(name: str, labels: dict[str, str], args: list[str]) -> dict:
    """A pod of the probe, run with `args` (`serve PORT...`: it answers there)."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "terminationGracePeriodSeconds": 0,
            "automountServiceAccountToken": False,
            "containers": [
                {
                    "name": "probe",
                    "image": PROBE_IMAGE,
                    "imagePullPolicy": "Never",
                    "args": args,
                    "securityContext": ALL_CAPABILITIES_DROPPED,
                }
            ],
        },
    }


def connects(namespace: Namespace, client: str, address: str) -> bool:
    """Whether pod `client` connects to `address` and is answered (the probe's exit status)."""
    out = namespace.kubectl("exec", client, "--", "/probe", "connect", address, check=False, timeout=30)
    return out.strip() == "ok"


def start(namespace: Namespace, *pods: dict) -> None:
    """Apply `pods` in `namespace` and wait until each is ready."""
    namespace.apply(*pods)
    names = [f"pod/{pod['metadata']['name']}" for pod in pods]
    namespace.kubectl("wait", "--for=condition=Ready", *names, "--timeout=120s", timeout=150)
