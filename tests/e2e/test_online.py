"""Online training from Kafka event streams on a real stack and broker: the joiner's outcome on a
hand-made sequence, dead letters, a replayed planted-model stream trained to its Bayes AUC, and a
data loader killed mid-stream leaving no impression lost or counted twice."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from online_jobs import FIELDS, online_job, produce
from topic_records import read_all
from typer.testing import CliRunner
from waiting import wait_until

import trillium_native
from trillium import stack
from trillium.cli import app
from trillium.config import KafkaConnection
from trillium.data.replay import replay
from trillium.data.sources.datagen import generate_criteo
from trillium.job import JobConfig
from trillium.job.record import PartitionLineage
from trillium.runtime.checkpoint import DENSE
from trillium.stack.client import CoordinatorClient
from trillium.wire import codec, kafka


def _state(client: CoordinatorClient, job_id: str) -> str:
    job = client.job(job_id)["job"]
    assert job["state"] != "failed", job["error"]
    return job["state"]


def _replaying(path: Path, job: JobConfig, conn: KafkaConnection, *, rate: float, seed: int) -> threading.Thread:
    """`trillium replay` of a file in the background, paced like a live stream."""
    thread = threading.Thread(
        target=lambda: asyncio.run(replay(path, job, conn, fmt="criteo", rate=rate, seed=seed)), daemon=True
    )
    thread.start()
    return thread


def test_the_joiner_outcome_and_dead_letters_through_the_broker(training_stack, infra) -> None:
    """A hand-made sequence with out-of-order event times: every impression is emitted once,
    positive or negative, exactly as the attribution window says; garbage goes to the DLQ with
    its reason and where it came from."""
    run = uuid.uuid4().hex[:8]
    imps, clicks = f"imps-{run}", f"clicks-{run}"
    conn = infra.kafka
    asyncio.run(kafka.ensure_topics(conn, {imps: 2, clicks: 2}))

    def imp(key: str, ts: float) -> bytes:
        return json.dumps({"request_id": key, "ts": ts} | FIELDS).encode()

    def click(key: str, ts: float) -> bytes:
        return json.dumps({"request_id": key, "ts": ts}).encode()

    t = time.time() - 100  # event time in the past; the stream's end closes every window
    sequence = [
        (imps, 0, imp("a", t + 10)),
        (imps, 0, imp("b", t + 5)),  # b's event time is before a's
        (clicks, 0, click("a", t + 11)),  # a: clicked in its window
        (imps, 1, imp("c", t + 12)),
        (clicks, 1, click("c", t + 15)),  # c: clicked 3 s later: late
        (clicks, 1, click("d", t + 13)),
        (imps, 1, imp("d", t + 12.5)),  # d's click came first: positive
        (clicks, 0, click("d-nowhere", t + 14)),  # no such impression: unmatched
        (imps, 0, b"{not json"),  # dead letters
        (imps, 1, json.dumps({"request_id": "e", "ts": t}).encode()),  # fields missing
        (imps, 0, json.dumps({"request_id": "f", "ts": t} | FIELDS | {"I3": "NaN"}).encode()),
        (imps, 0, imp("g", t + 20)),
        (imps, 1, imp("h", t + 20)),  # never clicked: negatives
        (clicks, 0, click("a", t + 11.5)),  # a's second click: a duplicate
    ]
    asyncio.run(produce(conn, sequence))
    job = online_job(f"join-{run}", imps, clicks, late_labels="count")
    client = CoordinatorClient.for_stack(training_stack)
    try:
        job_id = client.submit(job)["id"]
        view = wait_until(
            lambda: (
                (v := client.job(job_id))["stream"]
                and v["stream"]["joined"].get("negatives", 0) + v["stream"]["joined"].get("positives", 0) >= 6
                and v
            ),
            "every impression to close",
        )
        time.sleep(1.0)  # nothing more may come
        view = client.job(job_id)
        client.stop(job_id)
        wait_until(lambda: client.job(job_id)["job"]["state"] == "stopped", "the job to stop", 120)
    finally:
        client.close()
    assert view["stream"]["joined"] == {
        "impressions": 6,
        "labels": 5,
        "positives": 2,
        "negatives": 4,
        "late_labels": 1,
        "unmatched_labels": 1,
        "duplicate_labels": 1,
    }, view["stream"]["joined"]
    assert view["stream"]["dead_letters"] == {"undecodable": 1, "missing_field": 1, "bad_value": 1}
    letters = asyncio.run(read_all(conn, view["job"]["topics"]["dlq"], 1))
    headers = [{k: v.decode() for k, v in r.headers} for r in letters]
    assert sorted(
        (h["trillium-source-topic"], h["trillium-source-partition"], h["trillium-source-offset"]) for h in headers
    ) == [(imps, "0", "2"), (imps, "0", "3"), (imps, "1", "2")]
    reasons = {
        h["trillium-source-offset"] + "@" + h["trillium-source-partition"]: h["trillium-dlq-reason"] for h in headers
    }
    assert reasons["2@0"].startswith("not valid json") and reasons["2@1"] == "missing field 'C1'"
    assert "'I3' (dense): expected a finite number" in reasons["3@0"]
    assert [r.value for r in letters if r.value.startswith(b"{not")] == [b"{not json"]  # the raw bytes


def _one_partition_topics(conn: KafkaConnection) -> tuple[str, str, str]:
    """A run id and new impressions and clicks topics of one partition each (one joiner, in order)."""
    run = uuid.uuid4().hex[:8]
    imps, clicks = f"imps-{run}", f"clicks-{run}"
    asyncio.run(kafka.ensure_topics(conn, {imps: 1, clicks: 1}))
    return run, imps, clicks


@pytest.mark.parametrize("action", ["clamp", "dlq"])
def test_an_event_from_the_future_is_counted_and_clamped_or_sent_to_the_dlq(training_stack, infra, action) -> None:
    """A producer's clock an hour ahead: its impression is counted as from the future and, as the job
    says, taken at the loader's clock (joined like any other) or sent to the DLQ with the reason."""
    run, imps, clicks = _one_partition_topics(infra.kafka)
    conn = infra.kafka
    now = time.time()
    sequence = [
        (imps, 0, json.dumps({"request_id": "a", "ts": now - 30} | FIELDS).encode()),
        (imps, 0, json.dumps({"request_id": "future", "ts": now + 3600} | FIELDS).encode()),
        (clicks, 0, json.dumps({"request_id": "future", "ts": now + 3601}).encode()),
        (imps, 0, json.dumps({"request_id": "b", "ts": now - 29} | FIELDS).encode()),
    ]
    asyncio.run(produce(conn, sequence))
    job = online_job(f"clock-{run}", imps, clicks, late_labels="count")
    raw = job.model_dump(mode="json")
    raw["data"]["clock"] = {"max_future_seconds": 60, "action": action}
    job = JobConfig.model_validate(raw)
    client = CoordinatorClient.for_stack(training_stack)
    try:
        job_id = client.submit(job)["id"]
        closed = 3 if action == "clamp" else 2
        view = wait_until(
            lambda: (
                (v := client.job(job_id))["stream"]
                and sum(v["stream"]["joined"].get(k, 0) for k in ("positives", "negatives")) >= closed
                and v
            ),
            "the impressions to close",
        )
        client.stop(job_id)
        wait_until(lambda: client.job(job_id)["job"]["state"] == "stopped", "the job to stop", 120)
    finally:
        client.close()
    assert view["stream"]["events"]["clock_future"] == 2  # the impression and its click
    if action == "clamp":
        assert view["stream"]["joined"]["impressions"] == 3 and view["stream"]["joined"]["positives"] == 1
        assert not view["stream"]["dead_letters"]
        assert view["progressive"]["delay_seconds"] is None or view["progressive"]["delay_seconds"]["p50"] >= 0
    else:
        assert view["stream"]["joined"]["impressions"] == 2 and view["stream"]["dead_letters"] == {"clock": 2}
        letters = asyncio.run(read_all(conn, view["job"]["topics"]["dlq"], 1))
        reasons = [dict(r.headers)["trillium-dlq-reason"].decode() for r in letters]
        assert len(reasons) == 2 and all(r.startswith("event time") and "future" in r for r in reasons), reasons


