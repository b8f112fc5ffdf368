"""Serving on a real stack: a job's model answers predictions from the stack's serving replica,
with zero skew against the job's own evaluation of the same version (the Adult example, and a job
of multi-valued, mean-pooled and sequence slots), pinned to an older version and back."""

from __future__ import annotations

import asyncio
import csv
import os
import signal
import threading
import time
import uuid
from pathlib import Path

import httpx
import numpy as np
import pytest
from pipeline_helpers import DATA, run_to_end
from replica import SKEW, Replica, delimited_rows, newest_version, stack_evaluation
from waiting import wait_until

from trillium import stack
from trillium.data import load_job
from trillium.data.replay import replay
from trillium.data.sources.datagen import generate_criteo
from trillium.data.sources.presets import ADULT
from trillium.job import ADULT_COLUMNS, CRITEO_COLUMNS, JobConfig
from trillium.runtime.model_store import ModelStore, model_topic
from trillium.services.serving.follower import ModelFollower
from trillium.services.serving.served import ServedModel
from trillium.stack.client import CoordinatorClient
from trillium.wire import kafka

ROOT = Path(__file__).resolve().parents[2]


def test_the_adult_example_is_served_as_it_evaluates(training_stack) -> None:
    """`trillium train examples/adult/job.yaml`, then predictions, with no other step: the replica
    finds the model, serves its final version, and answers the test split as the job's own
    evaluation of that version scored it."""
    job = load_job(ROOT / "examples/adult/job.yaml")
    view, report = run_to_end(training_stack, job)
    assert view["job"]["state"] == "finished", view["job"]["error"]
    final = newest_version(training_stack, job)
    assert final.job_id == view["job"]["id"] and final.step == report["steps"] - 1
    expected = stack_evaluation(training_stack, job, final)
    instances = delimited_rows(ROOT / "examples/adult/data/adult.test", ADULT_COLUMNS, ADULT.delimiter, strip=True)
    assert len(expected) == len(instances) == report["eval_samples"]
    replica = Replica(training_stack)
    replica.wait_for(job.name, final.version)
    got, versions = replica.predict(job.name, instances)
    assert versions == {final.version}
    print(f"\nAdult: serving vs the job's evaluation, max |diff| {np.abs(got - expected).max():.2e} over {len(got)}")
    assert np.abs(got - expected).max() <= SKEW


def _pooled_job(tmp_path: Path) -> JobConfig:
    """tests/data/tiny as CSV with a multi-valued column: mean- and sum-pooled and sequence slots of it."""
    for split in ("train", "test"):
        rows = delimited_rows(DATA / "tiny" / f"{split}.tsv", CRITEO_COLUMNS, "\t")
        with (tmp_path / f"{split}.csv").open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow([*CRITEO_COLUMNS, "tags"])
            for row in rows:
                tags = "|".join(v for v in (row["C1"], row["C2"], row["C3"], row["C1"]) if v)
                writer.writerow([*row.values(), tags])
    raw = load_job(DATA / "tiny_job.yaml").model_dump(mode="json")
    raw["name"] = "pooled"
    raw["data"] = {"source": "csv", "train": str(tmp_path / "train.csv"), "test": str(tmp_path / "test.csv")}
    raw["slots"] += [
        {"name": "tags_mean", "column": "tags", "table": "a", "separator": "|", "pooling": "mean", "max_len": 3},
        {"name": "tags_seq", "column": "tags", "table": "b", "separator": "|", "pooling": "none", "max_len": 4},
    ]
    raw["model"]["kwargs"]["embedding_dims"] += [4, 8]
    return JobConfig.model_validate(raw)


def test_multi_valued_mean_pooled_and_sequence_slots_are_served_as_they_evaluate(training_stack, tmp_path) -> None:
    job = _pooled_job(tmp_path)
    view, _ = run_to_end(training_stack, job)
    assert view["job"]["state"] == "finished", view["job"]["error"]
    final = newest_version(training_stack, job)
    expected = stack_evaluation(training_stack, job, final)
    instances = [dict(row) for row in csv.DictReader((tmp_path / "test.csv").open())]
    replica = Replica(training_stack)
    replica.wait_for(job.name, final.version)
    got, versions = replica.predict(job.name, instances)
    assert versions == {final.version} and len(got) == len(expected)
    print(f"\npooled slots: serving vs the job's evaluation, max |diff| {np.abs(got - expected).max():.2e}")
    assert np.abs(got - expected).max() <= SKEW


