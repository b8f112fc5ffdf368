"""Property-based fuzzing of every operation in the coordinator's OpenAPI schema, over
real HTTP against the running coordinator, with the token: no request makes it fail (5xx).

The schema is generated from the coordinator's app at collection time (one test per
operation); the running coordinator is checked to serve exactly that schema. Half the
generated requests are pointed at a live job and a real worker, so they reach the state
machine, the registry and the PS shards rather than only "404 no such job"."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from unconnected import unconnected_settings

from trillium import stack
from trillium.services.coordinator.server import Coordinator


def _openapi() -> dict:
    # Building the app connects to nothing: these settings are never used to reach a server.
    unused = unconnected_settings("coordinator")
    return Coordinator(unused).app.openapi()


OPENAPI = _openapi()
schema = schemathesis.openapi.from_dict(OPENAPI)
# Bounded: explicit examples and max_examples generated cases (valid and invalid) per operation.
# The coverage phase is left out: it enumerates thousands of boundary cases for the job schema.
schema.config.phases.update(phases=["examples", "fuzzing"])


@dataclass
class Target:
    url: str
    token: str
    job_id: str
    worker: str


@pytest.fixture(scope="module")
def target(api_stack, tiny_job):
    assert api_stack.http.get(api_stack.url + "/openapi.json").json() == OPENAPI  # fuzzing what is served
    job = api_stack.http.post("/jobs", json=tiny_job.model_dump(mode="json"))
    assert job.status_code == 201, job.text
    yield Target(api_stack.url, api_stack.token, job.json()["id"], "nn_worker-1")
    # Leave the stack as the other tests expect it: no active job, no workers but its own
    # (real ones re-register on their next heartbeat if a request replaced them).
    for listed in api_stack.http.get("/jobs").json():
        if listed["state"] in ("submitted", "starting", "running", "paused"):
            api_stack.http.post(f"/jobs/{listed['id']}/stop")
            api_stack.wait_for(listed["id"], {"stopped", "failed"}, timeout_s=60)
    ours = {p["name"] for p in stack.read_state(api_stack.run_dir)["processes"]}
    for worker in api_stack.http.get("/workers").json():
        if worker["name"] not in ours:
            api_stack.http.delete(f"/workers/{worker['name']}")


@schema.parametrize()
@schema.given(real=st.booleans())
@settings(max_examples=30, deadline=timedelta(seconds=10), suppress_health_check=[HealthCheck.too_slow])
def test_no_request_makes_the_coordinator_fail(case, real, target) -> None:
    if real:
        if "job_id" in case.path_parameters:
            case.path_parameters["job_id"] = target.job_id
        if "name" in case.path_parameters:
            case.path_parameters["name"] = target.worker
    response = case.call(base_url=target.url, headers={"Authorization": f"Bearer {target.token}"}, timeout=30)
    assert response.status_code < 500, (case.method, case.formatted_path, case.body, response.text)
