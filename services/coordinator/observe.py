"""What the coordinator observes about the current job for /metrics and the REST views:
recent throughput, staleness per rank, Kafka consumer lag, and the PS shards' tables
(each shard's gRPC Stats, summed)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time

import grpc
import numpy as np
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from prometheus_client import Gauge

from trillium.config import GrpcCredentials, KafkaConnection
from trillium.job.record import JobRecord
from trillium.runtime.progress import JobProgress
from trillium.timeouts import OBSERVE_CALL_S
from trillium.train import progressive_validation
from trillium.wire import kafka, rpc
from trillium.wire.pb import embedding_pb2 as pb
from trillium.wire.pb import embedding_pb2_grpc as pb_grpc
from trillium.wire.state import aioredis

from .registry import WorkerRegistry
from .views import InputView, ProgressiveView, ShardTables, StreamView, TableStats, TablesView, WindowView

logger = logging.getLogger("trillium.coordinator.observe")

SAMPLES_PER_SEC = Gauge("trillium_job_samples_per_second", "samples trained per second, last few seconds", ["job"])
LOSS = Gauge("trillium_job_loss", "training loss of the last step, mean over the ranks", ["job"])
STALENESS_MAX = Gauge("trillium_job_staleness_max", "largest lookup staleness observed", ["job", "rank"])
STALENESS_BOUND = Gauge("trillium_job_staleness_bound", "the live staleness bound (-1: unbounded)", ["job"])
KAFKA_LAG = Gauge(
    "trillium_job_kafka_lag_messages", "messages of the job's topics not consumed yet", ["job", "topic", "partition"]
)
TABLE_ROWS = Gauge("trillium_job_table_rows", "embedding rows, all PS shards", ["job", "table"])
TABLE_BYTES = Gauge("trillium_job_table_memory_bytes", "embedding table memory, all PS shards", ["job", "table"])
TABLE_DISK_BYTES = Gauge(
    "trillium_job_table_disk_bytes", "embedding table spill files, all PS shards", ["job", "table"]
)
PROGRESSIVE_AUC = Gauge(
    "trillium_job_progressive_auc", "AUC of the latest samples, each scored before it was trained on", ["job"]
)
PROGRESSIVE_GAUC = Gauge(
    "trillium_job_progressive_gauc", "grouped AUC of the latest samples (evaluation.group_by)", ["job"]
)
PROGRESSIVE_LOGLOSS = Gauge(
    "trillium_job_progressive_logloss", "log loss of the latest samples, scored before training", ["job"]
)
TASK_PROGRESSIVE = {
    metric: Gauge(
        f"trillium_job_task_progressive_{metric}",
        f"a multi-task job's {metric} of each task's latest labelled samples, scored before training",
        ["job", "task"],
    )
    for metric in ("auc", "gauc", "logloss", "mse", "mae")
}
INPUT_LAG = Gauge("trillium_job_input_lag_messages", "a stream's messages not read yet", ["job", "topic", "partition"])
INPUT_LAG_SECONDS = Gauge(
    "trillium_job_input_lag_seconds", "event time behind now of the last message read", ["job", "topic", "partition"]
)
DEAD_LETTERS = Gauge("trillium_job_dead_letters", "messages sent to the dead-letter topic", ["job", "reason"])
INPUT_SKIPPED = Gauge(
    "trillium_job_input_skipped_records",
    "input records gone before they were read, skipped (data.on_gap: skip)",
    ["job", "topic", "partition"],
)
TRAIN_DELAY = Gauge(
    "trillium_job_train_delay_seconds", "from a click's event time to its sample trained", ["job", "quantile"]
)
CHECKPOINT_FAILURES = Gauge(
    "trillium_job_checkpoint_failures", "checkpoints abandoned (the job went on; its view says why)", ["job"]
)
GAUGES = (
    CHECKPOINT_FAILURES,
    SAMPLES_PER_SEC,
    LOSS,
    STALENESS_MAX,
    STALENESS_BOUND,
    KAFKA_LAG,
    TABLE_ROWS,
    TABLE_BYTES,
    TABLE_DISK_BYTES,
    PROGRESSIVE_AUC,
    PROGRESSIVE_GAUC,
    PROGRESSIVE_LOGLOSS,
    INPUT_LAG,
    INPUT_LAG_SECONDS,
    DEAD_LETTERS,
    INPUT_SKIPPED,
    TRAIN_DELAY,
    *TASK_PROGRESSIVE.values(),
)
# A job's series: a point a second while it trains, every other one dropped at this many
# (trillium.runtime.progress.JobProgress.append_series): enough for a plot of the whole job.
SERIES_POINTS = 2_000

STAT_FIELDS = tuple(f.name for f in pb.TableStats.DESCRIPTOR.fields if f.name != "table")  # views.TableStats's fields
# Throughput is measured over this window: long enough to smooth steps, short enough that
# a pause shows as 0 within seconds.
RATE_WINDOW_S = 5.0


async def progressive_view(redis: aioredis.Redis, job: JobRecord) -> ProgressiveView:
    summaries = await JobProgress(redis, job.id).progressive(job.config.topology.nn_ranks)
    merged = progressive_validation.merge(summaries)
    delays = np.concatenate([np.asarray(s.get("delays", []), np.float64) for s in summaries] or [np.zeros(0)])
    return ProgressiveView(
        samples=merged["samples"],
        scored=merged["scored"],
        auc=merged["auc"],
        gauc=merged["gauc"],
        logloss=merged["logloss"],
        windows=[WindowView(**w) for w in merged["windows"]],
        delay_seconds={"p50": float(np.percentile(delays, 50)), "p99": float(np.percentile(delays, 99))}
        if len(delays)
        else None,
        tasks=merged.get("tasks"),
    )


async def stream_view(registry: WorkerRegistry, job: JobRecord) -> StreamView | None:
    """What the job's data loaders report of their stream (None for a job reading files)."""
    if job.topics.dlq is None:
        return None
    view = StreamView(inputs=[], dead_letters={}, joined={}, events={})
    for w in await registry.workers():
        report = w.job_report(job.id, job.attempt) if w.role == "data_loader" else None
        stream = w.health.get("stream") if report is not None else None
        if not stream or stream.get("job") != [job.id, job.attempt]:
            continue  # none, or the counts of the attempt before (reported beside this one's first word)
        view.inputs += [InputView(**i) for i in stream["inputs"]]
        for field in ("dead_letters", "skipped", "joined", "events"):
            for key, n in stream.get(field, {}).items():
                getattr(view, field)[key] = getattr(view, field).get(key, 0) + n
        for task, counts in stream.get("joined_tasks", {}).items():
            mine = view.joined_tasks.setdefault(task, {})
            for key, n in counts.items():
                mine[key] = mine.get(key, 0) + n
    view.inputs.sort(key=lambda i: (i.topic, i.partition))
    return view


