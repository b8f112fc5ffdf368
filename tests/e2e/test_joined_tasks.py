"""A multi-task job joined online from a label topic per task, through the broker: clicks within
30 s and conversions within 5 min of their impressions, with a stop (its checkpoint holding the
joiner's tracked impressions) and a resume mid-stream. The ledger, read back from the samples
topic, is exact per task against what the events say: every impression one sample, leaving when
its click window closes with the labels known then; every conversion one in-window label or one
correction of its task alone; late, duplicate and unmatched labels counted, never trained."""

from __future__ import annotations

import asyncio
import csv
import json
import math
import time
import uuid

import numpy as np
import pytest
from pipeline_helpers import DATA
from topic_records import read_all
from waiting import wait_until

import trillium_native
from trillium.data import load_job
from trillium.job import JobConfig
from trillium.job.record import PartitionLineage
from trillium.stack.client import CoordinatorClient
from trillium.wire import codec, kafka

CLICK_WINDOW, CONVERSION_WINDOW = 30.0, 300.0
PARTITIONS = 2


def _job(run: str) -> JobConfig:
    raw = load_job(DATA / "tiny_multitask_job.yaml").model_dump(mode="json", exclude_none=True)
    raw["name"] = f"joined-{run}"
    raw["labels"] = [{"name": "click", "column": "click"}, {"name": "conversion", "column": "conversion"}]
    raw["model"]["kwargs"]["tasks"] = ["click", "conversion"]
    raw["dense"] = [{"column": "item_age_days", "normalization": "log1p"}]  # no statistics pass on a stream
    raw["data"] = {
        "source": "kafka",
        "join": {
            "impressions": f"imps-{run}",
            "key": "id",
            "labels": [
                {"topic": f"clicks-{run}", "task": "click", "window_seconds": CLICK_WINDOW},
                {"topic": f"conversions-{run}", "task": "conversion", "window_seconds": CONVERSION_WINDOW},
            ],
        },
        "event_time": "ts",
        "batch_timeout_seconds": 0.2,
    }
    raw["training"] |= {"epochs": None, "staleness_bound": 2}
    raw["topology"] |= {"data_loaders": 1}
    raw["checkpoint"] = {"trim_topics": False}  # the ledger reads the whole samples topic
    return JobConfig.model_validate(raw)


def _events(run: str, t0: float) -> tuple[list[tuple[str, int, float, bytes]], dict]:
    """(topic, partition, event time, message) of 400 impressions 1.5 s apart, their planted
    clicks 0-40 s later (after 30 s: late) and conversions 5-299 s later, a duplicate click, a
    conversion of no impression, and a last impression per partition well after every window
    (its event time moves the watermark past them); with each impression's (time, click,
    conversion) times.

    (A label after the longest window finds its impression forgotten or not, as the watermark
    has moved when it is read: counted late or unmatched. None comes so late here.)"""
    rng = np.random.default_rng(11)
    rows = list(csv.DictReader((DATA / "tiny_multitask/train.csv").open()))[:400]
    out, truth = [], {}
    for i, row in enumerate(rows):
        key, at, p = f"{run}-{i}", t0 + 1.5 * i, i % PARTITIONS
        impression = {"id": key, "ts": at, "user": row["user"], "item": row["item"], "hour": row["hour"]}
        impression |= {"history": row["history"].split("|"), "item_age_days": float(row["item_age_days"])}
        out.append((f"imps-{run}", p, at, json.dumps(impression).encode()))
        click = at + rng.uniform(0, 40) if row["click"] == "1" else None
        conversion = at + rng.uniform(5, 299) if row["conversion"] == "1" else None
        for topic, when in ((f"clicks-{run}", click), (f"conversions-{run}", conversion)):
            if when is not None:
                out.append((topic, p, when, json.dumps({"id": key, "ts": when}).encode()))
        truth[key] = (at, click, conversion)
    # A second click of an impression clicked in its window: a duplicate.
    i, (_, click, _) = next((i, t) for i, t in enumerate(truth.values()) if t[1] is not None and t[1] + 1 <= t[0] + 30)
    again = {"id": f"{run}-{i}", "ts": click + 1}
    out.append((f"clicks-{run}", i % PARTITIONS, click + 1, json.dumps(again).encode()))
    out.append((f"conversions-{run}", 1, t0 + 50, json.dumps({"id": "nowhere", "ts": t0 + 50}).encode()))
    end = t0 + 1.5 * len(rows) + 2 * CONVERSION_WINDOW
    for p in range(PARTITIONS):
        out.append((f"imps-{run}", p, end, json.dumps(impression | {"id": f"end-{p}", "ts": end}).encode()))
    return out, truth


