"""Property-based fuzzing of every operation in a serving replica's OpenAPI schema, over real HTTP
against the stack's replica serving a trained model, with the token: no request makes it fail
(5xx), and it answers a normal prediction as before once the fuzzing is over.

Half the generated requests name the served model, so they reach the transform, the tables and
the model rather than only "404 no such model"; instances are drawn as the job's own rows with
fields of every JSON type."""

from __future__ import annotations

from datetime import timedelta

import schemathesis
from fuzzed_instances import INSTANCES
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from unconnected import unconnected_settings

from trillium.services.serving.server import ServingReplica


def _openapi() -> dict:
    unused = unconnected_settings("serving")
    return ServingReplica(unused).app.openapi()


OPENAPI = _openapi()
schema = schemathesis.openapi.from_dict(OPENAPI)
schema.config.phases.update(phases=["examples", "fuzzing"])


@schema.parametrize()
@schema.given(real=st.booleans(), instances=INSTANCES)
@settings(max_examples=40, deadline=timedelta(seconds=10), suppress_health_check=[HealthCheck.too_slow])
def test_no_request_makes_a_replica_fail(case, real, instances, served) -> None:
    if real:
        if "model" in case.path_parameters:
            case.path_parameters["model"] = served.model
        if case.formatted_path.endswith(":predict") and isinstance(case.body, dict):
            case.body["instances"] = instances
    response = case.call(base_url=served.url, headers={"Authorization": f"Bearer {served.token}"}, timeout=30)
    assert response.status_code < 500, (case.method, case.formatted_path, case.body, response.text)
