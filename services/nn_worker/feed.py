"""A rank's data path around its steps: batches in from Kafka, gradients out to the embedding worker.

`Feed` reads one partition of a loader-written topic (samples or eval) in order from a given
offset, counts only the records of the current attempt's lineage (trillium.job.record), and starts
each batch's lookup as soon as the batch arrives, up to `ahead` of them (the embedding worker holds
back any lookup that would exceed the staleness bound, so this only caps the memory in flight).
`GradientPusher` hands each step's embedding gradients to the embedding worker, in step order,
without the step waiting for it.

Both run a background task; a task that dies fails whoever waits on it (`get`, `join`) at once,
instead of leaving it waiting for items no task will deliver.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiokafka import TopicPartition

from trillium.config import KafkaConnection
from trillium.job import JobConfig
from trillium.job.record import PartitionLineage
from trillium.runtime import autobound
from trillium.wire import kafka
from trillium.wire.pb import embedding_pb2 as pb

PREFETCH = 8  # lookups requested ahead of the step being trained: at least, and in evaluation
# ... and at most this much of their embeddings. Each lookup ahead holds its batch's embeddings
# here and, while it is pooled and sent, several copies in the embedding worker: 8 of a wide
# job's (26 slots of dim 512, its evaluation's 1,260-sample batches in fp32: 67 MB each) took
# 1.6 GB there and ended a 1e10-parameter run on the OOM killer. A dim-16 job keeps all 8.
PREFETCH_BYTES = 64 << 20
# Gradient pushes a rank keeps unanswered: more than any staleness bound lets a step run ahead
# of its gradients, so the bound, not the pushes, decides how far the lookups run ahead ...
PUSH_WINDOW = autobound.MAX_BOUND + 1
# ... and at most this much of their gradients, which the embedding worker holds until Kafka has
# them (a wide job's step pushes tens of MB; an asynchronous job has no bound to stop it).
PUSH_WINDOW_BYTES = 64 << 20


def prefetch(job: JobConfig, *, evaluation: bool) -> int:
    """How many lookups a feed keeps requested ahead of the step it hands out. Training: as many
    as its staleness bound lets run while a step trains (k of them answered, the next waiting at
    the embedding worker for a gradient), so that a long round trip is hidden as far as the bound
    allows; `auto`, the most it may choose; unbounded (asynchronous), PREFETCH. Never past
    PREFETCH_BYTES of embeddings."""
    wanted = PREFETCH
    bound = job.training.staleness_bound
    if not evaluation and bound is not None:
        wanted = max(PREFETCH, (autobound.MAX_BOUND if bound == "auto" else bound) + 1)
    return max(1, min(wanted, PREFETCH_BYTES // job.embedding_batch_bytes(evaluation=evaluation)))


def push_window(job: JobConfig) -> int:
    """How many gradient pushes a rank keeps unanswered: PUSH_WINDOW, within PUSH_WINDOW_BYTES
    (a step's gradients are its batch's embeddings' size on the wire)."""
    return max(1, min(PUSH_WINDOW, PUSH_WINDOW_BYTES // job.embedding_batch_bytes(evaluation=False)))


@dataclass(frozen=True)
class Fetched:
    """A batch record and its lookup, started when the record arrived."""

    offset: int
    raw: bytes  # the codec-encoded Batch, as read
    lookup: asyncio.Future[pb.BatchLookupResponse]


@dataclass(frozen=True)
class EpochEnd:
    offset: int
    epoch: int


class _Supervised:
    """A background task whose death fails every wait on it."""

    _task: asyncio.Task[None] | None = None

    async def _unless_dead(self, awaitable: Awaitable[Any]) -> Any:
        waiter = asyncio.ensure_future(awaitable)
        assert self._task is not None, "not started"
        done, _ = await asyncio.wait({waiter, self._task}, return_when=asyncio.FIRST_COMPLETED)
        if waiter in done:
            return waiter.result()
        waiter.cancel()
        error = self._task.exception() if not self._task.cancelled() else None
        raise RuntimeError(f"{self._task.get_name()} stopped: {error!r}") from error

    async def stop(self) -> None:
        """Cancel the task; a failure it died of was raised to whoever waited on it."""
        task = self._task
        if task is None:
            return
        if task.done():
            if not task.cancelled():
                task.exception()
            return
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


class Feed(_Supervised):
    """Fetched items not taken when the feed stops have their lookups cancelled (or their errors
    consumed): a stopped feed leaves nothing behind."""

    def __init__(
        self,
        conn: KafkaConnection,
        topic: str,
        partition: int,
        start: int,
        lineage: PartitionLineage,
        attempt: int,
        lookup: Callable[[bytes], Awaitable[pb.BatchLookupResponse]],
        *,
        ahead: int,
        group_id: str | None,
    ) -> None:
        self.conn = conn
        self.partition = TopicPartition(topic, partition)
        self.start = start
        self.lineage = lineage
        self.attempt = attempt
        self.lookup = lookup
        self.group_id = group_id  # commits (for the lag metrics) only when given
        self.queue: asyncio.Queue[Fetched | EpochEnd] = asyncio.Queue(maxsize=ahead)
        self.in_flight = 0  # lookups started and not answered yet

    @property
    def settled(self) -> bool:
        """Nothing more is looked up until a step takes an item: the queue is full (its reader
        waits) and every lookup started is answered."""
        return self.queue.full() and self.in_flight == 0

    def _answered(self, _: asyncio.Future[Any]) -> None:
        self.in_flight -= 1

    def run(self) -> Feed:
        self._task = asyncio.create_task(self._read(), name=f"feed {self.partition.topic}[{self.partition.partition}]")
        return self

    async def get(self) -> Fetched | EpochEnd:
        return await self._unless_dead(self.queue.get())

    async def stop(self) -> None:
        await super().stop()
        while not self.queue.empty():
            item = self.queue.get_nowait()
            if isinstance(item, Fetched):
                item.lookup.cancel()

    async def _read(self) -> None:
        consumer = kafka.positioned_consumer(self.conn, group_id=self.group_id)
        consumer.assign([self.partition])
        await consumer.start()
        # Offsets are committed for the lag metrics only (a restore seeks its checkpoint's).
        bookkeeping = kafka.OffsetBookkeeping(consumer, self.partition) if self.group_id is not None else None
        try:
            consumer.seek(self.partition, self.start)
            while True:
                records = (await kafka.fetch(consumer, self.partition, timeout_ms=500)).get(self.partition, [])
                for record in records:
                    if not self.lineage.counts(record.offset, kafka.attempt_of(record.headers)):
                        continue  # written by an abandoned attempt
                    epoch = kafka.epoch_end(record.headers)
                    if epoch is not None:
                        await self.queue.put(EpochEnd(record.offset, epoch))
                    else:
                        lookup = started(self.lookup(record.value))
                        self.in_flight += 1
                        lookup.add_done_callback(self._answered)
                        await self.queue.put(Fetched(record.offset, record.value, lookup))
                if records and bookkeeping is not None:
                    bookkeeping.after_records()
        finally:
            if bookkeeping is not None:
                await bookkeeping.close()
            await consumer.stop()


def started(lookup: Awaitable[pb.BatchLookupResponse]) -> asyncio.Future[pb.BatchLookupResponse]:
    """A lookup started ahead of its step. Its error is marked as seen when it comes: a step that
    fails before it awaits its lookup (or a feed stopped with lookups queued, or cancelled while
    queueing one) leaves the lookup to fail with the stream whose error is reported where the
    step failed; asyncio would log it again, as "Task exception was never retrieved"."""
    future = asyncio.ensure_future(lookup)
    future.add_done_callback(_seen)
    return future


def _seen(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


class GradientPusher(_Supervised):
    """Sends a rank's gradients, step after step, without the step waiting for them, and keeps up
    to `window` of them unanswered: their round trips (to the embedding worker, and its own to
    Kafka) overlap. One at a time, a push took both round trips a step, and across 20 ms links
    that was longer than a step: the gradients fell further behind each step, and the lookups
    that wait for them with them, whatever the staleness bound."""

    def __init__(
        self,
        send: Callable[[pb.PushGradientsRequest], Awaitable[asyncio.Future[Any]]],
        *,
        window: int = PUSH_WINDOW,
    ) -> None:
        self.send = send  # writes a request after the ones before it; gives its answer to await
        self.window = window
        self.queue: asyncio.Queue[pb.PushGradientsRequest] = asyncio.Queue()

    def run(self) -> GradientPusher:
        self._task = asyncio.create_task(self._push(), name="gradient pusher")
        return self

    def put(self, request: pb.PushGradientsRequest) -> None:
        self.queue.put_nowait(request)

    async def join(self) -> None:
        """Until every gradient handed over so far is acknowledged (in Kafka)."""
        await self._unless_dead(self.queue.join())

    async def _push(self) -> None:
        unanswered: asyncio.Queue[asyncio.Future[Any]] = asyncio.Queue()
        room = asyncio.Semaphore(self.window)
        try:
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(self._write(unanswered, room))
                tasks.create_task(self._acknowledge(unanswered, room))
        except BaseExceptionGroup as failed:
            raise failed.exceptions[0] from None  # the first: the other is the stream's end it caused
        finally:
            while not unanswered.empty():  # answers no one awaits now: their errors are not news
                unanswered.get_nowait().add_done_callback(_seen)

    async def _write(self, unanswered: asyncio.Queue[asyncio.Future[Any]], room: asyncio.Semaphore) -> None:
        while True:
            request = await self.queue.get()
            await room.acquire()
            unanswered.put_nowait(await self.send(request))

    async def _acknowledge(self, unanswered: asyncio.Queue[asyncio.Future[Any]], room: asyncio.Semaphore) -> None:
        while True:
            await (await unanswered.get())
            room.release()
            self.queue.task_done()