def test_a_checkpoint_asked_for_while_the_stream_is_quiet_is_taken_within_seconds(training_stack, infra) -> None:
    """No event comes after the first few: the loader's ticks (empty steps, every batch timeout)
    carry the ranks' control words, so `checkpoints --take` is cut and written within 5 s; and
    the ticks change no weight."""
    run, imps, clicks = _one_partition_topics(infra.kafka)
    conn = infra.kafka
    now = time.time()
    asyncio.run(
        produce(
            conn,
            [(imps, 0, json.dumps({"request_id": str(i), "ts": now - 30 + i} | FIELDS).encode()) for i in range(3)],
        )
    )
    job = online_job(f"quiet-{run}", imps, clicks, late_labels="count")
    job = job.model_copy(update={"checkpoint": job.checkpoint.model_copy(update={"every_seconds": None})})
    client = CoordinatorClient.for_stack(training_stack)
    cli = CliRunner()
    try:
        job_id = client.submit(job)["id"]
        quiet = wait_until(
            lambda: (v := client.job(job_id))["progress"]["samples"] == 3 and v, "the three impressions trained"
        )
        assert quiet["last_checkpoint"] is None
        asked = time.monotonic()
        taken = cli.invoke(app, ["checkpoints", job_id, "--take", "--run-dir", str(training_stack)])
        assert taken.exit_code == 0, taken.output
        checkpoint = wait_until(lambda: client.job(job_id)["last_checkpoint"], "the checkpoint", timeout_s=5.0)
        took = time.monotonic() - asked
        wait_until(lambda: client.job(job_id)["progress"]["steps"] > checkpoint["step"] + 2, "ticks after it")
        client.request_checkpoint(job_id)
        later = wait_until(
            lambda: (c := client.job(job_id)["last_checkpoint"]) and c["step"] > checkpoint["step"] and c,
            "a checkpoint after a few ticks",
            timeout_s=5.0,
        )
        client.stop(job_id, checkpoint=False)
        final = wait_until(lambda: (v := client.job(job_id))["job"]["state"] == "stopped" and v, "the job to stop", 120)
    finally:
        client.close()
    assert checkpoint["reason"] == "request" and took <= 5.0
    assert final["progress"]["samples"] == 3
    # The ticks between the two checkpoints trained nothing: the dense model and its optimizer
    # (Adam: a step on zero gradients would still move the weights) are as they were.
    dense = [torch.load(Path(c["location"]) / DENSE, weights_only=True) for c in (checkpoint, later)]
    for name, weights in dense[0]["model"].items():
        torch.testing.assert_close(dense[1]["model"][name], weights, rtol=0, atol=0, msg=name)
    assert dense[0]["optimizer"]["state"].keys() == dense[1]["optimizer"]["state"].keys()
    for key, before in dense[0]["optimizer"]["state"].items():
        for field, value in before.items():
            torch.testing.assert_close(dense[1]["optimizer"]["state"][key][field], value, rtol=0, atol=0)


