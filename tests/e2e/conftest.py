"""A training stack (2 NN ranks, 2 PS shards, 1 embedding worker, 2 data loaders) on the session's
real Kafka and Redis, and helpers to run a job on it to the end."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from pipeline_helpers import DATA
from secrets_in_logs import assert_no_secret_in_logs

from trillium import stack
from trillium.config import StackTopology
from trillium.data import load_job
from trillium.job import JobConfig
from trillium.job.record import ACTIVE
from trillium.scopes import SCOPES
from trillium.stack.client import CoordinatorClient


@pytest.fixture(scope="session")
def training_stack(infra, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("training-stack")
    stack.up(
        run_dir,
        StackTopology(nn_ranks=2, ps_shards=2, embedding_workers=1, data_loaders=2),
        kafka_bootstrap=infra.kafka_bootstrap,
        redis_url=infra.redis_database(2),
    )
    yield run_dir
    stack.down(run_dir)
    assert_no_secret_in_logs(run_dir, [*(stack.read_token(run_dir, scope) for scope in SCOPES)])


@pytest.fixture(autouse=True)
def no_job_left_active(request):
    """One job runs at a time: a test must end its job. One that did not is an error here, and
    its job is stopped, so the next test starts on an idle stack rather than failing with 409."""
    yield
    if "training_stack" not in request.fixturenames:
        return
    client = CoordinatorClient.for_stack(request.getfixturevalue("training_stack"))
    try:
        left = [j for j in client.jobs() if j["state"] in ACTIVE]
        for job in left:
            if job["state"] != "stopping":
                client.stop(job["id"])
        deadline = time.monotonic() + 180
        while any(client.job(j["id"])["job"]["state"] in ACTIVE for j in left):
            assert time.monotonic() < deadline, f"jobs left active did not stop: {[j['id'] for j in left]}"
            time.sleep(0.5)
    finally:
        client.close()
    assert not left, f"the test left jobs active: {[(j['id'], j['state']) for j in left]}"


@pytest.fixture(scope="session")
def tiny_job() -> JobConfig:
    return load_job(DATA / "tiny_job.yaml")
