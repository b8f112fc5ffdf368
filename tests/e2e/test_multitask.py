"""A multi-task job end to end (tests/data/tiny_multitask_job.yaml: a click, a watch time learnt as
its log by Huber, a conversion masked to clicked rows): one rank in sync trains as the single-process
reference does, task by task; two ranks train every sample once an epoch; the serving replica
answers every task as the job's own evaluation of its final version scored it, over REST and gRPC;
and a stream of events carrying their labels trains each task."""

from __future__ import annotations

import asyncio
import csv
import json
import math
import time
import uuid

import numpy as np
import pytest
from pipeline_helpers import DATA, run_to_end, with_training
from replica import SKEW, Replica, grpc_predictions, newest_version, stack_evaluation
from waiting import wait_until

from trillium import stack
from trillium.config import GrpcCredentials
from trillium.data import load_job
from trillium.data.features import BatchBuilder
from trillium.job import JobConfig
from trillium.stack.client import CoordinatorClient
from trillium.train.reference import train_reference
from trillium.wire import kafka

TASKS = ["click", "watch_time", "conversion"]


@pytest.fixture(scope="module")
def multitask_job() -> JobConfig:
    return load_job(DATA / "tiny_multitask_job.yaml")


def test_one_rank_in_sync_trains_every_task_as_the_reference(training_stack, multitask_job) -> None:
    """Golden equivalence for several tasks: the loss curve, each task's loss curve and each
    task's test metrics of the distributed job (1 rank, k = 0, fp32 wire) are the reference's."""
    job = multitask_job.model_copy(update={"topology": multitask_job.topology.model_copy(update={"nn_ranks": 1})})
    job = with_training(job, wire_dtype="fp32")
    reference = train_reference(job)
    view, report = run_to_end(training_stack, job)
    assert view["job"]["state"] == "finished", view["job"]["error"]
    result = next(iter(view["results"].values()))
    drift = np.abs(np.asarray(result["loss_curve"]) - reference.losses) / np.abs(reference.losses)
    print(
        f"\nmulti-task golden: loss curve relative drift, first/last 10 steps {drift[:10].max():.1e}/{drift[-10:].max():.1e}"
    )
    np.testing.assert_allclose(result["loss_curve"], reference.losses, rtol=1e-4, atol=1e-5)
    assert reference.task_losses is not None and list(result["task_loss_curves"]) == TASKS
    for k, task in enumerate(TASKS):
        theirs = [step[k] for step in reference.task_losses]
        np.testing.assert_allclose(result["task_loss_curves"][task], theirs, rtol=1e-4, atol=1e-5)
    assert reference.test_tasks is not None and list(report["tasks"]) == TASKS
    for task, metrics in reference.test_tasks.items():
        got = report["tasks"][task]
        assert set(got) == set(metrics), task
        for name, value in metrics.items():
            assert got[name] == pytest.approx(value, abs=1e-4), (task, name)
    # The mask holds: the conversion is scored on the clicked test rows only.
    clicked = sum(row["click"] == "1" for row in csv.DictReader((DATA / "tiny_multitask/test.csv").open()))
    assert report["tasks"]["conversion"]["samples"] == clicked < report["eval_samples"] == 400
    assert report["auc"] == report["tasks"]["click"]["auc"]  # the first task's, on top
    # Not trivially so: training moved each task's loss.
    for curve in result["task_loss_curves"].values():
        assert np.mean(curve[-5:]) < np.mean(curve[:5])


