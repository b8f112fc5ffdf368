"""A stack for the REST API tests (2 NN ranks, 2 PS shards, 1 embedding worker) on the
session's real Kafka and Redis, and an authenticated HTTP client of its coordinator."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from trillium import stack
from trillium.config import StackTopology
from trillium.data import load_job
from trillium.job import JobConfig
from trillium.scopes import Scope
from trillium.stack.client import TERMINAL

DATA = Path(__file__).resolve().parents[1] / "data"


@dataclass
class ApiStack:
    run_dir: Path
    url: str
    token: str  # an operator's
    redis_url: str
    http: httpx.Client  # /v1 with an operator's token
    services: httpx.Client  # /v1 as a service of the stack calls it (registration, heartbeats)

    def scope_token(self, scope: Scope) -> str:
        return stack.read_token(self.run_dir, scope)

    def wait_for(self, job_id: str, states: set[str], timeout_s: float = 120.0) -> dict[str, Any]:
        """Poll the job's view until its state is one of `states`."""
        deadline = time.monotonic() + timeout_s
        while True:
            view = self.http.get(f"/jobs/{job_id}").raise_for_status().json()
            if view["job"]["state"] in states:
                return view
            assert view["job"]["state"] not in TERMINAL, f"job {job_id} {view['job']['state']}: {view['job']['error']}"
            assert time.monotonic() < deadline, f"job {job_id} still {view['job']['state']}, not {states}"
            time.sleep(0.1)


@pytest.fixture(scope="session")
def api_stack(infra, tmp_path_factory) -> ApiStack:
    run_dir = tmp_path_factory.mktemp("api-stack")
    redis_url = infra.redis_database(1)
    st = stack.up(
        run_dir,
        StackTopology(nn_ranks=2, ps_shards=2, embedding_workers=1),
        kafka_bootstrap=infra.kafka_bootstrap,
        redis_url=redis_url,
    )
    token = stack.read_token(run_dir)
    http = httpx.Client(
        base_url=st["coordinator_url"] + "/v1", headers={"Authorization": f"Bearer {token}"}, timeout=30.0
    )
    services = httpx.Client(
        base_url=st["coordinator_url"] + "/v1",
        headers={"Authorization": f"Bearer {stack.read_token(run_dir, 'services')}"},
        timeout=30.0,
    )
    try:
        yield ApiStack(run_dir, st["coordinator_url"], token, redis_url, http, services)
    finally:
        http.close()
        services.close()
        stack.down(run_dir)


@pytest.fixture(scope="session")
def tiny_job() -> JobConfig:
    return load_job(DATA / "tiny_job.yaml")


@dataclass
class Served:
    """The stack's serving replica, serving the tiny job's model: where to call it, and a probe
    instance it answers."""

    url: str
    grpc_address: str
    token: str
    model: str
    probe: dict
    pid: int


@pytest.fixture(scope="session")
def served(api_stack, tiny_job) -> Served:
    replica = next(p for p in stack.read_state(api_stack.run_dir)["processes"] if p["role"] == "serving")
    job = api_stack.http.post("/jobs", json=tiny_job.model_dump(mode="json"))
    assert job.status_code == 201, job.text
    api_stack.wait_for(job.json()["id"], {"finished"}, timeout_s=300)
    http = httpx.Client(base_url=replica["http_url"], headers={"Authorization": f"Bearer {api_stack.token}"})
    probe = {"C1": "a", "I1": "3"}
    deadline = time.monotonic() + 60
    while http.post(f"/v1/models/{tiny_job.name}:predict", json={"instances": [probe]}).status_code != 200:
        assert time.monotonic() < deadline, "the replica serves no version of the tiny job"
        time.sleep(0.2)
    yield Served(replica["http_url"], replica["grpc_address"], api_stack.token, tiny_job.name, probe, replica["pid"])
    # Every fuzzed request is over: the replica answers as it did.
    r = http.post(f"/v1/models/{tiny_job.name}:predict", json={"instances": [probe]})
    assert r.status_code == 200, r.text
    http.close()
