"""deploy/k8s on a real cluster (tests/k8s/deployment.py applies the local overlay): every process
of the base starts, registers through the NetworkPolicies and trains Adult to the demo's quality; a
PS shard killed mid-job is restarted by the kubelet and the job recovers from its checkpoint on the
shared object store with every gradient held once; the model it publishes there is served as the
job evaluated it."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
import yaml
from deployment import REPO, deploy
from ledger import assert_exactly_once_at_the_ps
from waiting import wait_until

from trillium.data.sources.presets import ADULT
from trillium.job import ADULT_COLUMNS, JobConfig
from trillium.runtime.model_store import EVAL, ModelStore

pytestmark = pytest.mark.k8s
WORKERS = {"data_loader-0", "embedding_ps-0", "embedding_ps-1", "embedding_worker-0", "nn_worker-0", "nn_worker-1"}
ADULT_TRAIN_ROWS = 32_561  # adult.data's rows (UCI's count)
ADULT_TEST_ROWS = 16_281
SKEW = 1e-5  # serving's predictions against the job's evaluation of the same version


@pytest.fixture(scope="module")
def deployment(cluster):
    yield from deploy(cluster)


def _adult(epochs: int) -> JobConfig:
    job = yaml.safe_load((REPO / "examples/adult/job.yaml").read_text())
    job["data"]["train"] = "/data/adult.data"  # the claim trillium-data, the loader's /data
    job["data"]["test"] = "/data/adult.test"
    job["training"]["epochs"] = epochs
    return JobConfig.model_validate(job)


def test_every_process_of_the_base_registers_and_is_healthy(deployment) -> None:
    def healthy() -> set[str]:
        return {w["name"] for w in deployment.client.workers() if w["status"] == "healthy"}

    wait_until(lambda: healthy() >= WORKERS, "every worker registered and healthy", 120)


def test_adult_trains_on_the_cluster_to_the_demos_quality(deployment) -> None:
    job = deployment.client.submit(_adult(epochs=1))
    view = deployment.client.follow(job["id"], timeout_s=600)
    assert view["job"]["state"] == "finished", view["job"].get("error")
    metrics = view["job"]["metrics"]
    assert metrics["samples"] == ADULT_TEST_ROWS and metrics["auc"] >= 0.89, metrics  # compose's bound


def _test_instances() -> list[dict]:
    rows = []
    for line in (REPO / "examples/adult/data/adult.test").read_text().splitlines():
        cells = [c.strip() for c in line.split(ADULT.delimiter)]
        if len(cells) == len(ADULT_COLUMNS):
            rows.append(dict(zip(ADULT_COLUMNS, cells, strict=True)))
    return rows


def test_a_ps_killed_mid_job_recovers_from_the_shared_checkpoint_and_the_model_is_served(deployment) -> None:
    """kill -9 of PS shard 1's process (from the node: inside its container it is PID 1, which a
    SIGKILL from there does not stop) after the job's first checkpoint; the kubelet restarts it, the
    coordinator restores every process from that checkpoint on the object store (its parts written
    by four pods), and the PS shards' ledgers hold each step's gradients exactly once. Then the
    serving replica answers the test split as the job's own evaluation of its final version, read
    from the object store's volume."""
    config = _adult(epochs=3).model_copy(deep=True)
    config = JobConfig.model_validate(
        config.model_dump(mode="json") | {"checkpoint": {"every_steps": 40, "every_seconds": None}}
    )
    client = deployment.client
    job_id = client.submit(config)["id"]
    wait_until(lambda: client.job(job_id)["last_checkpoint"] is not None, "a first checkpoint", 300)
    view = client.job(job_id)
    assert view["job"]["state"] == "running", view["job"]["error"]
    assert view["progress"]["samples"] < 0.7 * 3 * ADULT_TRAIN_ROWS, "the job ran too far before the kill"
    restarts = deployment.container("embedding-ps-1")["restartCount"]
    os.kill(deployment.pid("embedding-ps-1"), signal.SIGKILL)

    view = client.follow(job_id, timeout_s=900)
    assert view["job"]["state"] == "finished", view["job"]["error"]
    assert view["job"]["recoveries"], "the job never noticed the PS shard's death"
    assert view["job"]["restore"] is not None, "the recovery started over instead of restoring the checkpoint"
    assert view["job"]["restore"]["location"].startswith("s3://trillium/checkpoints/")
    assert deployment.container("embedding-ps-1")["restartCount"] > restarts
    assert_exactly_once_at_the_ps(view, config, rows=ADULT_TRAIN_ROWS)
    recovery = view["job"]["recoveries"][-1]
    print(f"\nk8s: {recovery['cause']}; restored {view['job']['restore']['location']}")

    store = ModelStore(str(deployment.volume("data-object-store-0") / "trillium" / "models"), config.name)
    final = store.manifest(store.versions()[-1])
    assert final.job_id == job_id
    with store.parts(final.parts).reading(EVAL) as path:
        expected = np.load(path)
    instances = _test_instances()
    assert len(expected) == len(instances) == ADULT_TEST_ROWS

    def serves_final() -> bool:
        r = deployment.serving.get(f"/v1/models/{config.name}")
        return r.status_code == 200 and r.json()["version"] == final.version

    wait_until(serves_final, f"the replica serving version {final.version}", 120)
    got: list[float] = []
    for start in range(0, len(instances), 1000):
        r = deployment.serving.post(
            f"/v1/models/{config.name}:predict", json={"instances": instances[start : start + 1000]}
        )
        assert r.status_code == 200 and r.json()["version"] == final.version, r.text
        got += r.json()["predictions"]
    skew = np.abs(np.asarray(got, np.float32) - expected).max()
    print(f"\nk8s: serving vs the job's evaluation, max |diff| {skew:.2e} over {len(got)}")
    assert skew <= SKEW
