"""A data loader's part of a continuous job: Kafka events in, batches out.

Loader i of N reads partitions i, i + N, ... of the input topics (the impressions and labels of
a join are co-partitioned, so a partition of each meets in the same loader), decodes each
message (trillium.data.sources.events: a message that cannot be a sample goes to the dead-letter
topic `trillium.<job>.dlq` with the reason and its topic, partition and offset), joins
impressions with labels in event time (trillium.data.sources.joiner, or task_joiner for a
multi-task job's label topic per task; the watermark is the least event time over the loader's
input partitions that are not caught up, less the allowed lateness), normalizes the dense values
with statistics computed online, and cuts the samples into steps: a batch per rank it feeds,
`batch_size` samples each, or fewer when the stream is slow (`batch_timeout_seconds`). It stops
reading while it is `max_steps_ahead` steps ahead of training: the input's lag grows, nothing is
buffered without bound.

Its state — input offsets, joiner state, statistics, samples not yet in a batch — is captured at
a checkpoint cut with how far it has written the samples topic, so a restart neither loses nor
repeats an event.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import msgpack
import numpy as np
from aiokafka import TopicPartition
from aiokafka.errors import KafkaError

import trillium_native
from trillium.data.features import Encoder, OnlineStats, TextCells, batch_of
from trillium.data.sources.events import (
    FIELD_SEP,
    BadEvent,
    Event,
    EventReader,
    EventRows,
    event_columns,
    event_fields,
    events_of,
    packed_values,
    stream_encoder_config,
)
from trillium.data.sources.joiner import Decided, PartitionJoin, columns_of_rows
from trillium.data.sources.task_joiner import PartitionTaskJoin, TaskDecided
from trillium.job import JobConfig, KafkaData
from trillium.job.record import JobRecord
from trillium.log import Throttle
from trillium.runtime.checkpoint import Offsets
from trillium.runtime.progress import JobProgress
from trillium.runtime.service import JobCannotRecover
from trillium.wire import codec, kafka

from .placement import Share

logger = logging.getLogger("trillium.data_loader")

DLQ_HEADERS = ("trillium-dlq-reason", "trillium-source-topic", "trillium-source-partition", "trillium-source-offset")
SAMPLE_NAMESPACE = "trillium.sample"  # sample ids: hash_ids of the event key in this namespace
POOL_STEPS = 4  # the samples a stream mixes before drawing steps: at least this many steps' worth
BAD_REASON_CHARS = 200  # of a bad event's reason in a log line (the dead letter keeps it whole)
IDLE_SECONDS = 2.0  # an input partition silent this long (and caught up) no longer holds the watermark
# An input partition further ahead than this in event time of the slowest one is paused (see `ahead`).
ALIGN_SECONDS = 2.0


def _kind(reason: str) -> str:
    """A dead letter's reason, as the counter it goes to."""
    if reason.startswith("missing field"):
        return "missing_field"
    if reason.startswith(("not valid", "expected an object", "empty message", "message of")):
        return "undecodable"
    if reason.startswith("event time"):
        return "clock"
    return "bad_value"


