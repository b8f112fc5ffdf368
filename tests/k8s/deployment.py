"""deploy/k8s applied to the single-node cluster as an operator would (docs/deployment.md): the
images `make images-offline` builds imported into the node, the namespace, the Secret of fresh
tokens and the object store's keys, Kafka's start script, a volume on the node's disk for each
claim (the data one holding Adult, the object store's its bucket), `kubectl apply -k deploy/k8s/overlays/local`, and the coordinator's API reached through
`kubectl port-forward`."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from waiting import wait_until

from trillium.stack.client import CoordinatorClient
from trillium.stack.k8s.cluster import Cluster, kubectl
from trillium.stack.object_store import BUCKET
from trillium.stack.procs import LauncherError, free_port

REPO = Path(__file__).resolve().parents[2]
NAMESPACE = "trillium"
OVERLAY = REPO / "deploy/k8s/overlays/local"
IMAGES = ["trillium/lean:dev", "trillium/full:dev", "trillium/kafka:3.9.2", "trillium/redis:bookworm"]
SERVICE_USER = 10001  # the base's pods' runAsUser, who must write their volumes
# Each claim of the overlay, and what its volume starts with.
CLAIMS = {
    "trillium-data": "adult",
    "state-embedding-ps-0": None,
    "state-embedding-ps-1": None,
    "data-object-store-0": "bucket",  # the bucket of TRILLIUM_SHARED_DIR, a directory of the store's
}
WORKLOADS = [
    "deployment/coordinator",
    "deployment/data-loader",
    "deployment/embedding-worker",
    "deployment/serving",
    "statefulset/embedding-ps",
    "statefulset/nn-worker",
    "statefulset/kafka",
    "statefulset/redis",
    "statefulset/object-store",
]


@dataclass
class Deployment:
    cluster: Cluster
    client: CoordinatorClient
    serving: httpx.Client  # the serving Service's REST port, with the prediction clients' token
    tokens: dict[str, str]

    def kubectl(self, *args: str, check: bool = True, timeout: float = 120.0) -> str:
        return kubectl(self.cluster.layout, "-n", NAMESPACE, *args, check=check, timeout=timeout)

    def container(self, pod: str) -> dict:
        """The status of `pod`'s one container (its ID, restart count, state)."""
        return json.loads(self.kubectl("get", "pod", pod, "-o", "json"))["status"]["containerStatuses"][0]

    def pid(self, pod: str) -> int:
        """The host's PID of `pod`'s service process (the container's first): the node's
        containerd says. Inside the container it is PID 1, which ignores a SIGKILL sent from there."""
        container = self.container(pod)["containerID"].removeprefix("containerd://")
        tasks = subprocess.run(
            ["ctr", "--address", str(self.cluster.layout.containerd_socket), "-n", "k8s.io", "tasks", "ls"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.splitlines()
        return next(int(line.split()[1]) for line in tasks[1:] if line.split()[0] == container)

    def volume(self, claim: str) -> Path:
        """The node's directory behind `claim` (what the object store keeps, read in place)."""
        return self.cluster.layout.state / "volumes" / claim


def _import_images(cluster: Cluster) -> None:
    started = time.monotonic()
    try:
        imported = cluster.import_images(IMAGES)
    except LauncherError as err:
        pytest.fail(f"{err}: the node takes the images of `make images-offline` (a Docker engine)", pytrace=False)
    print(f"\nk8s: {len(imported)} images imported in {time.monotonic() - started:.0f} s {imported}")


def _volumes(cluster: Cluster) -> list[dict]:
    """A hostPath volume below the cluster's state for each claim, bound to that claim alone."""
    objects = []
    for claim, content in CLAIMS.items():
        path = cluster.layout.state / "volumes" / claim
        shutil.rmtree(path, ignore_errors=True)  # what an interrupted run left
        path.mkdir(parents=True)
        if content == "adult":
            for name in ("adult.data", "adult.test"):
                shutil.copy(REPO / "examples/adult/data" / name, path / name)
        elif content == "bucket":
            (path / BUCKET).mkdir(exist_ok=True)
        for entry in [path, *path.iterdir()]:
            os.chown(entry, SERVICE_USER, SERVICE_USER)
        objects.append(
            {
                "apiVersion": "v1",
                "kind": "PersistentVolume",
                "metadata": {"name": f"{NAMESPACE}-{claim}"},
                "spec": {
                    "capacity": {"storage": "2Gi"},
                    "accessModes": ["ReadWriteOnce"],
                    "storageClassName": "trillium-local",
                    "persistentVolumeReclaimPolicy": "Retain",  # the test deletes it, and its directory
                    "claimRef": {"namespace": NAMESPACE, "name": claim},
                    "hostPath": {"path": str(path), "type": "Directory"},
                },
            }
        )
    return objects


def deploy(cluster: Cluster):
    """Yields the Deployment once every workload is rolled out; takes it all away after."""
    layout = cluster.layout
    _import_images(cluster)
    started = time.monotonic()
    kubectl(layout, "delete", "namespace", NAMESPACE, "--ignore-not-found", "--timeout=120s", timeout=150)
    kubectl(layout, "create", "namespace", NAMESPACE)
    tokens = {scope: secrets.token_hex(24) for scope in ("operate", "predict", "observe")}
    literals = [f"--from-literal=token={secrets.token_hex(24)}"]
    literals += [f"--from-literal={s}-token-sha256={hashlib.sha256(t.encode()).hexdigest()}" for s, t in tokens.items()]
    literals += [f"--from-literal={name}={secrets.token_hex(16)}" for name in ("redis-password", "kafka-password")]
    kubectl(layout, "-n", NAMESPACE, "create", "secret", "generic", "trillium-secrets", *literals)
    keys = [f"--from-literal=AWS_ACCESS_KEY_ID={secrets.token_hex(10)}"]
    keys += [f"--from-literal=AWS_SECRET_ACCESS_KEY={secrets.token_urlsafe(30)}"]
    kubectl(layout, "-n", NAMESPACE, "create", "secret", "generic", "trillium-object-store", *keys)
    script = f"--from-file={REPO / 'deploy/kafka/kafka.sh'}"
    kubectl(layout, "-n", NAMESPACE, "create", "configmap", "kafka-script", script)
    volumes = _volumes(cluster)
    # A volume an earlier run left is bound to that run's claim (its UID): made anew.
    names = [volume["metadata"]["name"] for volume in volumes]
    kubectl(layout, "delete", "persistentvolume", *names, "--ignore-not-found", "--timeout=60s", timeout=90)
    kubectl(layout, "apply", "-f", "-", stdin=manifest_of(volumes))
    kubectl(layout, "apply", "-k", str(OVERLAY))
    for workload in WORKLOADS:
        kubectl(layout, "-n", NAMESPACE, "rollout", "status", workload, "--timeout=300s", timeout=330)
    print(f"k8s: the overlay applied and rolled out in {time.monotonic() - started:.0f} s")
    forwards = [_port_forward(cluster, "svc/coordinator"), _port_forward(cluster, "svc/serving")]
    client = CoordinatorClient(f"http://127.0.0.1:{forwards[0][1]}", tokens["operate"])
    serving = httpx.Client(
        base_url=f"http://127.0.0.1:{forwards[1][1]}",
        timeout=60.0,
        headers={"Authorization": f"Bearer {tokens['predict']}"},
    )
    try:
        for forward, _ in forwards:
            wait_until(lambda f=forward: f.stdout.readline().startswith("Forwarding"), "kubectl port-forward", 30)
        yield Deployment(cluster, client, serving, tokens)
    finally:
        client.close()
        serving.close()
        for forward, _ in forwards:
            forward.terminate()
            forward.wait(timeout=30)
        kubectl(layout, "delete", "namespace", NAMESPACE, "--timeout=180s", check=False, timeout=200)
        for volume in volumes:
            kubectl(layout, "delete", "persistentvolume", volume["metadata"]["name"], check=False)
        shutil.rmtree(layout.state / "volumes", ignore_errors=True)


def _port_forward(cluster: Cluster, service: str) -> tuple[subprocess.Popen, int]:
    """`kubectl port-forward` of `service`'s port 8080 to a free port here, and that port."""
    layout = cluster.layout
    port = free_port()
    forward = subprocess.Popen(
        [str(layout.bin / "kubectl"), "--kubeconfig", str(layout.admin_kubeconfig), "-n", NAMESPACE]
        + ["port-forward", service, f"{port}:8080"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return forward, port


def manifest_of(objects: list[dict]) -> str:
    """Objects as one manifest for `kubectl apply -f -`."""
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": objects})