def test_a_continuous_job_reaches_the_planted_models_auc(training_stack, infra, tmp_path) -> None:
    """A replayed planted-model stream, trained as it comes: the rolling progressive AUC (each
    sample scored before it is trained on) gets within 0.01 of the planted model's own AUC."""
    run = uuid.uuid4().hex[:8]
    data = generate_criteo(
        tmp_path / "stream.tsv", 400_000, seed=3, vocab_sizes=[5] * 26, missing_count_is_zero=True
    )  # its AUC: a ceiling the job's model can reach
    job = online_job(
        f"planted-{run}",
        f"imps-{run}",
        f"clicks-{run}",
        progressive_samples=100_000,
        staleness_bound=1,
        dense_optimizer={"name": "adagrad", "lr": 0.05},
    )
    # The dense layers on Adagrad: its steps shrink as it learns, so the rolling AUC is flat from
    # ~150k samples and the window scored at 300k holds a settled model (under Adam at 0.003 it
    # was still climbing there, by 0.005-0.02 from run to run).
    raw = job.model_dump(mode="json")
    raw["dense"] = [d | {"normalization": "log1p"} for d in raw["dense"]]
    raw["model"]["kwargs"]["hidden"] = []
    job = JobConfig.model_validate(raw)
    job = job.model_copy(update={"checkpoint": None})  # not what this test is about
    client = CoordinatorClient.for_stack(training_stack)
    feed = _replaying(tmp_path / "stream.tsv", job, infra.kafka, rate=6000, seed=3)
    try:
        job_id = client.submit(job)["id"]
        view = wait_until(
            lambda: (v := client.job(job_id))["progressive"]["scored"] >= 300_000 and v, "300k samples scored", 900
        )
        client.stop(job_id)
        wait_until(lambda: client.job(job_id)["job"]["state"] == "stopped", "the job to stop", 120)
    finally:
        client.close()
        feed.join()
    # replay sends no late clicks: a late label would be the loader's watermark passing an
    # unread click (or replay sending one after a later impression).
    assert view["stream"]["joined"].get("late_labels", 0) == 0, view["stream"]
    auc = view["progressive"]["auc"]
    assert abs(auc - data.auc) <= 0.01, (auc, data.auc, view["stream"])
    assert view["progressive"]["samples"] == 100_000
    assert view["progressive"]["delay_seconds"]["p50"] > 0


