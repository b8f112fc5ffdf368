"""The serving host cut off from Kafka and from the model store (an S3 store on a host of its own)
while a job goes on publishing: the replica answers throughout with the version it has, says
since when the store does not answer, the age of what it serves grows, and after the heal it
serves the newest version within a poll and a store call's deadline."""

from __future__ import annotations

import ssl
import time
from pathlib import Path

import httpx
import pytest
from timeline import FAULT_EPOCHS, HOLD_S, Timeline, check, cluster_job, record_fault
from waiting import wait_until

from trillium import stack, timeouts
from trillium.runtime.model_store import ModelStore
from trillium.services.serving.follower import POLL_S
from trillium.stack import object_store
from trillium.stack.client import CoordinatorClient
from trillium.stack.links import Network

pytestmark = pytest.mark.cluster

MODEL = "isolated"
# A read of the store fails within its tries' deadlines (s3fs waits 0.1-0.3 s between them); the
# replica reads the store every POLL_S, or at once on a notice.
STORE_CALL_S = timeouts.STORE_TRIES * (timeouts.STORE_READ_S + 0.3)
DETECT_BOUND_S = POLL_S + STORE_CALL_S + 2
# After the heal: a call in flight may run out its deadline first, then the next poll loads.
CATCH_UP_BOUND_S = STORE_CALL_S + POLL_S + 5
INSTANCES = [{**{f"I{i}": str(i) for i in range(1, 14)}, **{f"C{i}": str(i * 3 % 50) for i in range(1, 27)}}] * 4


class Replica:
    def __init__(self, run_dir: Path) -> None:
        state = stack.read_state(run_dir)
        url = next(p["http_url"] for p in state["processes"] if p["role"] == "serving")
        headers = {"Authorization": f"Bearer {stack.read_token(run_dir)}"}
        verify = ssl.create_default_context(cafile=state["tls"]["ca_file"]) if state["tls"] else True
        self.http = httpx.Client(base_url=url, timeout=10.0, headers=headers, verify=verify)

    def view(self) -> dict:
        r = self.http.get(f"/v1/models/{MODEL}")
        return r.json() if r.status_code == 200 else {"version": None}

    def predict(self) -> int:
        """The version that answered (every answer a 200)."""
        r = self.http.post(f"/v1/models/{MODEL}:predict", json={"instances": INSTANCES})
        assert r.status_code == 200, r.text
        assert len(r.json()["predictions"]) == len(INSTANCES)
        return r.json()["version"]


def test_serving_cut_off_from_kafka_and_the_store(cluster, network: Network, uninterrupted, monkeypatch) -> None:
    state = stack.read_state(cluster)
    for name, value in object_store.stack_env(state).items():
        monkeypatch.setenv(name, value)  # the operator reads the store as the services do
    publish = {"model": MODEL, "dir": f"{state['object_store']['url']}/models", "every_seconds": 1.0}
    store = ModelStore(publish["dir"], MODEL)
    replica = Replica(cluster)
    client = CoordinatorClient.for_stack(cluster)
    try:
        job_id = client.submit(cluster_job(FAULT_EPOCHS, name="isolated", publish=publish))["id"]
    finally:
        client.close()
    timeline = Timeline(cluster, job_id)

    def second_version() -> bool:
        if timeline.last_view is not None:
            assert timeline.last_view["job"]["state"] != "failed", timeline.last_view["job"]["error"]
        return (replica.view()["version"] or 0) >= 2

    wait_until(second_version, "second version served", 120)

    served = replica.view()["version"]
    began = network.cut("serving-0", "kafka")
    network.cut("serving-0", object_store.HOST)
    detected = None
    ages = []
    while time.monotonic() - began < HOLD_S:
        assert replica.predict() == served, "the replica changed version while cut off from the store"
        view = replica.view()
        assert view["version"] == served and view["refused"] == [], view
        ages.append((time.monotonic(), view["version_age_seconds"]))
        if detected is None and view["store_unreachable_since"] is not None:
            detected = time.monotonic()
            assert view["store_error"], view
        time.sleep(0.5)
    newest = store.versions()[-1]
    assert newest > served, f"the job published nothing past version {served} in {HOLD_S:.0f}s"
    healed = network.heal()

    caught_up = wait_until(lambda: (replica.view()["version"] or 0) >= newest and time.monotonic(), "catch-up", 120)
    after = replica.view()
    assert after["store_unreachable_since"] is None and after["store_error"] is None, after
    assert replica.predict() >= newest
    view = timeline.wait(600)
    record_fault("serving cut off from Kafka and the store", began, detected, healed, caught_up, view)

    assert detected is not None and detected - began <= DETECT_BOUND_S, (
        f"detected after {detected and detected - began}"
    )
    assert caught_up - healed <= CATCH_UP_BOUND_S, f"caught up {caught_up - healed:.1f}s after the heal"
    (t0, age0), (t1, age1) = ages[0], ages[-1]
    assert age1 - age0 == pytest.approx(t1 - t0, abs=1.0), "the version's reported age did not grow with time"
    assert view["job"]["recoveries"] == [], "cutting serving off disturbed training"
    check(view, uninterrupted)