def test_clicks_and_conversions_on_their_own_topics_join_each_in_its_window(training_stack, infra) -> None:
    run = uuid.uuid4().hex[:8]
    job = _job(run)
    t0 = time.time() - 3600
    events, truth = _events(run, t0)
    topics = job.data.input_topics
    asyncio.run(kafka.ensure_topics(infra.kafka, {t: PARTITIONS for t in topics}))
    events.sort(key=lambda e: e[2])  # each partition in event-time order
    half = [e for e in events if e[2] < t0 + 300]
    # The stop's checkpoint holds impressions whose conversions are still to come.
    assert any(at < t0 + 300 <= conv for at, _, conv in truth.values() if conv is not None)
    client = CoordinatorClient.for_stack(training_stack)
    try:
        job_id = client.submit(job)["id"]
        asyncio.run(_produce(infra.kafka, half))
        wait_until(
            lambda: (
                (v := client.job(job_id))["stream"]
                and v["stream"]["events"].get("messages", 0) == len(half)
                and v["progress"]["steps"] > 0  # a stop takes its checkpoint once a step is trained
            ),
            "the first half of the stream read, and a step trained",
        )
        client.stop(job_id)  # a checkpoint with conversions' windows open
        wait_until(lambda: client.job(job_id)["job"]["state"] == "stopped", "the stop", 120)
        asyncio.run(_produce(infra.kafka, events[len(half) :]))
        client.resume(job_id)
        expected_rows = len(truth) + sum(
            1 for at, _, conv in truth.values() if conv is not None and conv > at + CLICK_WINDOW
        )
        view = wait_until(
            lambda: (
                (v := client.job(job_id))["stream"]
                and v["stream"]["events"].get("samples", 0) >= expected_rows
                and v["job"]["state"] == "running"
                and v
            ),
            "every impression's sample and every conversion's correction written",
            300,
        )
        client.stop(job_id, checkpoint=False)
        final = wait_until(lambda: (v := client.job(job_id))["job"]["state"] == "stopped" and v, "the stop", 120)
    finally:
        client.close()
    _the_samples_are_what_the_events_say(infra, job, final, truth)
    clicks = [click for _, click, _ in truth.values() if click is not None]
    tasks = view["stream"]["joined_tasks"]
    assert tasks["click"] == {
        "labels": len(clicks) + 1,
        "in_sample": sum(1 for at, click, _ in truth.values() if click is not None and click <= at + CLICK_WINDOW),
        "late_labels": sum(1 for at, click, _ in truth.values() if click is not None and click > at + CLICK_WINDOW),
        "duplicate_labels": 1,
    }, tasks
    assert tasks["conversion"] == {
        "labels": sum(1 for *_, conv in truth.values() if conv is not None) + 1,
        "in_sample": sum(1 for at, _, conv in truth.values() if conv is not None and conv <= at + CLICK_WINDOW),
        "corrections": expected_rows - len(truth),
        "unmatched_labels": 1,
    }, tasks
    assert tasks["conversion"]["in_sample"] > 0 and tasks["conversion"]["corrections"] > 0
    assert tasks["click"]["late_labels"] > 0
    assert view["stream"]["joined"]["impressions"] == len(truth) + PARTITIONS


def _the_samples_are_what_the_events_say(infra, job: JobConfig, final: dict, truth: dict) -> None:
    """Each impression's one sample (its labels known by the click window's end, leaving then),
    and each conversion after that end but in its window one correction (conversion 1, no click
    label, at the conversion's time): read from the samples topic as the job's lineage says."""
    topic = final["job"]["topics"]["samples"]
    lineage = final["job"]["lineage"].get(topic, {})
    rows: dict[int, list] = {}
    for record in asyncio.run(read_all(infra.kafka, topic, job.topology.nn_ranks)):
        segments = lineage.get(str(record.partition)) or lineage.get(record.partition)
        if not PartitionLineage(segments).counts(record.offset, kafka.attempt_of(record.headers)):
            continue
        batch = codec.decode_batch(record.value)
        for sample, labels, at in zip(
            batch.sample_ids.tolist(), batch.labels.tolist(), batch.event_times.tolist(), strict=True
        ):
            rows.setdefault(sample, []).append((tuple(labels), at))
    keys = list(truth)
    ids = trillium_native.hash_ids("trillium.sample", keys).tolist()
    for key, sample in zip(keys, ids, strict=True):
        at, click, conversion = truth[key]
        end = at + CLICK_WINDOW
        expected = [((float(_by(click, end)), float(_by(conversion, end))), end)]
        if conversion is not None and conversion > end:
            expected.append(((math.nan, 1.0), conversion))
        got = sorted(rows.pop(sample, []), key=lambda r: r[1])
        assert len(got) == len(expected), (key, got, expected)
        for (labels, when), (want, want_at) in zip(got, expected, strict=True):
            np.testing.assert_array_equal(labels, want, err_msg=key)
            assert when == pytest.approx(want_at, abs=1e-6), (key, when, want_at)
    ends = set(trillium_native.hash_ids("trillium.sample", [f"end-{p}" for p in range(PARTITIONS)]).tolist())
    assert set(rows) <= ends, "no sample of an impression the stream did not have"


def _by(label: float | None, end: float) -> bool:
    return label is not None and label <= end


async def _produce(conn, events: list[tuple[str, int, float, bytes]]) -> None:
    producer = kafka.producer(conn)
    await producer.start()
    try:
        for topic, partition, _, value in events:
            await producer.send(topic, value, partition=partition)
        await producer.flush()
    finally:
        await producer.stop()