def test_a_data_loader_killed_mid_stream_loses_and_repeats_no_impression(training_stack, infra, tmp_path) -> None:
    """The loader's offsets, joiner state and pending samples are in the checkpoint: after its
    SIGKILL and the job's recovery, and after a stop (with its final checkpoint) and a resume
    mid-stream, the samples the job wrote (read as its lineage says) are every impression of the
    input exactly once, and the resume retrained no step."""
    run = uuid.uuid4().hex[:8]
    rows = 60_000
    generate_criteo(tmp_path / "stream.tsv", rows, seed=5, vocab_sizes=[5] * 26)
    job = online_job(f"ledger-{run}", f"imps-{run}", f"clicks-{run}")
    # The ledger reads the whole samples topic: it is kept, not trimmed behind the checkpoints.
    settings = {"every_seconds": None, "every_steps": 20, "trim_topics": False}
    job = job.model_copy(update={"checkpoint": job.checkpoint.model_copy(update=settings)})
    asyncio.run(kafka.ensure_topics(infra.kafka, {f"imps-{run}": 4, f"clicks-{run}": 4}))  # as replay makes them
    client = CoordinatorClient.for_stack(training_stack)
    try:
        job_id = client.submit(job)["id"]
        wait_until(lambda: _state(client, job_id) == "running", "the job to run")
        feed = _replaying(tmp_path / "stream.tsv", job, infra.kafka, rate=6000, seed=5)
        wait_until(lambda: client.job(job_id)["last_checkpoint"] is not None, "a checkpoint")
        loader = next(p for p in stack.read_state(training_stack)["processes"] if p["name"] == "data_loader-0")
        os.kill(loader["pid"], signal.SIGKILL)
        wait_until(
            lambda: (v := client.job(job_id))["job"]["recoveries"] and v["job"]["state"] == "running", "recovery"
        )
        client.stop(job_id)  # with a final checkpoint, the joiner's open impressions in it
        stopped = wait_until(lambda: (v := client.job(job_id))["job"]["state"] == "stopped" and v, "the stop", 120)
        assert stopped["last_checkpoint"]["step"] == stopped["progress"]["steps"] - 1
        client.resume(job_id)
        feed.join()
        wait_until(
            lambda: (
                (v := client.job(job_id))["stream"]
                and v["stream"]["events"].get("samples", 0) >= rows
                and v["job"]["state"] == "running"
            ),
            "every impression written as a sample",
            600,
        )
        client.stop(job_id)
        final = wait_until(lambda: (v := client.job(job_id))["job"]["state"] == "stopped" and v, "the stop", 120)
    finally:
        client.close()
    killed, resumed = final["job"]["recoveries"]
    assert "data_loader-0" in killed["cause"]
    assert (resumed["kind"], resumed["checkpoint_step"]) == ("resume", stopped["progress"]["steps"] - 1)
    topic = final["job"]["topics"]["samples"]
    lineage = final["job"]["lineage"].get(topic, {})
    ranks = job.topology.nn_ranks
    batches = []
    for record in asyncio.run(read_all(infra.kafka, topic, ranks)):
        segments = lineage.get(str(record.partition)) or lineage.get(record.partition)
        if PartitionLineage(segments).counts(record.offset, kafka.attempt_of(record.headers)):
            batches.append(codec.decode_batch(record.value))
    emitted = np.sort(np.concatenate([b.sample_ids for b in batches]))
    expected = np.sort(trillium_native.hash_ids("trillium.sample", [f"r5-{i}" for i in range(rows)]))
    np.testing.assert_array_equal(emitted, expected)  # each impression exactly once
    _every_impression_before_a_stamp_came_by_its_step(infra.kafka, job, batches)


def _every_impression_before_a_stamp_came_by_its_step(conn: KafkaConnection, job: JobConfig, batches: list) -> None:
    """Each step's low watermark (`complete_through`) against the impressions topic: every
    impression of an earlier event time is in that step or one before it, and by the stream's
    end the stamps cover every impression."""
    impressions = [json.loads(r.value) for r in asyncio.run(read_all(conn, job.data.join.impressions, 4))]
    keys = [event[job.data.event_key] for event in impressions]
    times = np.array([event[job.data.event_time] for event in impressions])
    ranks = job.topology.nn_ranks
    first_step = {}  # sample id -> the first step that holds it (corrections come again later)
    stamps = {}
    for batch in batches:
        step = batch.batch_id // ranks
        for sample in batch.sample_ids.tolist():
            first_step[sample] = min(first_step.get(sample, step), step)
        if batch.complete_through is not None:
            stamps[step] = batch.complete_through
    steps = np.array(sorted(stamps))
    covered = np.maximum.accumulate([stamps[s] for s in steps])  # what a step and those before it claim
    # The first step whose stamp (or an earlier one's) passes each impression's time: it must hold it by then.
    due = np.searchsorted(covered, times, side="right")
    assert (due < len(steps)).all(), "the stamps never covered the stream's last impressions"
    held = np.array([first_step[s] for s in trillium_native.hash_ids("trillium.sample", keys).tolist()])
    late = np.flatnonzero(held > steps[due])
    assert not len(late), [(keys[i], times[i], int(held[i]), int(steps[due[i]])) for i in late[:5]]