def test_a_replica_pinned_to_an_older_version_answers_as_that_version_evaluated(training_stack, tmp_path) -> None:
    """Versions at every checkpoint (evaluated there); pinned to the first, a replica answers as the
    job's evaluation at that checkpoint; unpinned, it serves the newest again."""
    raw = load_job(DATA / "tiny_job.yaml").model_dump(mode="json")
    raw["name"] = "pinned"
    raw["checkpoint"] = {"every_steps": 10, "every_seconds": None, "evaluate": True}
    raw["publish"] = {"at_checkpoints": True, "every_seconds": None}
    job = JobConfig.model_validate(raw, context={"base_dir": DATA})
    view, _ = run_to_end(training_stack, job)
    assert view["job"]["state"] == "finished", view["job"]["error"]
    store = ModelStore.of(job, training_stack)
    mine = [store.manifest(v) for v in store.versions()]
    mine = [m for m in mine if m.job_id == view["job"]["id"]]
    assert len(mine) >= 3 and mine[0].kind == "full"  # the rest: deltas, unless a cut came before its base's commit
    old, newest = mine[0], mine[-1]
    instances = delimited_rows(DATA / "tiny" / "test.tsv", CRITEO_COLUMNS, "\t")
    replica = Replica(training_stack)
    replica.wait_for(job.name, newest.version)
    r = replica.http.post(f"/v1/models/{job.name}/rollback", json={"version": old.version})
    assert r.status_code == 200 and r.json()["pinned"] == old.version, r.text
    got, versions = replica.predict(job.name, instances)
    assert versions == {old.version}
    assert np.abs(got - stack_evaluation(training_stack, job, old)).max() <= SKEW
    assert replica.http.post(f"/v1/models/{job.name}/rollback", json={"version": 10**6}).status_code == 404
    assert replica.http.post(f"/v1/models/{job.name}/unpin").status_code == 200
    replica.wait_for(job.name, newest.version)
    got, _ = replica.predict(job.name, instances)
    assert np.abs(got - stack_evaluation(training_stack, job, newest)).max() <= SKEW


def test_a_replica_refuses_a_version_over_its_memory_cap(training_stack, infra) -> None:
    """`serving_memory_gb`: a replica never loads a version whose full version's values files, on
    disk, are more than its cap (it refuses every version, saying why); under twice the largest,
    it serves the newest."""
    raw = load_job(DATA / "tiny_job.yaml").model_dump(mode="json")
    raw["name"] = "capped"
    raw["checkpoint"] = {"every_steps": 10, "every_seconds": None}
    raw["publish"] = {"at_checkpoints": True, "every_seconds": None}
    job = JobConfig.model_validate(raw, context={"base_dir": DATA})
    view, _ = run_to_end(training_stack, job)
    assert view["job"]["state"] == "finished", view["job"]["error"]
    store = ModelStore.of(job, training_stack)
    versions = store.versions()
    assert len(store.chain(versions[-1])) >= 2  # the in-place check of a delta, and the chain's

    def on_disk(version: int) -> int:
        """The bytes of the values files of the full version `version` is built on."""
        total = 0
        for manifest in store.chain(version)[:1]:
            for values in manifest.values:
                with store.parts(manifest.parts).reading(values.name) as path:
                    total += os.path.getsize(path)
        return total

    def follow(cap: int) -> ModelFollower:
        async def loaded() -> ModelFollower:
            follower = ModelFollower(
                store, model_topic(job.name), infra.kafka, lambda first: ServedModel(store, first, 1), memory_cap=cap
            )
            follower.start(lambda *_: None)
            try:
                await asyncio.wait_for(follower.loaded.wait(), 60)
            finally:
                await follower.stop()
            return follower

        return asyncio.run(loaded())

    refusing = follow(min(on_disk(v) for v in versions) - 1)
    assert refusing.served is None
    assert {r.version for r in refusing.state.refused} == set(versions)
    assert all("over this replica's cap" in r.reason for r in refusing.state.refused), refusing.state.refused
    cap = 2 * max(on_disk(v) for v in versions)
    serving = follow(cap)
    assert serving.served is not None and serving.served.version == versions[-1], serving.state.refused
    print(f"\ncapped: {on_disk(versions[-1])} bytes on disk, {serving.served.tables.memory_bytes()} in memory")


@pytest.mark.parametrize(
    ("body", "status", "names"),
    [
        ({"instances": [{"age": "39"}, {"age": {"x": 1}}]}, 422, ["instances", 1, "age"]),
        ({"instances": [{}, "a row"]}, 422, ["instances", 1]),
        ({"instances": "not a list"}, 422, ["instances"]),
        ({"instances": [{}] * 2000}, 413, None),
    ],
)
def test_bad_requests_name_the_instance_and_the_field(training_stack, body, status, names) -> None:
    job = load_job(ROOT / "examples/adult/job.yaml")
    replica = Replica(training_stack)
    if replica.view(job.name)["version"] is None:
        run_to_end(training_stack, job)
        replica.wait_for(job.name, newest_version(training_stack, job).version)
    r = replica.http.post(f"/v1/models/{job.name}:predict", json=body)
    assert r.status_code == status, r.text
    if names is not None:
        assert r.json()["detail"][0]["loc"][1:] == names
    assert replica.http.post("/v1/models/no-such-model:predict", json={"instances": []}).status_code == 404
    assert httpx.post(f"{replica.url}/v1/models/{job.name}:predict", json={"instances": []}).status_code == 401


