"""bench/nemesis.py's stream jobs (`--streams`): every third job of a run reads a stream with poison
records among its events, so that the faults meet a continuous job too, and the checker sees
every bad record dead-lettered while the job trains on.

Before it submits one, the driver writes a topic of its own: GOOD_EVENTS events (the synthetic
job's fields, each keyed and with its label) and, at places drawn from the run's seed,
tests/poison.py's records (deep nesting, huge and non-finite numbers, invalid UTF-8, msgpack,
binary). Once the ranks have trained every good event it stops the job (no final checkpoint).
Checked, for each: stopped as asked; by the ranks' count exactly the good events trained; each
good event's sample exactly once in the samples topic, read by the job's final lineage (nothing
lost, nothing twice, whatever the attempts wrote); every poison record in the dead-letter topic
at its source offset with its reason, and no good event there; the PS ledgers holding each step
once. No AUC: a stream's batches are cut by time.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from aiokafka.errors import KafkaError
from ledger import ledger_problems
from poison import POISON
from timeline import Timeline, cluster_job
from topic_records import read_all

import trillium_native
from trillium import stack
from trillium.config import KafkaConnection
from trillium.job import JobConfig
from trillium.job.record import PartitionLineage
from trillium.stack import stack_tls_of
from trillium.stack.broker import kafka_connection
from trillium.stack.client import TERMINAL, ApiError, CoordinatorClient, CoordinatorUnavailable
from trillium.wire import codec, kafka

GOOD_EVENTS = 3000
STREAM_EVERY = 3  # job numbers 2, 5, 8, ...: a stream job
SAMPLE_NAMESPACE = "trillium.sample"  # services/data_loader/stream.py: a sample id is the key's hash here


def operator_kafka(run_dir: Path) -> KafkaConnection:
    """The stack's broker as this machine's operator reaches it (TLS and password where it has them)."""
    st = stack.read_state(run_dir)
    return kafka_connection(st["kafka"]["bootstrap"], st["kafka"]["external"], stack_tls_of(st))


def stream_job(number: int, topic: str) -> JobConfig:
    """The synthetic job's fields and model, continuous, read from `topic`: its records stay (no
    trim), for the checker to read every sample the attempts wrote."""
    raw = cluster_job(1, name=f"nemesis-{number}").model_dump(mode="json")
    raw["data"] = {
        "source": "kafka",
        "format": "json",
        "topics": [topic],
        "key": "request_id",
        "event_time": "ts",
        "batch_timeout_seconds": 0.5,
    }
    raw["training"]["epochs"] = None
    raw["checkpoint"] |= {"every_steps": 10, "max_recoveries": 10_000, "trim_topics": False}
    raw["topology"] |= {"data_loaders": 1}
    return JobConfig.model_validate(raw)


@dataclass
class StreamInput:
    """What a stream job reads: its records in order, the good events' keys, where the poison is."""

    topic: str
    records: list[bytes]
    keys: list[str]
    poison_offsets: list[int]

    @classmethod
    def drawn(cls, seed: int, number: int) -> StreamInput:
        rng = random.Random(seed * 100_003 + number)
        start = time.time() - 100  # in the past: no event from the loader's future
        good, keys = [], []
        for i in range(GOOD_EVENTS):
            key = f"nemesis-{number}-{i}"
            event = {"request_id": key, "ts": start + i * 0.01, "label": str(rng.randrange(2))}
            event |= {f"C{c}": f"v{rng.randrange(50)}" for c in range(1, 27)}
            event |= {f"I{d}": float(rng.randrange(100)) for d in range(1, 14)}
            good.append(json.dumps(event).encode())
            keys.append(key)
        places = set(rng.sample(range(GOOD_EVENTS + len(POISON)), len(POISON)))
        records, poison, events = [], iter(POISON), iter(good)
        for offset in range(GOOD_EVENTS + len(POISON)):
            records.append(next(poison)[0] if offset in places else next(events))
        return cls(f"nemesis-input-{number}-{uuid.uuid4().hex[:6]}", records, keys, sorted(places))

    async def write(self, conn: KafkaConnection) -> None:
        """The topic (one partition: offsets in the order written), every record in it."""
        await kafka.ensure_topics(conn, {self.topic: 1})
        producer = kafka.producer(conn)
        await producer.start()
        try:
            for record in self.records:
                await producer.send(self.topic, record, partition=0)
            await producer.flush()
        finally:
            await producer.stop()


@dataclass
class StreamRun:
    job: JobConfig
    job_id: str
    stream: StreamInput
    view: dict[str, Any] = field(default_factory=dict)