def test_two_ranks_train_every_sample_once_and_serve_every_task_as_they_evaluate(training_stack, multitask_job):
    job = with_training(multitask_job, staleness_bound=2)
    view, report = run_to_end(training_stack, job)
    assert view["job"]["state"] == "finished", view["job"]["error"]
    split = BatchBuilder(job).split("train")
    results = view["results"].values()
    for epoch in range(job.training.epochs):
        assert sum(r["epochs"][epoch]["samples"] for r in results) == split.rows == 2000
        assert sum(r["epochs"][epoch]["label_sum"] for r in results) == pytest.approx(float(np.nansum(split.labels)))
    assert report["samples_trained"] == 2000 * job.training.epochs
    # Progressive validation scored each task on every sample labelled for it, once an epoch.
    progressive = report["progressive"]["tasks"]
    assert list(progressive) == TASKS
    for k, task in enumerate(TASKS):
        labelled = int((~np.isnan(split.labels[:, k])).sum())
        assert progressive[task]["scored"] == labelled * job.training.epochs, task
    assert labelled < 2000 and progressive["watch_time"]["mse"] > 0 and progressive["conversion"]["auc"] is not None
    assert report["progressive"]["auc"] == progressive["click"]["auc"]

    final = newest_version(training_stack, job)
    expected = stack_evaluation(training_stack, job, final)
    assert expected.shape == (400, 3)
    # The evaluation scores a regression on its transformed scale (log seconds); serving answers in seconds.
    expected = expected.astype(np.float64)
    expected[:, 1] = np.exp(expected[:, 1])
    instances = [
        {k: v for k, v in row.items() if k not in ("click", "watch_seconds", "conversion")}
        for row in csv.DictReader((DATA / "tiny_multitask/test.csv").open())
    ]
    replica = Replica(training_stack)
    replica.wait_for(job.name, final.version)
    answers = []
    for start in range(0, len(instances), 100):
        r = replica.http.post(f"/v1/models/{job.name}:predict", json={"instances": instances[start : start + 100]})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["tasks"] == TASKS and body["version"] == final.version
        answers += body["predictions"]
    assert all(list(a) == TASKS for a in answers)
    got = np.array([[a[t] for t in TASKS] for a in answers])
    skew = np.abs(got - expected) / np.maximum(
        1.0, np.abs(expected)
    )  # relative for seconds, absolute for probabilities
    print(
        f"\nmulti-task: serving vs the job's evaluation, max skew per task {dict(zip(TASKS, skew.max(axis=0), strict=True))}"
    )
    assert skew.max() <= SKEW
    assert got[:, 1].min() > 0 and not math.isclose(got[:, 1].std(), 0.0)  # seconds, and they vary

    address = next(p["grpc_address"] for p in stack.read_state(training_stack)["processes"] if p["role"] == "serving")
    credentials = GrpcCredentials(token=stack.read_token(training_stack))
    grpc = asyncio.run(grpc_predictions(address, credentials, job.name, instances[:40]))
    assert grpc.tasks == TASKS and grpc.version == final.version
    flat = np.asarray(grpc.predictions, np.float64).reshape(40, 3)  # each instance's tasks in turn
    assert np.abs(flat - got[:40]).max() <= 1e-6 * np.abs(got[:40]).max()  # float32 on the wire

    single = replica.http.post(f"/v1/models/{job.name}:predict", json={"instances": [{"user": 1}]})
    assert single.status_code == 200 and list(single.json()["predictions"][0]) == TASKS


def test_a_stream_of_events_carrying_every_tasks_label_trains_each_task(training_stack, infra) -> None:
    """A continuous multi-task job reading events that carry their labels (data.topics): every
    event is trained once, progressive validation scores each task on exactly the events labelled
    for it (a null is no label, a mask off no label), and an event with no label for any task is a
    dead letter naming why."""
    rows = list(csv.DictReader((DATA / "tiny_multitask/train.csv").open()))[:600]
    now = time.time()
    events = []
    for i, row in enumerate(rows):
        event = {"id": str(i), "ts": now - 600 + i * 0.5, "user": row["user"], "item": row["item"]}
        event |= {
            "history": row["history"].split("|"),
            "hour": row["hour"],
            "item_age_days": float(row["item_age_days"]),
        }
        event |= {"click": int(row["click"]), "watch_seconds": float(row["watch_seconds"]) if i % 5 else None}
        events.append(event | {"conversion": int(row["conversion"])})
    events.append(events[0] | {"id": "none", "click": None, "watch_seconds": None, "conversion": None})
    topic = f"feed-{uuid.uuid4().hex[:8]}"
    asyncio.run(kafka.ensure_topics(infra.kafka, {topic: 1}))
    asyncio.run(_produce(infra.kafka, topic, [json.dumps(e).encode() for e in events]))
    raw = load_job(DATA / "tiny_multitask_job.yaml").model_dump(mode="json", exclude_none=True)
    raw["name"] = f"stream-{topic}"
    raw["data"] = {"source": "kafka", "topics": [topic], "key": "id", "event_time": "ts", "batch_timeout_seconds": 0.2}
    raw["dense"] = [{"column": "item_age_days", "normalization": "log1p"}]  # no statistics pass on a stream
    raw["training"] |= {"epochs": None, "staleness_bound": 2}
    raw["topology"] |= {"data_loaders": 1}
    job = JobConfig.model_validate(raw)
    client = CoordinatorClient.for_stack(training_stack)
    try:
        job_id = client.submit(job)["id"]
        wait_until(lambda: client.job(job_id)["progress"]["samples"] == 600, "every labelled event trained", 120)
        # A rank reports its scores once a second; stopped, it reports its last ones at once.
        client.stop(job_id, checkpoint=False)
        view = wait_until(lambda: (v := client.job(job_id))["job"]["state"] == "stopped" and v, "the job to stop", 120)
    finally:
        client.close()
    assert view["progress"]["samples"] == 600 and view["progressive"]["scored"] == 600
    assert view["stream"]["dead_letters"] == {"bad_value": 1}
    tasks = view["progressive"]["tasks"]
    assert tasks["click"]["scored"] == 600
    assert tasks["watch_time"]["scored"] == sum(1 for e in events[:600] if e["watch_seconds"] is not None) == 480
    assert tasks["conversion"]["scored"] == sum(e["click"] for e in events[:600])  # masked to clicked events
    assert tasks["watch_time"]["mse"] > 0 and tasks["click"]["auc"] is not None


async def _produce(conn, topic: str, values: list[bytes]) -> None:
    producer = kafka.producer(conn)
    await producer.start()
    try:
        for value in values:
            await producer.send(topic, value, partition=0)
        await producer.flush()
    finally:
        await producer.stop()
