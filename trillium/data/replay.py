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
Messages are keyed by the event key and partitioned as a keyed send is (Kafka's default
partitioner), so impressions and clicks are co-partitioned; topics that do not exist yet are
created with `partitions` partitions each.

The sender shares its machine with what it feeds (a benchmark's stack), so it is built to cost
little: a chunk of rows at a time is encoded as JSON by the native core, a column per field
(`trillium.data.events_out`), and sent as one record batch per partition, PACE_TICK_S apart.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from trillium.config import KafkaConnection
from trillium.data.events_out import EventEncoder, Outbox, malformed
from trillium.data.sources import open_source
from trillium.data.sources.cells import as_text
from trillium.job import AdultData, CriteoData, JobConfig, KafkaData
from trillium.job.data import PRESET_COLUMNS
from trillium.wire import kafka

# The label column and its positive value of the formats replay reads.
LABELS = {"criteo": ("label", "1"), "adult": ("income_bracket", ">50K")}
CHUNK_ROWS = 2048  # rows encoded and sent at once (as fast as it goes, or a backlog when late)
PACE_TICK_S = 0.02  # paced: rows due are sent together, at most this often
BATCH_BYTES = 1 << 20  # a record batch per partition and chunk, up to this size


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


def blocks_of(file: Path, fmt: str, columns: list[str]) -> Iterator[pa.Table]:
    """The rows of a data set file (a preset's format), the given columns, a block at a time."""
    config = (CriteoData if fmt == "criteo" else AdultData)(source=fmt, train=file)
    for task in open_source(config).blocks("train", columns):
        yield task().table.select(columns)


def chunks_of(blocks: Iterator[pa.Table], limit: int | None) -> Iterator[pa.Table]:
    """The rows in slices of at most CHUNK_ROWS, `limit` rows in all."""
    left = limit
    for block in blocks:
        for start in range(0, block.num_rows, CHUNK_ROWS):
            if left is not None and left <= 0:
                return
            chunk = block.slice(start, min(CHUNK_ROWS, left if left is not None else CHUNK_ROWS))
            yield chunk
            if left is not None:
                left -= chunk.num_rows


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
    if job.multitask:
        raise ValueError("replay sends a data set's one label: the job has several tasks (labels:)")
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
    label_path = job.label.column if data.join is None else None
    encoder = EventEncoder(
        data.event_key or "id", data.event_time, paths, {d.column for d in job.dense}, label_path, data.format
    )
    topics = data.input_topics
    await kafka.ensure_topics(conn, {t: partitions for t in topics})  # co-partitioned: the same count
    producer = kafka.producer(conn, max_batch_size=BATCH_BYTES)
    await producer.start()
    try:
        sender = _Sender(
            job,
            encoder,
            await Outbox.open(producer, topics[0]),
            await Outbox.open(producer, topics[1]) if data.join is not None else None,
            label_column,
            positive,
            np.random.default_rng(seed),
            late_fraction,
            malformed_fraction,
        )
        columns = list(dict.fromkeys([p.split(".")[-1] for p in paths] + [label_column]))
        started, wall, sent = time.monotonic(), time.time(), 0
        last_send = started - PACE_TICK_S
        for chunk in chunks_of(blocks_of(file, fmt, columns), limit):
            # Encoded a chunk at a time (a call per column costs the same for 40 rows as for 2,000),
            # with the event times of its rows' places in the schedule; sent as they fall due.
            n = chunk.num_rows
            rows = np.arange(sent, sent + n)
            times = wall + rows / rate if rate > 0 else np.full(n, time.time())
            keys = [f"r{seed}-{i}".encode() for i in rows]
            messages = sender.encode(chunk, keys, times)
            at = 0
            while at < n:
                due = n - at
                if rate > 0:  # paced: row i is due at started + i / rate; what is due goes out together
                    # Sends PACE_TICK_S apart even when behind: a send waits for the previous
                    # batch of each partition to be drained, so back to back they came one
                    # broker round trip apart, and the broker's CPU went on requests, not events.
                    now = time.monotonic()
                    if (wait := max(started + sent / rate, last_send + PACE_TICK_S) - now) > 0:
                        await asyncio.sleep(wait)
                    due = min(due, max(1, int((time.monotonic() - started) * rate) + 1 - sent))
                    last_send = time.monotonic()
                await sender.send(keys[at : at + due], messages[at : at + due], float(times[at + due - 1]))
                at, sent = at + due, sent + due
        await sender.finish()
    finally:
        await producer.stop()
    sender.report.seconds = time.monotonic() - started
    return sender.report


class _Sender:
    """Rows to impression (or labelled) events, and positive rows to clicks held until their
    event time comes."""

    def __init__(
        self,
        job: JobConfig,
        encoder: EventEncoder,
        events: Outbox,
        labels: Outbox | None,
        label_column: str,
        positive: str,
        rng: np.random.Generator,
        late_fraction: float,
        malformed_fraction: float,
    ) -> None:
        self.job, self.encoder, self.events, self.labels = job, encoder, events, labels
        self.label_column, self.positive, self.rng = label_column, positive, rng
        self.late_fraction, self.malformed_fraction = late_fraction, malformed_fraction
        self.window = job.data.join.sample_window if job.data.join is not None else 0.0
        self.clicks: list[tuple[float, int, bytes, bytes]] = []  # heap of (event time, seq, key, message)
        self.seq = itertools.count()
        self.report = ReplayReport()

    def encode(self, rows: pa.Table, keys: list[bytes], times: np.ndarray) -> list[bytes]:
        """The rows' messages (a share of them garbage); their clicks are held until due."""
        messages = self.encoder.events(rows, keys, times)
        if self.malformed_fraction:
            for i in np.flatnonzero(self.rng.random(len(messages)) < self.malformed_fraction):
                messages[i] = malformed(int(self.rng.integers(3)), messages[i], self.job)
                self.report.malformed += 1
        if self.labels is not None:
            self._hold_clicks(rows, keys, times)
        return messages

    async def send(self, keys: list[bytes], messages: list[bytes], until: float) -> None:
        """Send impressions up to event time `until`, after the clicks due by then."""
        if self.labels is not None:
            await self._queue_clicks(until)
            await self.labels.flush()
        await self.events.add(keys, messages)
        await self.events.flush()
        self.report.impressions += len(messages)

    def _hold_clicks(self, rows: pa.Table, keys: list[bytes], times: np.ndarray) -> None:
        labels = as_text(rows.column(self.label_column).combine_chunks()).to_pylist()
        clicked = [i for i, label in enumerate(labels) if label == self.positive]
        late = (
            self.rng.random(len(clicked)) < self.late_fraction if self.late_fraction else np.zeros(len(clicked), bool)
        )
        draws = self.rng.random(len(clicked))
        at = times[clicked] + np.where(late, self.window * (1 + draws * 0.5) + 1e-3, self.window * draws)
        clicked_keys = [keys[i] for i in clicked]
        for key, when, value in zip(clicked_keys, at, self.encoder.clicks(clicked_keys, at), strict=True):
            heapq.heappush(self.clicks, (float(when), next(self.seq), key, value))
        self.report.clicks += len(clicked)
        self.report.late_clicks += int(late.sum())

    async def _queue_clicks(self, until: float) -> None:
        """Queue the clicks of event time up to `until`."""
        due = []
        while self.clicks and self.clicks[0][0] <= until:
            due.append(heapq.heappop(self.clicks))
        await self.labels.add([key for _, _, key, _ in due], [value for _, _, _, value in due])

    async def finish(self) -> None:
        """Send the clicks still to come, each when its time comes, and wait for every delivery."""
        while self.clicks:
            await asyncio.sleep(max(0.0, self.clicks[0][0] - time.time()))
            await self._queue_clicks(time.time())
            await self.labels.flush()
        await self.events.delivered()
        if self.labels is not None:
            await self.labels.delivered()