def _until_done(what, timeout_s: float):
    """`what()` until it neither raises CoordinatorUnavailable nor a broker error, within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return what()
        except (CoordinatorUnavailable, OSError, KafkaError):
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)


def run_stream(run_dir: Path, submit, number: int, seed: int, timeout_s: float) -> tuple[StreamRun, Timeline]:
    """Write a stream job's input, submit it (`submit`: the driver's, once), stop it once every good
    event is trained; its final view in the StreamRun."""
    stream = StreamInput.drawn(seed, number)
    conn = operator_kafka(run_dir)
    _until_done(lambda: asyncio.run(stream.write(conn)), timeout_s)
    job = stream_job(number, stream.topic)
    job_id = submit(job)
    timeline = Timeline(run_dir, job_id)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        view = timeline.last_view
        if view is not None and (view["progress"]["samples"] >= GOOD_EVENTS or view["job"]["state"] in TERMINAL):
            break
        time.sleep(0.5)
    client = CoordinatorClient.for_stack(run_dir)
    client.http.timeout = 5.0
    try:
        _until_done(lambda: client.stop(job_id, checkpoint=False), timeout_s)
    except ApiError:
        pass  # it ended meanwhile: the check says how
    finally:
        client.close()
    return StreamRun(job, job_id, stream, timeline.wait(timeout_s)), timeline


async def _samples(conn: KafkaConnection, view: dict[str, Any]) -> np.ndarray:
    """The sample ids of every batch the job's final lineage counts, in the samples topic."""
    job = view["job"]
    topic = job["topics"]["samples"]
    lineage = job["lineage"].get(topic, {})
    ids = []
    for record in await read_all(conn, topic, job["config"]["topology"]["nn_ranks"]):
        segments = lineage.get(str(record.partition)) or lineage.get(record.partition)
        if PartitionLineage(segments).counts(record.offset, kafka.attempt_of(record.headers)):
            ids.append(codec.decode_batch(record.value).sample_ids)
    return np.sort(np.concatenate(ids)) if ids else np.array([], dtype=np.uint64)


async def _dead_letters(conn: KafkaConnection, view: dict[str, Any]) -> dict[int, Any]:
    """The dead-letter topic's records by the source offset each came from."""
    letters = await read_all(conn, view["job"]["topics"]["dlq"], 1)
    return {int(dict(r.headers)["trillium-source-offset"]): r for r in letters}


def check_stream(conn: KafkaConnection, run: StreamRun) -> tuple[dict[str, Any], list[str]]:
    """The stream job's entry in the report, and what breaks the module docstring's checks."""
    view, stream = run.view, run.stream
    record = view["job"]
    entry: dict[str, Any] = {"id": run.job_id, "state": record["state"], "recoveries": len(record["recoveries"])}
    entry["stream"] = {"samples": view["progress"]["samples"], "poison": len(stream.poison_offsets)}
    problems = []
    if record["state"] != "stopped":
        problems.append(f"{run.job_id}: {record['state']} (a stream job the driver stopped): {record['error']}")
    if view["progress"]["samples"] != GOOD_EVENTS:
        problems.append(f"{run.job_id}: the ranks trained {view['progress']['samples']} samples of {GOOD_EVENTS}")
    emitted = asyncio.run(_samples(conn, view))
    expected = np.sort(trillium_native.hash_ids(SAMPLE_NAMESPACE, stream.keys))
    if not np.array_equal(emitted, expected):
        distinct = np.unique(emitted)
        missing = np.setdiff1d(expected, distinct).size
        problems.append(
            f"{run.job_id}: {emitted.size} samples by the lineage ({emitted.size - distinct.size} twice), "
            f"{missing} of the {GOOD_EVENTS} good events missing"
        )
    letters = asyncio.run(_dead_letters(conn, view))
    for offset, (raw, reason) in zip(stream.poison_offsets, POISON, strict=True):
        letter = letters.get(offset)
        said = dict(letter.headers).get("trillium-dlq-reason", b"").decode() if letter is not None else ""
        if letter is None or letter.value != raw or not said.startswith(reason):
            problems.append(f"{run.job_id}: poison at offset {offset} not dead-lettered as {reason!r} ({said!r})")
    good = sorted(set(letters) - set(stream.poison_offsets))
    if good:
        problems.append(f"{run.job_id}: good events dead-lettered, at offsets {good[:10]}")
    problems += [
        f"{run.job_id}: {p}" for p in ledger_problems(view, view["progress"]["steps"], run.job.topology.nn_ranks)
    ]
    entry["exactly_once"] = not problems
    return entry, problems
