"""Kafka helpers over aiokafka: readiness, topics, and producers/consumers/admin clients with the
project's defaults (idempotent, acks=all producers; manual-commit consumers). Every client of
the project is made here, so each one connects with the process's KafkaConnection: its
address, and SASL/TLS when configured."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from aiokafka import AIOKafkaClient, AIOKafkaConsumer, AIOKafkaProducer, TopicPartition, errors
from aiokafka.admin import AIOKafkaAdminClient, NewPartitions, NewTopic
from aiokafka.conn import AIOKafkaConnection, CloseReason
from aiokafka.errors import KafkaConnectionError, KafkaError, OffsetOutOfRangeError, TopicAlreadyExistsError
from aiokafka.helpers import create_ssl_context

from trillium.config import KafkaConnection
from trillium.timeouts import KAFKA_DELIVERY_S, KAFKA_PROBE_S, KAFKA_REQUEST_S

KAFKA_REQUEST_MS = int(KAFKA_REQUEST_S * 1000)

logger = logging.getLogger("trillium.kafka")


def _broken_writes_break_the_connection(write: Callable[..., Any]) -> Callable[..., Any]:
    """A write to a connection the broker has closed, as aiokafka handles it for OSError: the
    connection closed and a KafkaConnectionError, which every caller of aiokafka retries.
    Between the broker's close reaching uvloop's transport and aiokafka's reader task seeing it,
    uvloop raises RuntimeError ("the handler is closed") on a write, where asyncio's own loop
    drops it, and aiokafka catches only OSError there (aio-libs/aiokafka#1038, open in 0.14).
    Uncaught, it ends a consumer's fetcher routine (getmany then returns nothing, for ever) or
    comes out of the consumer's stop(); a rank of the e2e test that restarts Kafka failed with it."""

    @functools.wraps(write)
    def guarded(connection: AIOKafkaConnection, *args: Any, **kwargs: Any) -> Any:
        try:
            return write(connection, *args, **kwargs)
        except RuntimeError as err:
            writer = connection._writer
            if writer is None or not writer.transport.is_closing():
                raise  # not a closed transport's: a bug to see, not a broker away
            connection.close(reason=CloseReason.CONNECTION_BROKEN)
            raise KafkaConnectionError(f"Connection at {connection.host}:{connection.port} broken: {err}") from err

    return guarded


# Every client of the project is made here, so importing this module guards every connection.
AIOKafkaConnection.send = _broken_writes_break_the_connection(AIOKafkaConnection.send)
AIOKafkaConnection._send_sasl_token = _broken_writes_break_the_connection(AIOKafkaConnection._send_sasl_token)


def _connection(conn: KafkaConnection) -> dict[str, object]:
    """The options every aiokafka client takes to reach and authenticate to the cluster."""
    options: dict[str, object] = dict(bootstrap_servers=conn.bootstrap, security_protocol=conn.security_protocol)
    if conn.security_protocol.startswith("SASL"):
        assert conn.username and conn.password  # KafkaConnection validates it
        options.update(
            sasl_mechanism=conn.sasl_mechanism,
            sasl_plain_username=conn.username,
            sasl_plain_password=conn.password.get_secret_value(),
        )
    if conn.security_protocol.endswith("SSL"):
        options["ssl_context"] = create_ssl_context(cafile=str(conn.ca_file) if conn.ca_file else None)
    return options


async def wait_for_kafka(conn: KafkaConnection, timeout_s: float = 60.0) -> int:
    """Block until a metadata request succeeds; returns the number of brokers."""
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        client = AIOKafkaClient(**_connection(conn), request_timeout_ms=int(KAFKA_PROBE_S * 1000))
        try:
            await client.bootstrap()
            brokers = client.cluster.brokers()
            if brokers:
                return len(brokers)
        except (KafkaError, OSError) as exc:
            last = exc
        finally:
            await client.close()
        await asyncio.sleep(0.5)
    raise TimeoutError(f"Kafka at {conn.bootstrap} did not answer a metadata request in {timeout_s:.0f}s: {last}")


def admin(conn: KafkaConnection, **overrides: object) -> AIOKafkaAdminClient:
    return AIOKafkaAdminClient(**(_connection(conn) | {"request_timeout_ms": KAFKA_REQUEST_MS} | overrides))


def replication(brokers: int, configs: dict[str, str] | None = None) -> tuple[int, dict[str, str]]:
    """A new topic's replication factor (3, or as many brokers as there are) and its configs with
    `min.insync.replicas` one less (at least 1) unless `configs` sets it: our producers wait for
    every in-sync replica (acks=all), so a write is then on two brokers before it is acknowledged,
    and a topic keeps taking writes with one of three brokers down. Kafka's default of 1 would
    acknowledge a write only the leader holds, lost with it."""
    replicas = min(3, brokers)
    return replicas, {"min.insync.replicas": str(max(1, replicas - 1))} | (configs or {})


async def ensure_topics(
    conn: KafkaConnection,
    partitions: dict[str, int],
    configs: dict[str, str] | None = None,
) -> None:
    """Create the topics that do not exist yet, with the topic `configs` given and the
    replication `replication` chooses for the cluster's brokers."""
    admin_client = admin(conn)
    await admin_client.start()
    try:
        existing = set(await admin_client.list_topics())
        replicas, settings = replication(len((await admin_client.describe_cluster())["brokers"]), configs)
        new = [
            NewTopic(name, n, replicas, topic_configs=settings)
            for name, n in partitions.items()
            if name not in existing
        ]
        if new:
            try:
                response = await admin_client.create_topics(new)
            except TopicAlreadyExistsError:
                return  # created concurrently by another process
            _raise_topic_errors(response, "create", allowed=TopicAlreadyExistsError.errno)
    finally:
        await admin_client.close()


def _raise_topic_errors(response: Any, what: str, allowed: int | None = None) -> None:
    """aiokafka returns a topic's error in the admin response, not raised: a topic the broker did
    not create (no controller yet, a bad config) would pass for made, and the job that needs it
    fail on every attempt with UnknownTopicOrPartition. The first topic's error, raised."""
    for topic, code, *message in response.topic_errors:
        if code != 0 and code != allowed:
            error = errors.for_code(code)
            detail = f": {message[0]}" if message and message[0] else ""
            raise error(f"could not {what} topic {topic}{detail}")


async def ensure_partitions(conn: KafkaConnection, partitions: dict[str, int]) -> None:
    """Grow existing topics to at least the partitions given (Kafka never takes one away)."""
    admin_client = admin(conn)
    await admin_client.start()
    try:
        described = await admin_client.describe_topics(list(partitions))
        have = {t["topic"]: len(t["partitions"]) for t in described}
        grow = {name: NewPartitions(n) for name, n in partitions.items() if have.get(name, 0) < n}
        if grow:
            _raise_topic_errors(await admin_client.create_partitions(grow), "add partitions to")
    finally:
        await admin_client.close()


async def delete_topics(conn: KafkaConnection, names: Sequence[str]) -> None:
    """Delete those of `names` that exist."""
    admin_client = admin(conn)
    await admin_client.start()
    try:
        existing = set(await admin_client.list_topics())
        if doomed := [n for n in names if n in existing]:
            await admin_client.delete_topics(doomed)
    finally:
        await admin_client.close()


def producer(conn: KafkaConnection, **overrides: object) -> AIOKafkaProducer:
    """An idempotent producer: acks from all in-sync replicas, no duplicates on retry."""
    options = _connection(conn) | dict(
        enable_idempotence=True,
        acks="all",
        linger_ms=5,
        max_request_size=16 * 1024 * 1024,
        request_timeout_ms=int(KAFKA_DELIVERY_S * 1000),
    )
    options.update(overrides)
    return AIOKafkaProducer(**options)


def consumer(conn: KafkaConnection, *, group_id: str | None, **overrides: object) -> AIOKafkaConsumer:
    """A consumer that commits only what the caller says it has processed."""
    options = _connection(conn) | dict(
        group_id=group_id,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        fetch_max_bytes=64 * 1024 * 1024,
        max_partition_fetch_bytes=16 * 1024 * 1024,
    )
    options.update(overrides)
    return AIOKafkaConsumer(**options)


def positioned_consumer(conn: KafkaConnection, *, group_id: str | None, **overrides: object) -> AIOKafkaConsumer:
    """A consumer that reads on from positions it is given (`seek`), and never past a gap: a
    position out of its partition's log (records trimmed by retention before they were read, or
    a log shorter than the position) is not reset to the log's start or end, which would skip
    or repeat records silently, but an error `fetch` raises as `RecordsGone`."""
    return consumer(conn, group_id=group_id, **({"auto_offset_reset": "none"} | overrides))


class RecordsGone(RuntimeError):
    """A reader's position is not in its partition's log: the records from it were deleted
    (retention) before they were read, or the log ends before it (the topic was recreated).
    What the records were cannot be known, so a reader never skips them unless told to."""

    def __init__(self, partition: TopicPartition, position: int, start: int, end: int) -> None:
        self.partition = partition
        self.position = position
        self.start = start  # the partition's log start offset now
        self.end = end  # and its end
        where = f"{partition.topic}[{partition.partition}]"
        if position < start:
            what = (
                f"offsets {position}..{start - 1} ({start - position:,} records) were deleted before they "
                f"were read (the topic's retention); the log now starts at {start}"
            )
        else:
            what = f"the position {position} is past the log's end {end} (the topic was recreated or truncated)"
        super().__init__(f"records gone from {where}: {what}")

    @property
    def lost(self) -> int:
        """The offsets deleted before they were read (0 for a log that ends before the position)."""
        return max(0, self.start - self.position)


async def out_of_log(consumer: AIOKafkaConsumer, positions: Mapping[TopicPartition, int]) -> list[RecordsGone]:
    """Each of `positions` that is not in its partition's log now (the end included: nothing
    is lost at the end, the next record is just not written yet)."""
    if not positions:
        return []
    starts = await consumer.beginning_offsets(list(positions))
    ends = await consumer.end_offsets(list(positions))
    return [
        RecordsGone(tp, position, starts[tp], ends[tp])
        for tp, position in positions.items()
        if not starts[tp] <= position <= ends[tp]
    ]


async def records_gone(conn: KafkaConnection, positions: Mapping[str, Mapping[int, int]]) -> list[RecordsGone]:
    """`out_of_log` of positions by topic and partition (a checkpoint's), asked by a consumer of its own."""
    if not any(positions.values()):
        # Nothing to ask, and no consumer to stop at once: aiokafka's stop then awaits a task it
        # cancelled before it ever ran, and raises CancelledError into the caller.
        return []
    reader = consumer(conn, group_id=None)
    await reader.start()
    try:
        wanted = {TopicPartition(t, p): o for t, parts in positions.items() for p, o in parts.items()}
        return await out_of_log(reader, wanted)
    finally:
        await reader.stop()


async def fetch(
    consumer: AIOKafkaConsumer, *partitions: TopicPartition, timeout_ms: int, max_records: int | None = None
) -> dict[TopicPartition, list[Any]]:
    """`getmany` of a `positioned_consumer`: the records fetched, or `RecordsGone` for a
    partition whose position fell out of its log (the broker's OFFSET_OUT_OF_RANGE)."""
    try:
        return await consumer.getmany(*partitions, timeout_ms=timeout_ms, max_records=max_records)
    except OffsetOutOfRangeError as err:
        positions: dict[TopicPartition, int] = err.args[0]  # aiokafka's {partition: fetch offset}
        gone = await out_of_log(consumer, positions)
        if not gone:
            raise  # back in range meanwhile (a log only grows at its end): not a gap
        raise gone[0] from None


class OffsetBookkeeping:
    """A consumer's committed offset (what the lag metrics read) and, with `on_lag`, its lag,
    kept off the data path: each round is a task of its own, one at a time, at most every
    `every_s`. A broker that is away (restarting) holds up the bookkeeping, never the records
    or the job: a failed round is logged once and the next round tries again. Every 2 s: each
    round is a request or two to the broker (about 0.8 ms of its CPU each on a 2-core machine),
    and what reads the offsets (the coordinator's lag gauges) samples them every 5 s."""

    def __init__(
        self,
        consumer: AIOKafkaConsumer,
        partition: TopicPartition,
        *,
        every_s: float = 2.0,
        on_lag: Callable[[int], None] | None = None,
    ) -> None:
        self.consumer, self.partition, self.every_s, self.on_lag = consumer, partition, every_s, on_lag
        self._round: asyncio.Task[None] | None = None
        self._next = 0.0
        self._failing = False

    def after_records(self) -> None:
        """Start a round if one is due and none is running (call it after consuming records)."""
        now = time.monotonic()
        if now >= self._next and (self._round is None or self._round.done()):
            self._next = now + self.every_s
            self._round = asyncio.create_task(self._run(), name=f"offsets of {self.partition}")

    async def _run(self) -> None:
        try:
            await self.consumer.commit()
            if self.on_lag is not None:
                end = (await self.consumer.end_offsets([self.partition]))[self.partition]
                self.on_lag(end - await self.consumer.position(self.partition))
        except KafkaError as err:
            if not self._failing:
                logger.warning(f"offsets of {self.partition}: a round failed, retried in {self.every_s}s: {err!r}")
            self._failing = True
        else:
            if self._failing:
                logger.info(f"offsets of {self.partition}: committed again")
            self._failing = False

    async def close(self) -> None:
        """Cancel the round in flight (before the consumer stops)."""
        if self._round is not None and not self._round.done():
            self._round.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._round


# Every record a worker writes says which attempt of the job wrote it (see trillium.job.record): a
# reader restored from a checkpoint counts only the records of its own attempt's lineage.
ATTEMPT_HEADER = "trillium-attempt"
# The end of an epoch's batches on a partition is a record with an empty value and this header
# (value: the epoch number), so consumers know when an epoch is over without counting.
EPOCH_END_HEADER = "trillium-epoch-end"
# A gradient message of a step that is a publish cut: the PS shards export after applying it.
PUBLISH_HEADER = "trillium-publish"


def headers(attempt: int, *, epoch_end: int | None = None, publish: bool = False) -> list[tuple[str, bytes]]:
    out = [(ATTEMPT_HEADER, str(attempt).encode())]
    if epoch_end is not None:
        out.append((EPOCH_END_HEADER, str(epoch_end).encode()))
    if publish:
        out.append((PUBLISH_HEADER, b"1"))
    return out


def _header(headers: Sequence[tuple[str, bytes]] | None, name: str) -> int | None:
    for key, value in headers or ():
        if key == name:
            return int(value)
    return None


def epoch_end(headers: Sequence[tuple[str, bytes]] | None) -> int | None:
    """The epoch a marker record ends, or None for a data record."""
    return _header(headers, EPOCH_END_HEADER)


def publishes(headers: Sequence[tuple[str, bytes]] | None) -> bool:
    """Whether a gradient message's step is a publish cut."""
    return _header(headers, PUBLISH_HEADER) == 1


def attempt_of(headers: Sequence[tuple[str, bytes]] | None) -> int:
    """The attempt that wrote a record (0 for records written without the header)."""
    return _header(headers, ATTEMPT_HEADER) or 0
