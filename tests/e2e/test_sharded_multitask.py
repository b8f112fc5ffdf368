"""A multi-task model served by a sharded stack: 3 serving shards each hold a slice of its tables
behind one frontend, which answers every task as the job's own evaluation of the final version
scored it, over REST and gRPC."""

from __future__ import annotations

import asyncio
import csv
from pathlib import Path

import numpy as np
import pytest
from pipeline_helpers import DATA
from replica import SKEW, evaluation, grpc_predictions
from sharded_frontend import Frontend, shard_version
from waiting import wait_until

from trillium import stack
from trillium.config import GrpcCredentials, StackTopology
from trillium.data import load_job
from trillium.job import JobConfig
from trillium.runtime.model_store import ModelStore
from trillium.stack.client import CoordinatorClient

SHARDS = 3
PS_SHARDS = 4


@pytest.fixture(scope="module")
def shards(infra, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("sharded-multitask-stack")
    topology = StackTopology(
        nn_ranks=1,
        ps_shards=PS_SHARDS,
        embedding_workers=1,
        data_loaders=1,
        serving_replicas=1,
        serving_shards=SHARDS,
        serving_shard_replicas=1,
    )
    stack.up(run_dir, topology, kafka_bootstrap=infra.kafka_bootstrap, redis_url=infra.redis_database(12))
    try:
        yield run_dir
    finally:
        stack.down(run_dir)


def test_a_multi_task_model_is_answered_task_by_task_through_the_shards(shards) -> None:
    """tests/data/tiny_multitask_job.yaml (a click, a watch time learnt as log seconds, a masked
    conversion) served from the three shards: every task's answer is the job's own evaluation of
    the final version (the watch time in seconds), over REST and gRPC."""
    raw = load_job(DATA / "tiny_multitask_job.yaml").model_dump(mode="json", exclude_none=True)
    raw["name"] = "sharded-multitask"
    raw["tables"]["item"]["dim"] = 4  # each shard's slice under the cap
    raw["model"]["kwargs"]["embedding_dims"] = [4, 4, 4, 4]
    raw["topology"] = {"nn_ranks": 1, "ps_shards": PS_SHARDS, "embedding_workers": 1}
    raw["training"]["epochs"] = 2
    raw["publish"] = {"at_checkpoints": False, "every_seconds": None}
    job = JobConfig.model_validate(raw, context={"base_dir": DATA})
    client = CoordinatorClient.for_stack(shards)
    try:
        view = client.follow(client.submit(job)["id"], timeout_s=300)
    finally:
        client.close()
    assert view["job"]["state"] == "finished", view["job"]["error"]
    store = ModelStore.of(job, shards)
    newest = store.manifest(store.versions()[-1])
    expected = evaluation(store, newest).astype(np.float64)
    expected[:, 1] = np.exp(expected[:, 1])  # evaluated in log seconds, answered in seconds
    tasks = [t.name for t in job.tasks]
    rows = list(csv.DictReader((DATA / "tiny_multitask/test.csv").open()))
    instances = [{k: v for k, v in row.items() if k not in ("click", "watch_seconds", "conversion")} for row in rows]
    frontend = Frontend(shards)
    for shard in range(SHARDS):  # the frontend answers once every shard has its slice of the version
        wait_until(lambda s=shard: shard_version(shards, s, job.name) == newest.version, f"shard {shard} serving", 60)
    wait_until(lambda: frontend.version(job.name) == newest.version, f"version {newest.version} served", 60)
    r = frontend.ask(job.name, instances)
    assert r.status_code == 200, r.text
    assert r.json()["tasks"] == tasks and r.json()["version"] == newest.version
    got = np.array([[answer[t] for t in tasks] for answer in r.json()["predictions"]])
    np.testing.assert_allclose(got, expected, rtol=SKEW, atol=SKEW)
    address = next(p["grpc_address"] for p in stack.read_state(shards)["processes"] if p["role"] == "serving")
    grpc = asyncio.run(
        grpc_predictions(address, GrpcCredentials(token=stack.read_token(shards)), job.name, instances[:40])
    )
    assert list(grpc.tasks) == tasks and grpc.version == newest.version
    np.testing.assert_allclose(np.asarray(grpc.predictions).reshape(40, len(tasks)), got[:40], rtol=1e-6)