class TablesUnavailable(RuntimeError):
    """The tables cannot be read now; `conflict` when they do not belong to the job (yet)."""

    def __init__(self, message: str, conflict: bool) -> None:
        super().__init__(message)
        self.conflict = conflict


async def job_tables(
    registry: WorkerRegistry, job: JobRecord, current: JobRecord | None, creds: GrpcCredentials
) -> TablesView:
    """The job's embedding tables as its PS shards hold them now."""
    if current is None or current.id != job.id:
        raise TablesUnavailable(
            f"job {job.id} is not the current job: the PS shards no longer hold its tables", conflict=True
        )
    shards = {w.index: w for w in await registry.workers() if w.role == "embedding_ps"}
    addresses = []
    for i in range(job.config.topology.ps_shards):
        worker = shards.get(i)
        if worker is None or worker.status == "lost" or not worker.grpc_address:
            raise TablesUnavailable(f"embedding_ps-{i} is not reachable", conflict=False)
        # A shard's tables are this job's once it has set the job up (it keeps them afterwards).
        if worker.job_phase(job.id, job.attempt) in (None, "setting_up"):
            raise TablesUnavailable(f"embedding_ps-{i} has not set job {job.id} up yet", conflict=True)
        addresses.append(worker.grpc_address)
    try:
        replies = await asyncio.gather(*(_shard_stats(address, creds) for address in addresses))
    except grpc.aio.AioRpcError as err:
        raise TablesUnavailable(
            f"a PS shard did not answer: {err.code().name} {err.details()}", conflict=False
        ) from None
    total: dict[str, TableStats] = {}
    per_shard = []
    for address, reply in zip(addresses, replies, strict=True):
        tables = {t.table: TableStats(**{f: getattr(t, f) for f in STAT_FIELDS}) for t in reply.tables}
        per_shard.append(ShardTables(shard=reply.shard, grpc_address=address, tables=tables))
        for name, stats in tables.items():
            so_far = total.get(name, TableStats())
            total[name] = TableStats(**{f: getattr(so_far, f) + getattr(stats, f) for f in STAT_FIELDS})
    return TablesView(job_id=job.id, tables=total, shards=per_shard)


