"""docker-compose.yml for real (`make test-compose`, which provides the engine and the offline images):
the project comes up healthy with its security on, trains Adult through the API published on
127.0.0.1 to the demo's quality, a crashed PS shard is brought back by the restart policy, and
`down -v` leaves no container, network or volume behind."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from trillium.cli import summarize
from trillium.job import ADULT_COLUMNS
from trillium.stack.client import CoordinatorClient
from trillium.stack.procs import free_port

pytestmark = pytest.mark.compose

REPO = Path(__file__).resolve().parents[2]
FILES = ["-f", "docker-compose.yml", "-f", "docker-compose.offline.yml"]
SERVICES = [
    "kafka",
    "redis",
    "coordinator",
    "embedding-ps-0",
    "embedding-ps-1",
    "embedding-worker-0",
    "nn-worker-0",
    "nn-worker-1",
    "data-loader-0",
    "serving",
]
ADULT_TRAIN_ROWS = 32_561  # examples/adult/data/adult.data
ADULT_ROW = "39, State-gov, 77516, Bachelors, 13, Never-married, Adm-clerical, Not-in-family, White, Male, 2174, 0, 40, United-States"
# The data loader sees the repository's examples/ at /data/examples (docker-compose.yml).
ADULT_JOB = (REPO / "examples/adult/job.yaml").read_text().replace(": data/", ": /data/examples/adult/data/")


@dataclass
class Compose:
    project: str
    env_file: Path
    url: str
    token: str
    serving_url: str
    serving_grpc: str

    def run(self, *args: str, timeout_s: float = 600) -> str:
        out = subprocess.run(
            ["docker-compose", "--env-file", str(self.env_file), *FILES, *args],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        assert out.returncode == 0, f"docker-compose {' '.join(args)}:\n{out.stdout[-3000:]}{out.stderr[-3000:]}"
        return out.stdout

    def container(self, service: str) -> str:
        return self.run("ps", "-q", service).strip()

    def leftovers(self) -> dict[str, list[str]]:
        label = f"label=com.docker.compose.project={self.project}"
        return {
            "container": _docker("ps", "-aq", "--filter", label).split(),
            **{kind: _docker(kind, "ls", "-q", "--filter", label).split() for kind in ("network", "volume")},
        }


def _docker(*args: str) -> str:
    out = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"docker {' '.join(args)}: {out.stderr}"
    return out.stdout


def _state(container: str, field: str) -> str:
    return _docker("inspect", "-f", f"{{{{{field}}}}}", container).strip()


def _wait_healthy(stack: Compose, services: list[str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        health = {s: _state(stack.container(s), ".State.Health.Status") for s in services}
        if all(h == "healthy" for h in health.values()):
            return
        assert time.monotonic() < deadline, f"not healthy after {timeout_s:.0f} s: {health}"
        time.sleep(2)


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Compose:
    project = os.environ.get("COMPOSE_PROJECT_NAME")
    assert project, "run by `make test-compose`, which names the compose project (COMPOSE_PROJECT_NAME)"
    env_file = tmp_path_factory.mktemp("compose") / ".env"
    port, serving_port, serving_grpc = free_port(), free_port(), free_port()
    subprocess.run(
        [str(REPO / "scripts" / "compose-env"), str(env_file)], check=True
    )  # the secrets, as users make them
    with env_file.open("a") as f:
        f.write(
            f"TRILLIUM_API_PORT={port}\nTRILLIUM_SERVING_PORT={serving_port}\nTRILLIUM_SERVING_GRPC_PORT={serving_grpc}\n"
        )
    values = dict(line.split("=", 1) for line in env_file.read_text().splitlines())
    token = values["TRILLIUM_OPERATE_TOKEN"]
    stack = Compose(
        project,
        env_file,
        f"http://127.0.0.1:{port}",
        token,
        f"http://127.0.0.1:{serving_port}",
        f"127.0.0.1:{serving_grpc}",
    )
    # Nothing may be pulled (this machine reaches no registry of images): every image must be here.
    config = yaml.safe_load(stack.run("config"))
    images = {s["image"] for s in config["services"].values() if not s.get("profiles")}
    missing = [
        i for i in sorted(images) if subprocess.run(["docker", "image", "inspect", i], capture_output=True).returncode
    ]
    assert not missing, f"images missing: {missing} (make images-offline builds them)"
    assert stack.leftovers() == {"container": [], "network": [], "volume": []}, "a previous run left things behind"
    try:
        stack.run("up", "-d")
        _wait_healthy(stack, SERVICES, 300)
        yield stack
    finally:
        stack.run("down", "-v", "--remove-orphans", "--timeout", "30")
    assert stack.leftovers() == {"container": [], "network": [], "volume": []}


def test_every_service_is_healthy_and_registered(stack) -> None:
    client = CoordinatorClient(stack.url, stack.token)
    deadline = time.monotonic() + 60
    while {(w["name"], w["status"]) for w in client.workers()} != {
        (n, "healthy")
        for n in (
            "coordinator-0",
            "embedding_ps-0",
            "embedding_ps-1",
            "embedding_worker-0",
            "nn_worker-0",
            "nn_worker-1",
            "data_loader-0",
        )
    }:
        assert time.monotonic() < deadline, client.workers()
        time.sleep(1)
    # Peers reach each other by their compose host names.
    assert {w["name"]: w["grpc_address"] for w in client.workers() if w["grpc_address"]} == {
        "embedding_ps-0": "embedding-ps-0:50051",
        "embedding_ps-1": "embedding-ps-1:50051",
        "embedding_worker-0": "embedding-worker-0:50051",
    }


def test_security_is_on(stack) -> None:
    assert httpx.get(f"{stack.url}/v1/workers").status_code == 401
    assert httpx.get(f"{stack.url}/metrics").status_code == 401
    # Redis: the default user is off, so a client without credentials is refused.
    out = stack.run("exec", "-T", "redis", "redis-cli", "PING")
    assert "NOAUTH" in out, out
    # Kafka: the broker refuses SCRAM with a wrong password and takes the right one. The two checks run
    # at once, as compose's periodic check may beside one run by hand: neither reads the other's password.
    kafka = stack.container("kafka")
    wrong, right = (
        subprocess.Popen(
            ["docker", "exec", *env, kafka, "sh", "/opt/trillium/kafka.sh", "health"],
            stderr=subprocess.PIPE,
            text=True,
        )
        for env in (["-e", "TRILLIUM_KAFKA_PASSWORD=wrong"], [])
    )
    wrong_err, right_err = (check.communicate(timeout=120)[1] for check in (wrong, right))
    assert wrong.returncode != 0 and "Authentication failed" in wrong_err, wrong_err[-2000:]
    assert right.returncode == 0, right_err[-2000:]
    # Only the API and the serving replica are published, and only on loopback.
    ports = {s: sorted(_docker("port", stack.container(s)).splitlines()) for s in SERVICES}
    assert {s: p for s, p in ports.items() if p} == {
        "coordinator": [f"8080/tcp -> {stack.url[len('http://') :]}"],
        "serving": [f"50051/tcp -> {stack.serving_grpc}", f"8080/tcp -> {stack.serving_url[len('http://') :]}"],
    }
    assert httpx.get(f"{stack.serving_url}/v1/models").status_code == 401


def test_adult_trains_to_the_demos_quality_through_a_crashed_ps_shard(stack) -> None:
    """A PS shard crashes mid-job after a checkpoint: its restart policy brings it back and the
    job recovers from the checkpoint, training every sample exactly once."""
    auth = {"Authorization": f"Bearer {stack.token}"}
    job = ADULT_JOB + "checkpoint: {every_steps: 20, every_seconds: null}\n"
    submitted = httpx.post(
        f"{stack.url}/v1/jobs", content=job, headers=auth | {"Content-Type": "application/yaml"}, timeout=30
    )
    assert submitted.status_code == 201, submitted.text
    job_id = submitted.json()["id"]
    client = CoordinatorClient(stack.url, stack.token)
    deadline = time.monotonic() + 600
    while (view := client.job(job_id))["last_checkpoint"] is None:
        assert view["job"]["state"] in ("submitted", "starting", "running"), view["job"]["error"]
        assert time.monotonic() < deadline, "no checkpoint"
        time.sleep(0.1)
    assert view["job"]["state"] == "running" and view["progress"]["samples"] < ADULT_TRAIN_ROWS
    container = stack.container("embedding-ps-1")
    restarts = int(_state(container, ".RestartCount"))
    crashed_at = time.time()
    _crash(container)
    view = client.follow(job_id, timeout_s=1800)
    report = summarize(view, 0.0)
    assert report["state"] == "finished", report["error"]
    assert len(report["recoveries"]) >= 1, report
    assert report["samples_trained"] == ADULT_TRAIN_ROWS
    assert report["auc"] >= 0.89, report
    print(
        f"\ncompose: Adult AUC {report['auc']:.4f}, {report['samples_trained']} samples, "
        f"{report['samples_per_sec']:.0f} samples/s, recovered from step {report['recoveries'][0]['checkpoint_step']}"
    )
    # The restart policy brought the shard back, healthy and registered again.
    assert int(_state(container, ".RestartCount")) > restarts
    _wait_healthy(stack, ["embedding-ps-1"], 180)
    assert any(
        w["name"] == "embedding_ps-1" and w["status"] == "healthy" and w["registered_at"] > crashed_at
        for w in client.workers()
    )
    # The model answers predictions from the serving replica, at the job's final version.
    row = dict(zip(ADULT_COLUMNS[:-1], [c.strip() for c in ADULT_ROW.split(",")], strict=True))  # no label
    deadline = time.monotonic() + 120
    while True:
        r = httpx.post(
            f"{stack.serving_url}/v1/models/adult-income:predict", json={"instances": [row]}, headers=auth, timeout=30
        )
        if r.status_code == 200 and r.json()["version"] >= 1:
            break
        assert time.monotonic() < deadline, r.text
        time.sleep(1)
    assert 0.0 < r.json()["predictions"][0] < 1.0


def _crash(container: str) -> None:
    """SIGKILL the container's main process from the host: a crash, as the engine sees it. (`docker kill`
    would not do: the engine takes it for a manual stop and its restart policy does not apply.)"""
    os.kill(int(_state(container, ".State.Pid")), signal.SIGKILL)