def _online(name: str, topic: str) -> JobConfig:
    """examples/online on its own topics: versions every 2 s, checkpoints every 20 steps."""
    raw = load_job(ROOT / "examples/online/job.yaml").model_dump(mode="json")
    raw["name"] = name
    raw["data"]["join"] |= {
        "impressions": f"{topic}-imps",
        "labels": f"{topic}-clicks",
        "window_seconds": 2.0,
        "allowed_lateness_seconds": 0.5,
    }
    raw["topology"] |= {"data_loaders": 1}
    raw["checkpoint"] = {"every_steps": 20, "every_seconds": None}
    raw["publish"] = {"every_seconds": 2.0}
    return JobConfig.model_validate(raw)


def _pid(run_dir: Path, name: str) -> int:
    return next(p["pid"] for p in stack.read_state(run_dir)["processes"] if p["name"] == name)


def test_an_online_job_is_served_fresh_through_crashes(training_stack, infra, tmp_path) -> None:
    """An online job trains from a replayed stream and publishes; the replica follows it and its
    predictions for a fixed probe set change as the model learns. A PS shard killed: answers keep
    coming from the version held, which advances again once the job has recovered. The replica
    killed: restarted, it serves the newest version again."""
    run = uuid.uuid4().hex[:8]
    generate_criteo(tmp_path / "stream.tsv", 90_000, seed=9, vocab_sizes=[50] * 26)  # a minute at 1500/s
    job = _online(f"fresh-{run}", run)
    probes = [
        dict(zip(CRITEO_COLUMNS[1:], line.split("\t")[1:], strict=True))
        for line in (tmp_path / "stream.tsv").read_text().splitlines()[:20]
    ]
    for probe in probes:  # a stream's events carry numbers
        probe.update({f"I{i}": float(probe[f"I{i}"]) if probe[f"I{i}"] else None for i in range(1, 14)})
    asyncio.run(kafka.ensure_topics(infra.kafka, {f"{run}-imps": 4, f"{run}-clicks": 4}))
    client = CoordinatorClient.for_stack(training_stack)
    replica = Replica(training_stack)
    feed = threading.Thread(
        target=lambda: asyncio.run(replay(tmp_path / "stream.tsv", job, infra.kafka, fmt="criteo", rate=1500, seed=9)),
        daemon=True,
    )
    try:
        job_id = client.submit(job)["id"]
        feed.start()
        first = replica.wait_for_any(job.name, 120)
        before, _ = replica.predict(job.name, probes)
        replica.wait_for_newer(job.name, first + 3, 120)
        after, _ = replica.predict(job.name, probes)
        assert np.abs(after - before).max() > 1e-3  # the model learns, and the replica follows
        store = ModelStore.of(job, training_stack)
        assert "delta" in {store.manifest(v).kind for v in store.versions()}  # 2 s apart: on committed bases
        # The low watermark: an impression is trained once its window has closed, so a version
        # holds every event only up to a window before the newest read (tests/e2e/test_online.py
        # checks it against the input); the newest event trained is fresher than that.
        view = replica.view(job.name)
        assert view["low_watermark"] is not None and view["low_watermark"] < view["event_time"], view
        assert view["low_watermark_lag_seconds"] >= job.data.join.window_seconds, view

        wait_until(lambda: client.job(job_id)["last_checkpoint"], "a checkpoint", 120)
        held = replica.view(job.name)["version"]
        os.kill(_pid(training_stack, "embedding_ps-1"), signal.SIGKILL)
        # Answers keep coming while the job recovers, from versions that only move forward.
        versions = []
        deadline = time.monotonic() + 300
        while not (view := client.job(job_id))["job"]["recoveries"] or view["job"]["state"] != "running":
            assert time.monotonic() < deadline, view["job"]["state"]
            _, answered = replica.predict(job.name, probes[:1])
            versions += sorted(answered)
        assert versions == sorted(versions) and versions[0] >= held
        recovered = replica.wait_for_newer(job.name, max(versions) + 1, 180)
        assert client.job(job_id)["job"]["attempt"] == 1

        os.kill(_pid(training_stack, "serving-0"), signal.SIGKILL)
        wait_until(lambda: _pid(training_stack, "serving-0") and replica.ready(), "the replica back", 120)
        assert replica.wait_for_newer(job.name, recovered, 60) >= recovered
        assert replica.view(job.name)["version"] >= store.versions()[-1] - 2  # at the newest, within a version or two
        feed.join()  # the stream played to its end
    finally:
        client.stop(job_id)
        wait_until(lambda: client.job(job_id)["job"]["state"] == "stopped", "the job to stop", 120)
        client.close()