def due_steps(
    rows: EventRows, rng: np.random.Generator, *, step: int, pool: int, timeout: float, now: float
) -> Iterator[EventRows]:
    """The steps to send now, each picked out of `rows` at random (a join emits positives when
    their click comes and negatives when windows close: in bursts, which batches must not be).

    Whole steps while more than `pool` rows would be left to mix. No row waits longer than
    `timeout`: then the oldest go out, in whole steps while there are a step's worth (the newest,
    fewer than a step, wait for the next round: a fast stream makes no small steps, each as costly
    as a whole one and as noisy as its few samples), else as one partial step (a slow stream)."""

    def waited_out() -> bool:
        return bool(rows) and now - rows.arrived[0] >= timeout

    # Each group of steps is drawn in one pick (a pick copies the whole pool): drawing a step at a
    # time out of what the last left is drawing them all at once, then cutting that in steps.
    if (whole := max(len(rows) - pool, 0) // step) > 0:
        yield from rows.pick(rng.choice(len(rows), whole * step, replace=False)).split(step)
    if waited_out():
        # The rows are in arrival order, and what is picked leaves the rest in it.
        yield from rows.pick(rng.permutation(len(rows) // step * step)).split(step)
        if waited_out():
            yield rows.pick(rng.permutation(len(rows)))


def complete_through(watermark: float, steps: list[float], pool: float, window: float) -> list[float | None]:
    """How far the input is complete once each of a round's steps is sent: every impression of an
    earlier event time is in that step or one before it (None: nothing known yet).

    `steps` holds the oldest sample time of each step of the round, in sending order, `pool` the
    oldest of the rows left to mix. An impression older than `watermark - window` has its window
    closed and is decided by `watermark`, so the joiner has handed it over; one older than the
    oldest sample left (pool, or a later step of the round) less the window is not among them (a
    sample's time is its click's, at most a window after its impression). What is older than both
    has been sent. Without a join the window is 0: events are samples as they are read."""
    out: list[float | None] = []
    later = pool
    for oldest in reversed(steps):
        through = min(watermark, later) - window
        # Two ulps below: a window end less the window is its impression's time only to within one
        # ulp, and a stamp must not claim the impression it was computed from.
        out.append(float(through - 2 * np.spacing(abs(through) + window)) if np.isfinite(through) else None)
        later = min(later, oldest)
    return out[::-1]


def upgrade_state(state: dict[str, Any], config: JobConfig, format: int) -> dict[str, Any]:
    """A stream's state as checkpoint format `format` wrote it, in today's form: format 1 kept each
    event's values as a dict by path (today one text: `trillium.data.sources.events`), formats 1
    and 2 a list per event (today a list per field: `event_columns`)."""
    if format < 2:
        paths = [p for p, _ in event_fields(config)]

        def event(e: list[Any] | None) -> list[Any] | None:
            return None if e is None else [packed_values(e[0], paths), *e[1:]]

        state["rows"] = [event(r) for r in state.get("rows", [])]
        for join in state.get("joins", {}).values():
            join["open"] = [event(e) for e in join["open"]]
            join["closed"] = [[key, event(e), *rest] for key, e, *rest in join["closed"]]
            join["decided"] = [[event(e), *rest] for e, *rest in join["decided"]]
    if format < 3:
        rows = state.get("rows", [])
        state["rows"] = event_columns(Event(*r[:3]) for r in rows) | {
            "labels": [r[3] for r in rows],
            "sample_times": [r[4] for r in rows],
        }
        state["joins"] = {p: columns_of_rows(join) for p, join in state.get("joins", {}).items()}
    return state


def ahead(times: dict[TopicPartition, float], drift: float) -> set[TopicPartition]:
    """The partitions to pause: those more than `drift` seconds of event time ahead of the slowest
    of `times` (the latest event time of each partition that holds the watermark back).

    Watermark alignment, as Flink's: while a partition is behind (catching up after a recovery, or
    a fetch that filled from one partition), what the others read waits in the joiner until the
    watermark passes it — open impressions, clicks ahead of their impressions, samples decided.
    Reading them only as far as the slowest has come bounds the joiner's state by the window, not
    by how far behind the slowest partition is. The slowest is never paused: reading goes on."""
    if not times:
        return set()
    slowest = min(times.values())
    return {tp for tp, t in times.items() if t > slowest + drift}


class StreamLoader:
    def __init__(self, service: Any, job: JobRecord, share: Share, state: dict[str, Any] | None) -> None:
        self.service = service
        self.job = job
        self.config = job.config
        self.data: KafkaData = job.config.data  # type: ignore[assignment]
        self.share = share
        self.reader = EventReader(self.config)
        self.encoder_config = stream_encoder_config(self.config)
        state = state or {}
        self.stats = OnlineStats(self.config, state.get("stats"))
        self.encoder = Encoder(self.encoder_config, self.stats.stats())
        self.positions: dict[tuple[str, int], int] = {
            (t, int(p)): o for t, parts in state.get("positions", {}).items() for p, o in parts.items()
        }
        self.max_time: dict[tuple[str, int], float] = {
            (t, int(p)): v for t, parts in state.get("max_time", {}).items() for p, v in parts.items()
        }
        self.joins: dict[int, PartitionJoin | PartitionTaskJoin] = {}
        # A label topic's task (its index in the job's tasks; 0 for a one-label job's one topic).
        self.label_tasks: dict[str, int] = {}
        if self.data.join is not None:
            names = [t.name for t in self.config.tasks]
            joined = self.data.join.labels
            self.label_tasks = (
                {j.topic: names.index(j.task) for j in joined} if self.data.join.per_task else {joined: 0}
            )
            for p, s in state.get("joins", {}).items():
                self.joins[int(p)] = self._join_of(s)
        self.rows = EventRows(self.config)
        if "rows" in state:
            rows = state["rows"]
            for event, label, sample_time in zip(events_of(rows), rows["labels"], rows["sample_times"], strict=True):
                self.rows.add(event, label, sample_time)
        self.step = state.get("step", 0)  # the next step this loader produces
        self.last_step = time.monotonic()  # when it produced the last one
        self.rng = np.random.default_rng(self.config.training.seed + self.service.settings.index)
        if "rng" in state:
            self.rng.bit_generator.state = state["rng"]
        self.counts: Counter[str] = Counter(state.get("counts", {}))
        self.dead: Counter[str] = Counter(state.get("dead", {}))
        self.bad_lines = Throttle(logger)  # anyone who writes the input can send a bad event a message
        self.skipped: Counter[str] = Counter(state.get("skipped", {}))  # input records gone, by "topic/partition"
        self.lag: list[dict[str, Any]] = []
        self.deliveries: list[asyncio.Future] = []  # sends of the current fetch, awaited after it
        self.heard: dict[tuple[str, int], float] = {}  # when each input partition last had records
        self.started = time.monotonic()
        self.idle_s = max(IDLE_SECONDS, 2 * self.data.batch_timeout_seconds)
        self.watermark = -np.inf  # the input's, as `_advance` last found it (joins close windows by it)

    # ---- state ---------------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        def nested(d: dict[tuple[str, int], Any]) -> dict[str, dict[str, Any]]:
            out: dict[str, dict[str, Any]] = {}
            for (topic, p), v in d.items():
                out.setdefault(topic, {})[str(p)] = v
            return out

        # Copies: the state is encoded after the capture, while the stream goes on.
        rows = event_columns(self.rows.events) | {
            "labels": list(self.rows.labels),
            "sample_times": list(self.rows.times),
        }
        return {
            "positions": nested(self.positions),
            "max_time": nested(self.max_time),
            "joins": {str(p): j.state() for p, j in self.joins.items()},
            "rows": rows,
            "step": self.step,
            "rng": self.rng.bit_generator.state,
            "stats": self.stats.state(),
            "counts": dict(self.counts),
            "dead": dict(self.dead),
            "skipped": dict(self.skipped),
        }

    def _join_of(self, state: dict[str, Any] | None = None) -> PartitionJoin | PartitionTaskJoin:
        """A partition's joiner, new or of a checkpointed state."""
        join = self.data.join
        assert join is not None
        if join.per_task:
            return PartitionTaskJoin(self.config) if state is None else PartitionTaskJoin.from_state(self.config, state)
        return PartitionJoin(join) if state is None else PartitionJoin.from_state(join, state)

    def health(self) -> dict[str, Any]:
        joined: Counter[str] = Counter()
        tasks: dict[str, Counter[str]] = {}
        for join in self.joins.values():
            joined.update(join.counts)
            if isinstance(join, PartitionTaskJoin):
                for task, counts in join.task_counts.items():
                    tasks.setdefault(task, Counter()).update(counts)
        return {
            # Whose counts these are: a heartbeat may pair the next job's first report with them.
            "job": [self.job.id, self.job.attempt],
            "events": dict(self.counts),
            "dead_letters": dict(self.dead),
            "skipped": dict(self.skipped),
            "joined": dict(joined),
            "joined_tasks": {task: dict(c) for task, c in tasks.items()},
            "inputs": self.lag,
            "steps": self.step,
        }

    # ---- the loop ------------------------------------------------------------------------------------
    def _input_connection(self):
        return self.service.settings.kafka.for_brokers(self.data.bootstrap)

    async def _partitions(self, consumer) -> list[TopicPartition]:
        counts = {}
        for topic in self.data.input_topics:
            parts = consumer.partitions_for_topic(topic)
            if not parts:
                await consumer._client.force_metadata_update()
                parts = consumer.partitions_for_topic(topic)
            if not parts:
                raise RuntimeError(f"input topic {topic!r} does not exist on {self._input_connection().bootstrap}")
            counts[topic] = len(parts)
        if self.data.join is not None and len(set(counts.values())) > 1:
            raise RuntimeError(
                f"the impressions and labels topics must be co-partitioned by the join key (the "
                f"same number of partitions, keyed producers), as Kafka Streams requires: {counts}"
            )
        loaders = self.config.topology.data_loaders
        return [
            TopicPartition(t, p)
            for t, n in counts.items()
            for p in range(n)
            if p % loaders == self.service.settings.index
        ]

    async def run(self, producer) -> None:
        group = self.data.group or f"trillium.{self.job.id}.input"
        consumer = kafka.positioned_consumer(
            self._input_connection(),
            group_id=group,
            fetch_min_bytes=self.data.fetch_min_bytes,
            fetch_max_wait_ms=self.data.fetch_max_wait_ms,
        )
        await consumer.start()
        try:
            tps = await self._partitions(consumer)
            consumer.assign(tps)
            new = [tp for tp in tps if (tp.topic, tp.partition) not in self.positions]
            for tp in tps:
                if tp not in new:
                    consumer.seek(tp, self.positions[(tp.topic, tp.partition)])
            if new:  # where a new job starts (not the group's offsets: they are for outside monitors)
                await (consumer.seek_to_beginning if self.data.start == "earliest" else consumer.seek_to_end)(*new)
            if self.data.join is not None:
                for tp in tps:
                    if tp.partition not in self.joins:
                        self.joins[tp.partition] = self._join_of()
            progress = JobProgress(self.service.redis, self.job.id)
            self.service.set_job_phase("ready")
            loop = asyncio.get_running_loop()
            next_bookkeeping = loop.time()
            trained = 0
            while True:
                if self.step - trained > self.data.max_steps_ahead:
                    trained = (await progress.training(self.config.topology.nn_ranks))["steps"]
                    await asyncio.sleep(0.1)  # training is behind: let the input's lag grow
                    continue
                try:
                    fetched = await kafka.fetch(consumer, timeout_ms=100, max_records=4096)
                except kafka.RecordsGone as gap:
                    self._skip(consumer, gap)
                    continue
                async with self.service.produce_lock:
                    for tp, records in fetched.items():
                        await self._take(producer, tp, records)
                    await self._advance(consumer, tps, fetched)
                    await self._emit(producer)
                    sent, self.deliveries = self.deliveries, []
                await asyncio.gather(*sent)  # a batch the broker did not take fails the loader, and the job recovers
                if loop.time() >= next_bookkeeping:  # lag metrics and the group's offsets, once a second
                    trained = (await progress.training(self.config.topology.nn_ranks))["steps"]
                    await self._bookkeeping(consumer, tps)
                    # What a model version published now normalizes with (services/coordinator/publish.py).
                    await progress.set_dense_stats(self.service.settings.index, self.encoder.stats)
                    next_bookkeeping = loop.time() + 1.0
        finally:
            await consumer.stop()

    def _skip(self, consumer, gap: kafka.RecordsGone) -> None:
        """Records of an input partition gone before they were read: skipped and counted where
        the job says so (`data.on_gap: skip`); else the job fails naming them (a new attempt
        from a checkpoint, further back still, would meet the same gap)."""
        if self.data.on_gap == "fail" or gap.lost == 0:
            raise JobCannotRecover(f"{gap} (data.on_gap: skip skips such a gap, counted)") from gap
        tp = gap.partition
        self.skipped[f"{tp.topic}/{tp.partition}"] += gap.lost
        logger.warning("input records gone, skipped (data.on_gap: skip)", extra={"job": self.job.id, "gap": str(gap)})
        consumer.seek(tp, gap.start)
        self.positions[(tp.topic, tp.partition)] = gap.start

    async def _take(self, producer, tp: TopicPartition, records: list) -> None:
        """A fetch of one input partition's records, decoded at once, into the joiner (or the rows)."""
        if not records:
            return
        where = (tp.topic, tp.partition)
        join = self.data.join
        impression = join is None or tp.topic == join.impressions
        joiner = self.joins[tp.partition] if join is not None else None
        # What the native join takes the messages as: impressions, or labels (of a task).
        role: bool | int | None = impression
        if isinstance(joiner, PartitionTaskJoin):
            role = None if impression else self.label_tasks[tp.topic]
        raws = [r.value for r in records]
        latest = self.max_time.get(where, -np.inf)
        now = time.time()
        earliest, newest = self._clock_bounds(now)
        self.counts["messages"] += len(records)
        try:
            if joiner is not None and self.reader.native is not None:
                # Decoded and joined in native code, message after message, up to one that needs
                # this: a bad message, or an event time out of the clock's bounds.
                i = 0
                while i < len(raws):
                    i, joined = joiner.take(self.reader.native, raws, i, role, earliest, newest)
                    latest = max(latest, joined)
                    if i < len(raws):
                        [event] = self.reader.events([raws[i]], impression=impression)
                        latest = max(latest, await self._accept(producer, tp, records[i], event, now))
                        i += 1
            else:
                for record, event in zip(records, self.reader.events(raws, impression=impression), strict=True):
                    latest = max(latest, await self._accept(producer, tp, record, event, now))
        finally:
            if latest > -np.inf:
                self.max_time[where] = latest
        self.positions[where] = records[-1].offset + 1

    async def _accept(self, producer, tp: TopicPartition, record, event: Event | BadEvent, now: float) -> float:
        """One message's event into the joiner (or the rows), or to the dead letters: the event
        time it took (-inf: none)."""
        if isinstance(event, BadEvent):
            await self._dead_letter(producer, tp, record.offset, record.value, str(event))
            return -np.inf
        join = self.data.join
        earliest, newest = self._clock_bounds(now)
        try:
            if not earliest <= event.time <= newest:
                event = self._clocked(event, now)
            if join is None:
                self.rows.add(event)
            elif tp.topic == join.impressions:
                self.joins[tp.partition].impression(event)
            elif isinstance(joiner := self.joins[tp.partition], PartitionTaskJoin):
                joiner.label(self.label_tasks[tp.topic], event.key, event.time)
            else:
                joiner.label(event.key, event.time)
        except BadEvent as err:
            await self._dead_letter(producer, tp, record.offset, record.value, str(err))
            return -np.inf
        return event.time

    def _clock_bounds(self, now: float) -> tuple[float, float]:
        """The event times `data.clock` takes as they are, at `now`."""
        clock = self.data.clock
        return (
            -np.inf if clock.max_past_seconds is None else now - clock.max_past_seconds,
            np.inf if clock.max_future_seconds is None else now + clock.max_future_seconds,
        )

    def _clocked(self, event: Event, now: float) -> Event:
        """An event whose time is out of the clock's bounds at `now` (`data.clock`), clamped to
        them, or BadEvent saying why (`action: dlq`)."""
        earliest, newest = self._clock_bounds(now)
        if event.time > newest:
            kind, bound = "future", now
        else:
            kind, bound = "past", earliest
        self.counts[f"clock_{kind}"] += 1
        if self.data.clock.action == "dlq":
            raise BadEvent(
                f"event time {event.time:.3f} is {abs(event.time - now):.1f} s in the {kind} of the "
                f"loader's clock (data.clock.max_{kind}_seconds)"
            )
        return event._replace(time=bound)

    def _add(self, decided: Decided | TaskDecided) -> None:
        if isinstance(decided, TaskDecided):
            self.rows.extend(decided.events, decided.labels, decided.times)
        else:
            self.rows.extend(decided.events, ["1" if p else "0" for p in decided.positive], decided.times)

    async def _dead_letter(self, producer, tp: TopicPartition, offset: int, raw: bytes | None, reason: str) -> None:
        self.dead[_kind(reason)] += 1
        where = {"topic": tp.topic, "partition": tp.partition, "offset": offset}
        self.bad_lines.warning("event to the dead letters", reason=reason[:BAD_REASON_CHARS], **where)
        values = [reason, tp.topic, str(tp.partition), str(offset)]
        headers = [*zip(DLQ_HEADERS, (v.encode() for v in values), strict=True), *kafka.headers(self.job.attempt)]
        self.deliveries.append(await producer.send(self.job.topics.dlq, raw or b"", headers=headers))

    async def _advance(self, consumer, tps: list[TopicPartition], fetched: dict) -> None:
        """Find the input's watermark; close the joiner windows it has passed."""
        join = self.data.join
        lateness = join.allowed_lateness_seconds if join is not None else 0.0
        now = time.monotonic()
        for tp in fetched:
            self.heard[(tp.topic, tp.partition)] = now
        # A partition caught up and silent for a while is idle: it does not hold the others back.
        # (Caught up alone is not idle: its newest records may just not be fetched yet.) Silence
        # and the fetched high watermark are only hints — a loop busy for seconds hears nothing and
        # its high watermarks are as old — so the broker's end offsets confirm it: a partition with
        # records we have not read is never idle, or its clicks would come after their windows closed.
        silent = [
            tp
            for tp in tps
            if now - self.heard.get((tp.topic, tp.partition), self.started) > self.idle_s
            and consumer.highwater(tp) is not None
            and consumer.highwater(tp) <= self.positions.get((tp.topic, tp.partition), 0)
        ]
        ends = await consumer.end_offsets(silent) if silent else {}
        idle = {tp for tp in silent if ends[tp] <= self.positions.get((tp.topic, tp.partition), 0)}
        busy = {tp: self.max_time.get((tp.topic, tp.partition), -np.inf) for tp in tps if tp not in idle}
        if join is not None:
            self._align(consumer, {tp: t for tp, t in busy.items() if t > -np.inf})
        if busy:
            watermark = min(busy.values()) - lateness
        else:
            # The whole input is idle: event time goes on with the clock from its last event, so
            # the last impressions of a stream that pauses (or ends) close too.
            latest = max(self.max_time.values(), default=-np.inf)
            silent = now - max(self.heard.values(), default=self.started)
            watermark = latest + silent - lateness
        self.watermark = max(self.watermark, watermark)
        for joiner in self.joins.values():
            self._add(joiner.advance(watermark))

    @staticmethod
    def _align(consumer, times: dict[TopicPartition, float]) -> None:
        """Pause the input partitions `ahead` of the slowest one, resume those it has caught up with
        (a paused partition's prefetched records are dropped and read again on resuming)."""
        pause, paused = ahead(times, ALIGN_SECONDS), consumer.paused()
        if pause - paused:
            consumer.pause(*(pause - paused))
        if paused - pause:
            consumer.resume(*(paused - pause))

    async def _emit(self, producer) -> None:
        k, size = len(self.share.ranks), self.config.training.batch_size
        pool = max(self.config.training.shuffle_buffer, POOL_STEPS * k * size)
        now = time.monotonic()
        steps = list(
            due_steps(self.rows, self.rng, step=k * size, pool=pool, timeout=self.data.batch_timeout_seconds, now=now)
        )
        window = self.data.join.sample_window if self.data.join is not None else 0.0
        if steps:  # the pool's oldest sample (a pass over all of it) only when a step goes out
            oldest = [min(rows.times, default=np.inf) for rows in steps]
            through = complete_through(self.watermark, oldest, min(self.rows.times, default=np.inf), window)
            for rows, stamp in zip(steps, through, strict=True):
                n = len(rows)
                await self._step(producer, rows, [n // k + (i < n % k) for i in range(k)], stamp)
        if not self.rows and now - self.last_step >= self.data.batch_timeout_seconds:
            # A tick: an empty step while the stream is quiet. The ranks' control words ride on the
            # steps, so a checkpoint, a pause, a stop or a model version is agreed on within a
            # timeout of being asked for, data or not (the ranks change no weight on it).
            [stamp] = complete_through(self.watermark, [np.inf], np.inf, window)
            await self._step(producer, self.rows.pick([]), [0] * k, stamp)

    async def _step(self, producer, rows: EventRows, sizes: list[int], stamp: float | None) -> None:
        """One step: a batch of `sizes[i]` samples for each of our ranks, each stamped with how
        far the input is complete once it is sent (`complete_through`)."""
        cells = TextCells.of_rows(self.encoder.job, [e.values for e in rows.events], FIELD_SEP, rows.paths, rows.labels)
        checked = self.encoder.check_cells(
            cells, lambda i: (i, msgpack.packb(self.reader.named(rows.events[i])).hex()), file="kafka"
        )
        self.stats.update(checked.dense[checked.keep])
        self.encoder.stats = self.stats.stats()
        encoded = self.encoder.encode_cells(cells, checked)
        keep = np.flatnonzero(checked.keep)
        for bad in checked.bad:  # a label the job does not know, say
            self.dead["bad_value"] += 1
            self.bad_lines.warning("event refused at encoding", reason=bad.reason[:BAD_REASON_CHARS])
        # A keyed stream's batches always say their samples' ids, an empty tick's too (as none).
        keyed = self.data.event_key is not None
        ids = trillium_native.hash_ids(SAMPLE_NAMESPACE, [rows.events[i].key for i in keep]) if keyed else None
        times = np.asarray(rows.times, np.float64)[keep]
        start = 0
        for i, rank in enumerate(self.share.ranks):
            n = min(sizes[i], encoded.rows - start)
            part = encoded.slice(start, start + n)
            batch = batch_of(
                self.config,
                part,
                batch_id=self.step * self.share.world + rank,
                rank=rank,
                sample_ids=ids[start : start + n] if ids is not None else None,
                event_times=times[start : start + n],
                complete_through=stamp,
            )
            self.deliveries.append(
                await self.service.send(self.job.topics.samples, batch.rank, codec.encode_batch(batch))
            )
            start += n
        self.counts["samples"] += encoded.rows
        self.step += 1
        self.last_step = time.monotonic()

    async def _bookkeeping(self, consumer, tps: list[TopicPartition]) -> None:
        ends = await consumer.end_offsets(tps)
        now = time.time()
        self.lag = [
            {
                "topic": tp.topic,
                "partition": tp.partition,
                "lag_messages": max(ends[tp] - self.positions.get((tp.topic, tp.partition), 0), 0),
                "lag_seconds": (
                    now - self.max_time[(tp.topic, tp.partition)] if (tp.topic, tp.partition) in self.max_time else None
                ),
            }
            for tp in tps
        ]
        if self.positions:
            offsets = {TopicPartition(t, p): o for (t, p), o in self.positions.items()}
            try:
                await consumer.commit(offsets)  # for outside lag monitors; restores use the checkpoint's
            except KafkaError as err:
                logger.warning("input offsets not committed", extra={"error": str(err)})

    def written_positions(self) -> Offsets:
        out: Offsets = {}
        for (topic, p), offset in self.positions.items():
            out.setdefault(topic, {})[p] = offset
        return out
