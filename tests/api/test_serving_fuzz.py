"""Property-based fuzzing of every operation in a serving replica's OpenAPI schema, over real HTTP
against the stack's replica serving a trained model, with the token: no request makes it fail
(5xx), and it answers a normal prediction as before once the fuzzing is over.

Half the generated requests name the served model, so they reach the transform, the tables and
the model rather than only "404 no such model"; instances are drawn as the job's own rows with
fields of every JSON type."""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from unconnected import unconnected_settings

from trillium import stack
from trillium.job import CRITEO_COLUMNS
from trillium.services.serving.server import ServingReplica


def _openapi() -> dict:
    unused = unconnected_settings("serving")
    return ServingReplica(unused).app.openapi()


OPENAPI = _openapi()
schema = schemathesis.openapi.from_dict(OPENAPI)
schema.config.phases.update(phases=["examples", "fuzzing"])

FIELDS = [*CRITEO_COLUMNS[1:], "nested.field", "label"]
# Values of every JSON type; a float is finite, as JSON has no NaN or Infinity (the client
# refuses to send one: a [inf] instance failed the test on the client's side).
VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=40),
    st.lists(st.one_of(st.text(max_size=8), st.integers(), st.none()), max_size=5),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
)
INSTANCES = st.lists(st.one_of(st.dictionaries(st.sampled_from(FIELDS), VALUES, max_size=12), VALUES), max_size=20)


@dataclass
class Target:
    url: str
    token: str
    model: str
    probe: dict


@pytest.fixture(scope="module")
def target(api_stack, tiny_job):
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
    yield Target(replica["http_url"], api_stack.token, tiny_job.name, probe)
    # Every fuzzed request is over: the replica answers as it did.
    r = http.post(f"/v1/models/{tiny_job.name}:predict", json={"instances": [probe]})
    assert r.status_code == 200, r.text
    http.close()


@schema.parametrize()
@schema.given(real=st.booleans(), instances=INSTANCES)
@settings(max_examples=40, deadline=timedelta(seconds=10), suppress_health_check=[HealthCheck.too_slow])
def test_no_request_makes_a_replica_fail(case, real, instances, target) -> None:
    if real:
        if "model" in case.path_parameters:
            case.path_parameters["model"] = target.model
        if case.formatted_path.endswith(":predict") and isinstance(case.body, dict):
            case.body["instances"] = instances
    response = case.call(base_url=target.url, headers={"Authorization": f"Bearer {target.token}"}, timeout=30)
    assert response.status_code < 500, (case.method, case.formatted_path, case.body, response.text)