async def _shard_stats(address: str, creds: GrpcCredentials) -> pb.ShardStatsResponse:
    async with rpc.channel(address, creds) as channel:
        return await pb_grpc.EmbeddingParameterServerStub(channel).Stats(pb.ShardStatsRequest(), timeout=OBSERVE_CALL_S)


class KafkaLag:
    """Consumer lag of a job's consumer groups: end offset minus committed offset."""

    def __init__(self, conn: KafkaConnection) -> None:
        self.conn = conn
        self._admin: AIOKafkaAdminClient | None = None
        self._offsets: AIOKafkaConsumer | None = None

    async def _clients(self) -> tuple[AIOKafkaAdminClient, AIOKafkaConsumer]:
        if self._admin is None:
            admin = kafka.admin(self.conn, request_timeout_ms=int(OBSERVE_CALL_S * 1000))
            await admin.start()
            self._admin = admin
        if self._offsets is None:
            offsets = kafka.consumer(self.conn, group_id=None, request_timeout_ms=int(OBSERVE_CALL_S * 1000))
            await offsets.start()
            self._offsets = offsets
        return self._admin, self._offsets

    async def lag(self, job: JobRecord) -> dict[tuple[str, int], int]:
        topo = job.config.topology
        # The NN ranks consume samples and eval (group <job>.nn), the PS shards gradients (<job>.ps).
        groups = {
            f"{job.id}.nn": [
                TopicPartition(t, r) for t in (job.topics.samples, job.topics.eval) for r in range(topo.nn_ranks)
            ],
            f"{job.id}.ps": [TopicPartition(job.topics.gradients, s) for s in range(topo.ps_shards)],
        }
        admin, offsets = await self._clients()
        ends = await offsets.end_offsets([tp for tps in groups.values() for tp in tps])
        out = {}
        for group, tps in groups.items():
            committed = await admin.list_consumer_group_offsets(group, partitions=tps)
            for tp in tps:
                done = committed[tp].offset if tp in committed and committed[tp].offset >= 0 else 0
                out[(tp.topic, tp.partition)] = max(ends[tp] - done, 0)
        return out

    async def close(self) -> None:
        if self._admin is not None:
            await self._admin.close()
        if self._offsets is not None:
            await self._offsets.stop()
        self._admin = self._offsets = None


