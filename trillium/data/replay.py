"""`trillium replay`: a data set as a live stream of timestamped events on a job's topics.

Each row becomes an impression event — the row's mapped fields (nested by their dotted paths),
a key and an event time — sent at `rate` impressions a second. Row i's event time is its place in
the schedule (the start plus i / rate), not when it happened to be sent: a sender that runs late
for a moment and catches up would otherwise stamp bursts, and the joiner, deciding negatives when
windows close, would hand the model stretches of skewed label mix a window later. A row whose
label is positive also becomes a label event (a click) with the same key and an event time a
random 0..W seconds after its impression (W: the job's attribution window), or, for a
`late_fraction` of them, after the window; it is sent before the first impression of a later event
time, so each partition's events are in event-time order however far the sender lags (with rate 0,
as fast as it goes: stamped and sent by the clock). A `malformed_fraction` of the messages are replaced by
garbage (not JSON, a field missing, a NaN value), which the job sends to its dead-letter topic.
For a job whose events carry their label (`topics`), each row is one event with its label field.
Messages are keyed by the event key, so Kafka's partitioner co-partitions impressions and clicks;
topics that do not exist yet are created with `partitions` partitions each.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import json
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from trillium.config import KafkaConnection
from trillium.data.sources import open_source
from trillium.data.sources.cells import as_text
from trillium.job import AdultData, CriteoData, JobConfig, KafkaData
from trillium.job.data import PRESET_COLUMNS
from trillium.wire import kafka

# The label column and its positive value of the formats replay reads.
LABELS = {"criteo": ("label", "1"), "adult": ("income_bracket", ">50K")}


@dataclass
class ReplayReport:
    impressions: int = 0
    clicks: int = 0
    late_clicks: int = 0
    malformed: int = 0
    seconds: float = 0.0

    @property
    def events_per_sec(self) -> float:
        return (self.impressions + self.clicks) / self.seconds if self.seconds else 0.0


def _nest(event: dict[str, Any], path: str, value: Any) -> None:
    *parents, leaf = path.split(".")
    node = event
    for p in parents:
        node = node.setdefault(p, {})
    node[leaf] = value


def rows_of(file: Path, fmt: str, columns: list[str]) -> Iterator[dict[str, str | None]]:
    """The rows of a data set file (a preset's format), the given columns as text."""
    config = (CriteoData if fmt == "criteo" else AdultData)(source=fmt, train=file)
    for task in open_source(config).blocks("train", columns):
        block = task()
        table = {c: as_text(block.table.column(c)).to_pylist() for c in columns}
        for i in range(block.rows):
            yield {c: table[c][i] for c in columns}


def _value(path: str, text: str | None, dense: set[str]) -> Any:
    if text is None or text == "":
        return None
    if path in dense:
        return float(text)
    return text


def _malformed(kind: int, event: dict[str, Any], job: JobConfig) -> bytes:
    if kind == 0:
        return b"{not json"
    if kind == 1 and job.dense:
        broken = json.loads(json.dumps(event))
        _nest(broken, job.dense[0].column, math.nan)
        return json.dumps(broken).encode()  # NaN: refused as an absurd value
    broken = dict(event)
    broken.pop(next(iter(broken)))
    return json.dumps(broken).encode()  # a mapped field missing


async def replay(
    file: Path,
    job: JobConfig,
    conn: KafkaConnection,
    *,
    fmt: str,
    rate: float,
    limit: int | None = None,
    late_fraction: float = 0.0,
    malformed_fraction: float = 0.0,
    seed: int = 0,
    partitions: int = 4,
) -> ReplayReport:
    data = job.data
    if not isinstance(data, KafkaData):
        raise ValueError(f"the job's data.source is {data.source!r}: replay feeds a kafka source")
    if fmt not in LABELS:
        raise ValueError(f"--format must be one of {sorted(LABELS)}, got {fmt!r}")
    label_column, positive = LABELS[fmt]
    known = PRESET_COLUMNS[fmt]
    paths = [s.column for s in job.slots] + [d.column for d in job.dense]
    missing = [p for p in paths if p.split(".")[-1] not in known]
    if missing:
        raise ValueError(
            f"the job maps fields {missing}; a {fmt} row has {', '.join(known)} (replay names each "
            "event field by its column, at any depth: C1, user.C1)"
        )
    dense = {d.column for d in job.dense}
    key_path, time_path = data.event_key or "id", data.event_time
    window = data.join.window_seconds if data.join is not None else 0.0
    encode = json.dumps if data.format == "json" else None
    rng = np.random.default_rng(seed)
    report = ReplayReport()
    topics = [data.join.impressions, data.join.labels] if data.join is not None else list(data.topics or [])
    await kafka.ensure_topics(conn, {t: partitions for t in topics})  # co-partitioned: the same count
    producer = kafka.producer(conn)
    await producer.start()
    clicks: list[tuple[float, int, bytes, bytes]] = []  # heap of (event time, seq, key, message)
    seq = itertools.count()
    started, wall = time.monotonic(), time.time()

    def pack(event: dict[str, Any]) -> bytes:
        return encode(event).encode() if encode is not None else msgpack.packb(event)

    async def send(topic: str, key: bytes, value: bytes) -> None:
        await producer.send(topic, value, key=key)

    async def send_due(until: float) -> None:
        """Send the clicks of event time up to `until`."""
        while clicks and clicks[0][0] <= until:
            _, _, key, value = heapq.heappop(clicks)
            await send(data.join.labels, key, value)

    try:
        columns = list(dict.fromkeys([p.split(".")[-1] for p in paths] + [label_column]))
        for i, row in enumerate(rows_of(file, fmt, columns)):
            if limit is not None and i >= limit:
                break
            if rate > 0:  # pace: row i goes out at started + i / rate
                if (wait := started + i / rate - time.monotonic()) > 0:
                    await asyncio.sleep(wait)
            now = wall + i / rate if rate > 0 else time.time()
            await send_due(now)
            key = f"r{seed}-{i}"
            event: dict[str, Any] = {}
            _nest(event, key_path, key)
            _nest(event, time_path, now)
            for path in paths:
                _nest(event, path, _value(path, row[path.split(".")[-1]], dense))
            clicked = row[label_column] == positive
            if data.join is None:
                _nest(event, job.label.column, row[label_column])
            value = pack(event)
            if malformed_fraction and rng.random() < malformed_fraction:
                value = _malformed(int(rng.integers(3)), event, job)
                report.malformed += 1
            topic = data.join.impressions if data.join is not None else data.topics[0]
            await send(topic, key.encode(), value)
            report.impressions += 1
            if data.join is not None and clicked:
                late = late_fraction and rng.random() < late_fraction
                delay = window * (1 + rng.random() * 0.5) + 1e-3 if late else window * rng.random()
                click: dict[str, Any] = {}
                _nest(click, key_path, key)
                _nest(click, time_path, now + delay)
                heapq.heappush(clicks, (now + delay, next(seq), key.encode(), pack(click)))
                report.clicks += 1
                report.late_clicks += bool(late)
        while clicks:  # the clicks still to come, when their time comes
            await asyncio.sleep(max(0.0, clicks[0][0] - time.time()))
            await send_due(time.time())
        await producer.flush()
    finally:
        await producer.stop()
    report.seconds = time.monotonic() - started
    return report