class Observer:
    """Samples the current job every few seconds into the gauges, and keeps the recent
    throughput the job view reports."""

    def __init__(
        self,
        redis: aioredis.Redis,
        registry: WorkerRegistry,
        kafka_conn: KafkaConnection,
        grpc_creds: GrpcCredentials,
        interval_s: float = 1.0,
    ) -> None:
        self.redis = redis
        self.registry = registry
        self.kafka = KafkaLag(kafka_conn)
        self.grpc_creds = grpc_creds
        self.interval_s = interval_s
        self._job_id: str | None = None
        self._samples: collections.deque[tuple[float, int]] = collections.deque()
        self._slow_at = 0.0

    def samples_per_sec(self, job_id: str) -> float | None:
        """Throughput over the last RATE_WINDOW_S while the job runs or is paused; None until
        two samples were taken, and for any other job."""
        if job_id != self._job_id or len(self._samples) < 2:
            return None
        (t0, s0), (t1, s1) = self._samples[0], self._samples[-1]
        return (s1 - s0) / (t1 - t0) if t1 > t0 else None

    async def tick(self, job: JobRecord | None) -> None:
        if job is None or job.id != self._job_id:
            for gauge in GAUGES:
                gauge.clear()
            self._samples.clear()
            self._job_id = job.id if job else None
        if job is None:
            return
        CHECKPOINT_FAILURES.labels(job.id).set(job.checkpoint_failures.count)
        if job.state not in ("running", "paused"):
            SAMPLES_PER_SEC.labels(job.id).set(0.0)
            self._samples.clear()
            return
        progress = JobProgress(self.redis, job.id)
        ranks = job.config.topology.nn_ranks
        now = time.monotonic()
        training = await progress.training(ranks)
        self._samples.append((now, training["samples"]))
        LOSS.labels(job.id).set(training["last_loss"])
        while now - self._samples[0][0] > RATE_WINDOW_S:
            self._samples.popleft()
        rate = self.samples_per_sec(job.id)
        SAMPLES_PER_SEC.labels(job.id).set(rate or 0.0)
        bound = await progress.bound()
        STALENESS_BOUND.labels(job.id).set(-1 if bound is None else bound)
        for rank, stats in (await progress.staleness(ranks)).items():
            STALENESS_MAX.labels(job.id, str(rank)).set(stats.max)
        scores = await progressive_view(self.redis, job)
        if scores.auc is not None:
            PROGRESSIVE_AUC.labels(job.id).set(scores.auc)
        if scores.gauc is not None:
            PROGRESSIVE_GAUC.labels(job.id).set(scores.gauc)
        if scores.logloss is not None:
            PROGRESSIVE_LOGLOSS.labels(job.id).set(scores.logloss)
        for task, metrics in (scores.tasks or {}).items():
            for metric, value in metrics.items():
                if metric in TASK_PROGRESSIVE and value is not None:
                    TASK_PROGRESSIVE[metric].labels(job.id, task).set(value)
        for quantile, seconds in (scores.delay_seconds or {}).items():
            TRAIN_DELAY.labels(job.id, quantile).set(seconds)
        stream = await stream_view(self.registry, job)
        for lag in stream.inputs if stream else []:
            INPUT_LAG.labels(job.id, lag.topic, str(lag.partition)).set(lag.lag_messages)
            if lag.lag_seconds is not None:
                INPUT_LAG_SECONDS.labels(job.id, lag.topic, str(lag.partition)).set(lag.lag_seconds)
        for reason, n in (stream.dead_letters if stream else {}).items():
            DEAD_LETTERS.labels(job.id, reason).set(n)
        for where, n in (stream.skipped if stream else {}).items():
            topic, _, partition = where.rpartition("/")
            INPUT_SKIPPED.labels(job.id, topic, partition).set(n)
        if job.state == "running":  # the job's series, for its report's plot
            await progress.append_series(
                [time.time(), training["samples"], scores.auc, training["last_loss"]], SERIES_POINTS
            )
        if now - self._slow_at >= 5 * self.interval_s:  # the ones that leave this process
            self._slow_at = now
            await self._slow(job)

    async def _slow(self, job: JobRecord) -> None:
        try:
            for (topic, partition), lag in (await self.kafka.lag(job)).items():
                KAFKA_LAG.labels(job.id, topic, str(partition)).set(lag)
        except Exception as exc:  # noqa: BLE001 (metrics are best effort; the broker may be away)
            logger.warning("kafka lag unavailable", extra={"error": str(exc)})
            with contextlib.suppress(Exception):
                await self.kafka.close()  # reconnect next time
        try:
            view = await job_tables(self.registry, job, current=job, creds=self.grpc_creds)
        except TablesUnavailable:
            return
        for table, stats in view.tables.items():
            TABLE_ROWS.labels(job.id, table).set(stats.rows)
            TABLE_BYTES.labels(job.id, table).set(stats.memory_bytes)
            TABLE_DISK_BYTES.labels(job.id, table).set(stats.disk_bytes)

    async def close(self) -> None:
        await self.kafka.close()
