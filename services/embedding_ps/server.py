"""The embedding_ps service: one shard of the parameter server.

It holds the job's embedding tables in the native store, serves lookups over gRPC,
and applies the gradients of its Kafka partition (`gradients` topic, partition =
shard) with the native optimizers, recording per rank how far it has applied them —
the watermark the staleness bound is enforced against — and in its gradient ledger which
(step, rank) its state holds, applied by which attempt (trillium.runtime.ledger): a second
application of one is counted and logged, never silent.

Checkpoints: at a cut the coordinator asks the shard to capture its store. No gradient
is applied meanwhile (the ranks hold, and the capture takes the apply lock), so the copy
holds exactly the steps up to the cut; it is written while training goes on. When the shard
captured the job's newest complete checkpoint itself, the copy is a delta: only the rows changed
since (`checkpoint.full_every` bounds the chain); the ledger is copied with it and written beside
it, whole. A new attempt loads the shard's snapshot, the chain's full file and then each delta,
and its ledger (a warm start in a job with another number of shards, or a job resharded live,
loads every old shard's chain, keeping the IDs it owns; resharded, it merges their ledgers, and a
warm start, of another job, begins a ledger of its own), seeks the
gradients partition to the recorded position (resharded: to its end) and applies only what its
own attempt writes there.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import numpy as np
from aiokafka import TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, RecordsToDelete
from fastapi import HTTPException, status
from prometheus_client import REGISTRY, Counter, Gauge

import trillium_native
from trillium.job.record import TERMINAL, JobRecord
from trillium.runtime.checkpoint import (
    CaptureRequest,
    CaptureResult,
    CheckpointDir,
    Manifest,
    ledger_file,
    ps_file,
)
from trillium.runtime.forget import ShardForgetRequest, ShardForgetResult
from trillium.runtime.ledger import GradientLedger
from trillium.runtime.memory import PS_MMAP_THRESHOLD, PS_TRIM_THRESHOLD
from trillium.runtime.model_store import ExportRequest, ModelStore
from trillium.runtime.native_metrics import Counts, NativeHistograms
from trillium.runtime.process import run_service
from trillium.runtime.progress import JobProgress
from trillium.runtime.service import Service
from trillium.timeouts import KAFKA_TRIM_S
from trillium.wire import codec, kafka, rpc, state
from trillium.wire.kafka import KafkaConnection
from trillium.wire.pb import embedding_pb2 as pb

from .export import Exporter

# A gradient message as the shard holds it until its step is complete: its bytes (the arrays
# applied in place), its offset, whether it carries a publish cut.
_Message = tuple[bytes, int, bool]

logger = logging.getLogger("trillium.embedding_ps")

ROWS_APPLIED = Counter("trillium_ps_gradient_rows_applied_total", "embedding rows updated", ["shard"])
DUPLICATES = Counter(
    "trillium_ps_gradient_duplicates_total", "(step, rank) gradients applied to a state that held them", ["shard"]
)
GRADIENT_LAG = Gauge("trillium_ps_gradient_lag_messages", "gradient messages not yet applied", ["shard"])
TABLE_ROWS = Gauge("trillium_ps_table_rows", "rows stored", ["shard", "table"])
TABLE_BYTES = Gauge("trillium_ps_table_memory_bytes", "memory of a table", ["shard", "table"])
TABLE_DISK_BYTES = Gauge("trillium_ps_table_disk_bytes", "bytes of a table's spill files", ["shard", "table"])
TABLE_DISK_ROWS = Gauge("trillium_ps_table_disk_rows", "rows of a table on disk", ["shard", "table"])
# What a shard reports of a table (proto TableStats): the store's stats, a disk tier's zero without one.
TABLE_STAT_FIELDS = tuple(f.name for f in pb.TableStats.DESCRIPTOR.fields if f.name != "table")
NO_DISK_TIER = {"disk_rows": 0, "disk_bytes": 0, "disk_lookup_hits": 0}
# A job that takes no checkpoints fails on a lost process instead of recovering, so nothing reads
# a gradient record again once it is applied: the shard deletes its partition's applied records
# this often (the broker frees them a segment at a time), or a long job's gradients fill its disk.
TRIM_APPLIED_SECONDS = 10.0
STATS_SECONDS = 1.0  # how often the tables' stats in health reports are read


class EmbeddingPS(Service):
    role = "embedding_ps"
    # Fetches of gradients (MBs, of varying sizes) come and go: mapped, and given back when freed;
    # a step's buffers reuse the heap's pages. Its gRPC and native threads allocate at once on the
    # hot path: an arena each, as glibc does.
    lean_malloc, malloc_arenas = True, None
    malloc_mmap_threshold, malloc_trim_threshold = PS_MMAP_THRESHOLD, PS_TRIM_THRESHOLD
    fresh_per_attempt = True  # a recovery restores its tables from the checkpoint anyway

    def __init__(self, settings) -> None:
        self.grpc_server: trillium_native.ShardServer | None = None
        self._store: trillium_native.EmbeddingStore | None = None
        self._lookup_seconds = NativeHistograms(
            {"trillium_ps_lookup_seconds": ("PS lookup latency", self._read_lookup_seconds)},
            {"shard": str(settings.index)},
        )
        super().__init__(settings)
        self.disk_tier = False  # a table of the job spills to disk
        # The tables' stats as of the last second, for health reports: reading them takes each
        # internal shard's lock, which an update reading rows back from disk holds for long.
        self._stats: dict[str, dict[str, Any]] = {}
        self.applied_messages = 0
        self._apply_lock = asyncio.Lock()  # held while a gradient is applied; a capture takes it
        self._applied: dict[int, int] = {}  # rank -> last step applied
        self._ledger = GradientLedger()  # what the store's state holds (trillium.runtime.ledger)
        self._position = 0  # the gradients record to apply next
        self._captures: dict[int, CaptureResult] = {}  # this attempt's, by step
        self._exporter: Exporter | None = None  # this attempt's model exports, when the job publishes
        # Where the latest captures stood, by (attempt, step): a delta's starting points.
        self._marks: dict[tuple[int, int], trillium_native.CaptureMark] = {}

    def _read_lookup_seconds(self) -> Counts | None:
        return self.grpc_server.lookup_metrics() if self.grpc_server is not None else None

    @property
    def store(self) -> trillium_native.EmbeddingStore | None:
        """The job's tables, which the native gRPC server serves lookups from while set."""
        return self._store

    def serve(self, store: trillium_native.EmbeddingStore | None, job: JobRecord | None = None) -> None:
        """Serve `store`'s tables to the lookups of `job`'s attempt (None: none); the native server
        refuses an earlier attempt's, so a worker fenced out makes no row here."""
        self._store = store
        if self.grpc_server is None:
            return
        if store is None or job is None:
            self.grpc_server.clear()
        else:
            self.grpc_server.serve(store, job_id=job.id, attempt=job.attempt)

    async def start(self) -> None:
        # Lookups are served natively (trillium_native.ShardServer): no Python on their path.
        creds = self.settings.grpc
        loop = asyncio.get_running_loop()
        self.grpc_server = trillium_native.ShardServer(
            self.settings.host,
            self.settings.grpc_port,
            creds.token.get_secret_value(),
            name=self.name,
            shard=self.settings.index,
            # A table's disk tier failed a lookup: the shard's part of the job fails, reported
            # before its callers fail on the aborted stream, so the job's error names the disk.
            on_failure=lambda error: loop.call_soon_threadsafe(self.set_job_phase, "failed", f"OSError: {error}"),
            **rpc.native_server_options(creds),
        )
        REGISTRY.register(self._lookup_seconds)
        self.redis = state.connect(self.settings.redis_url)

    async def stop(self) -> None:
        REGISTRY.unregister(self._lookup_seconds)
        await asyncio.to_thread(self.grpc_server.stop)
        await self.redis.aclose()

    async def left_attempt(self) -> None:
        job = self.job
        if job is not None and self.settings.index >= job.config.topology.ps_shards:
            self.serve(None)  # resharded away: the job's rows are on the other shards now
            self._stats = {}

    def table_stats(self) -> dict[str, dict[str, Any]]:
        store = self.store
        if store is None:
            return {}
        stats = {t: store.stats(t) for t in store.tables()}
        for s in stats.values():
            if "disk_rows" not in s:
                s.update(NO_DISK_TIER, resident_rows=s["rows"])
        return stats

    async def _refresh_stats(self) -> None:
        while True:
            self._stats = await asyncio.to_thread(self.table_stats)
            await asyncio.sleep(STATS_SECONDS)

    def health(self) -> dict[str, Any]:
        stats = self._stats
        shard = str(self.settings.index)
        for table, s in stats.items():
            TABLE_ROWS.labels(shard, table).set(s["rows"])
            TABLE_BYTES.labels(shard, table).set(s["memory_bytes"])
            TABLE_DISK_BYTES.labels(shard, table).set(s["disk_bytes"])
            TABLE_DISK_ROWS.labels(shard, table).set(s["disk_rows"])
        return {
            "shard": self.settings.index,
            "applied_messages": self.applied_messages,
            "tables": {t: {k: s[k] for k in TABLE_STAT_FIELDS} for t, s in stats.items()},
        }

    async def _restore(
        self, job: JobRecord, store: trillium_native.EmbeddingStore
    ) -> tuple[int | None, int, GradientLedger]:
        """Load the attempt's checkpoint (or warm start); returns (gradients position, last step,
        ledger); a position of None: the partition's end (a checkpoint of another number of shards)."""
        source = job.restore or job.init_from
        if source is None:
            return 0, -1, GradientLedger()
        ckdir = CheckpointDir(source.location)
        manifest = await asyncio.to_thread(ckdir.manifest)
        if manifest is None:
            raise RuntimeError(f"checkpoint {source.location} has no manifest")
        shard, shards = self.settings.index, job.config.topology.ps_shards
        old_shards = manifest.config.topology.ps_shards
        if old_shards == shards:
            await self._load(ckdir, manifest, store, ps_file(shard), None)
        else:  # resharded (a warm start, a live reshard): every old shard's file holds some of our IDs
            for old in range(old_shards):
                await self._load(ckdir, manifest, store, ps_file(old), (shard, shards))
        if job.restore is None:
            return 0, -1, GradientLedger()  # a warm start: this job's gradients and steps begin afresh
        if old_shards != shards:
            # The old shards' positions are not this partition's: every record on it now is of an
            # earlier attempt (this one pushes none before every shard is ready), so start at its end.
            olds = [await asyncio.to_thread(ckdir.read_ledger, manifest, old) for old in range(old_shards)]
            return None, manifest.step, GradientLedger.merged(olds, manifest.step)
        ledger = await asyncio.to_thread(ckdir.read_ledger, manifest, shard)
        if ledger is None:
            ledger = GradientLedger.unknown(manifest.step)  # a checkpoint of before ledgers
        return manifest.positions[job.topics.gradients][shard], manifest.step, ledger

    @staticmethod
    async def _load(
        ckdir: CheckpointDir,
        manifest: Manifest,
        store: trillium_native.EmbeddingStore,
        name: str,
        owned: tuple[int, int] | None,
    ) -> None:
        """Load the checkpoint's file `name`: the full file of its chain, then each delta."""
        for link, _ in await asyncio.to_thread(ckdir.chain, manifest, name):
            with link.reading(name) as path:
                if owned is None:
                    await asyncio.to_thread(store.load, path)
                else:
                    await asyncio.to_thread(store.load, path, owned[0], owned[1])

    async def run_job(self, job: JobRecord) -> None:
        config = job.config
        shard = self.settings.index
        ranks = config.topology.nn_ranks
        self.serve(None)
        self._stats = {}
        self.disk_tier = any(table.disk is not None for table in config.tables.values())
        store = trillium_native.EmbeddingStore(threads=self.settings.threads)
        for name, table in config.tables.items():
            store.create_table(name, **table.store_kwargs(config.training.seed), **table.tier_kwargs())
        position, last_step, self._ledger = await self._restore(job, store)
        self._applied = {rank: last_step for rank in range(ranks)}
        self._captures = {}
        self._marks = {}
        models = ModelStore.of(config, self.settings.shared_root)
        self._exporter = Exporter(shard, models, self.report_model_part) if models is not None else None
        self.serve(store, job)
        progress = JobProgress(self.redis, job.id, job.attempt)
        await progress.set_applied_all(shard, ranks, last_step, self._ledger.dumps())
        consumer = kafka.positioned_consumer(self.settings.kafka, group_id=f"{job.id}.ps")
        partition = TopicPartition(job.topics.gradients, shard)
        consumer.assign([partition])
        await consumer.start()
        if position is None:
            position = (await consumer.end_offsets([partition]))[partition]
        self._position = position
        consumer.seek(partition, position)
        # A step's updates, by rank, until every rank's has arrived (see _apply_steps).
        pending: dict[int, dict[int, _Message]] = {}
        next_step = last_step + 1
        self.set_job_phase("ready")
        # Offsets and lag are bookkeeping, not on the training path: every 2 s, beside it.
        bookkeeping = kafka.OffsetBookkeeping(consumer, partition, on_lag=GRADIENT_LAG.labels(str(shard)).set)
        loop = asyncio.get_running_loop()
        trim = _AppliedTrim(self.settings.kafka, partition) if config.checkpoint is None else None
        stats = asyncio.create_task(self._refresh_stats())
        try:
            while True:
                records = (await kafka.fetch(consumer, partition, timeout_ms=200, max_records=64)).get(partition, [])
                complete: list[tuple[int, dict[int, _Message]]] = []
                for record in records:
                    if kafka.attempt_of(record.headers) != job.attempt:
                        continue  # in flight when an earlier attempt was abandoned
                    message_ranks, step = codec.gradients_meta(record.value)
                    entry = (record.value, record.offset, kafka.publishes(record.headers))
                    for rank in message_ranks:  # an embedding worker's message holds its ranks' gradients
                        pending.setdefault(step, {})[rank] = entry
                    next_step = _take_complete(pending, next_step, ranks, complete)
                if complete:
                    await self._apply_steps(store, complete, progress)
                if records:
                    bookkeeping.after_records()
                if trim is not None:
                    await trim.behind(self._position, loop.time())
        finally:
            stats.cancel()
            await bookkeeping.close()
            with contextlib.suppress(Exception):
                await consumer.stop()
            if trim is not None:
                await trim.close()

    async def export(self, request: ExportRequest) -> None:
        job, store = self.job, self.store
        assert job is not None and store is not None
        if self._exporter is None:
            raise HTTPException(status.HTTP_409_CONFLICT, f"job {job.id} publishes nothing")
        async with self._apply_lock:
            off = {rank: step for rank, step in self._applied.items() if step != request.step}
            if off:
                raise HTTPException(
                    status.HTTP_409_CONFLICT, f"{self.name} is not at step {request.step}: last applied {off}"
                )
            await self._export(store, request.step)

    async def _export(self, store: trillium_native.EmbeddingStore, step: int) -> None:
        """Capture the cut after `step` (the caller holds gradient application) and write it meanwhile."""
        job, exporter = self.job, self._exporter
        assert job is not None and exporter is not None
        # The newest version the coordinator committed, from the record itself: the heartbeat's copy
        # may be a second old, and a delta needs the base committed since.
        if (raw := await self.redis.get(state.job_key(job.id, "record"))) is not None:
            job = JobRecord.model_validate_json(raw)
        captured = await asyncio.to_thread(exporter.capture, store, job, step)
        if captured is not None:
            exporter.write(job, step, captured)

    async def forget(self, request: ShardForgetRequest) -> ShardForgetResult:
        """Remove rows from the live store, between two gradient applications. The store stays the
        job's after its last attempt ends (until the next job's first): a stopped job's rows too."""
        job, store = self.job, self.store
        if job is None or store is None or job.id != request.job_id:
            return ShardForgetResult(held=False)
        # The record itself, not the heartbeat's copy: rows forgotten under a running attempt
        # would come back with its next gradients and break its ledger.
        raw = await self.redis.get(state.job_key(job.id, "record"))
        live = JobRecord.model_validate_json(raw).state if raw is not None else None
        if live is not None and live not in TERMINAL:
            raise HTTPException(status.HTTP_409_CONFLICT, f"job {job.id} is {live}: a forget waits until it has ended")
        if request.table not in store:
            raise HTTPException(status.HTTP_422_UNPROCESSABLE_ENTITY, f"job {job.id} has no table {request.table!r}")
        ids = np.asarray(request.ids, dtype=np.uint64)
        async with self._apply_lock:
            removed = await asyncio.to_thread(store.forget, request.table, ids)
        logger.info("forgot", extra={"job": job.id, "table": request.table, "asked": len(ids), "removed": removed})
        return ShardForgetResult(held=True, removed=removed)

    async def capture(self, request: CaptureRequest) -> CaptureResult:
        if request.step in self._captures:
            return self._captures[request.step]  # asked again (a restarted coordinator)
        job = self.job
        assert job is not None and self.store is not None
        async with self._apply_lock:
            off = {rank: step for rank, step in self._applied.items() if step != request.step}
            if off:
                raise HTTPException(
                    status.HTTP_409_CONFLICT,
                    f"{self.name} is not at the cut of step {request.step}: last applied {off}",
                )
            started = time.monotonic()
            snapshot = await asyncio.to_thread(self.store.capture, self._marks.get(request.base))
            ledger = self._ledger.copy()  # of the state just captured
            result = CaptureResult(positions={job.topics.gradients: {self.settings.index: self._position}})
        # The newest complete checkpoint's mark and this one's: the next base is one of them.
        self._marks = {k: m for k, m in self._marks.items() if k == request.base}
        self._marks[(job.attempt, request.step)] = snapshot.mark
        delta_of = request.base[1] if snapshot.delta and request.base is not None else None
        logger.info(
            "captured",
            extra={
                "step": request.step,
                "rows": snapshot.rows,
                "delta_of": delta_of,
                "seconds": round(time.monotonic() - started, 3),
            },
        )
        self._captures[request.step] = result
        asyncio.create_task(self._write(request, snapshot, ledger, delta_of))
        return result

    async def _write(
        self,
        request: CaptureRequest,
        snapshot: trillium_native.StoreCapture,
        ledger: GradientLedger,
        delta_of: int | None,
    ) -> None:
        """Write a captured store and its ledger into the checkpoint (training goes on meanwhile)
        and report them."""
        ckdir = CheckpointDir(request.location)

        async def write() -> tuple[int, str]:
            with ckdir.writing(name) as path:
                return await asyncio.to_thread(snapshot.write, path)

        async def write_ledger() -> tuple[int, str]:
            return await asyncio.to_thread(ckdir.write_bytes, ledger_file(self.settings.index), ledger.dumps().encode())

        name = ps_file(self.settings.index)
        deltas = {name: delta_of} if delta_of is not None else None
        try:
            await self.write_part(
                request.step, [(name, write), (ledger_file(self.settings.index), write_ledger)], deltas=deltas
            )
        finally:
            snapshot.release()  # a failed write frees its copy too

    async def _apply_steps(
        self,
        store: trillium_native.EmbeddingStore,
        steps: list[tuple[int, dict[int, _Message]]],
        progress: JobProgress,
    ) -> None:
        """Apply the steps a fetch completed, in order: each step's gradients of every rank as one
        optimizer update per table, their sum taken in rank order — a synchronous step is one
        update with the step's whole gradient (as one process training the ranks' batches
        together would), the same however the ranks' messages interleaved: synchronous training
        is repeatable. The steps share one trip to the store and one announcement; a step the
        ranks flagged as a publish cut ends a group, and is exported before the next is applied."""
        while steps:
            cut = next((i for i, (_, u) in enumerate(steps) if any(p for _, _, p in u.values())), len(steps) - 1)
            group, steps = steps[: cut + 1], steps[cut + 1 :]
            last, updates = group[-1]
            messages = [_messages(u) for _, u in group]
            ordered = [[message for message, _, _ in step] for step in messages]
            async with self._apply_lock:
                # On the loop, as a lookup is: an update in RAM takes less than a hop to a worker
                # thread and back. One that reads rows back from a disk tier may wait on the disk.
                rows = (
                    await asyncio.to_thread(self._apply, store, ordered)
                    if self.disk_tier
                    else self._apply(store, ordered)
                )
                for rank in updates:
                    self._applied[rank] = last
                for step, by_rank in group:
                    if again := self._ledger.record(progress.attempt, step, sorted(by_rank)):
                        DUPLICATES.labels(str(self.settings.index)).inc(len(again))
                        logger.error("gradients applied again", extra={"step": step, "ranks": again})
                ledger = self._ledger.dumps()
                self._position = max(offset for _, u in group for _, offset, _ in u.values()) + 1
                if self._exporter is not None and any(publish for _, _, publish in updates.values()):
                    await self._export(store, last)
            ROWS_APPLIED.labels(str(self.settings.index)).inc(rows)
            self.applied_messages += sum(len(step) for step in messages)
            await progress.set_applied_all(self.settings.index, len(updates), last, ledger)

    @staticmethod
    def _apply(store: trillium_native.EmbeddingStore, steps: list[list[bytes]]) -> int:
        # Each step's messages in rank order, one optimizer update per table of them all: their
        # arrays read in place and applied natively (duplicate IDs summed in this order).
        return trillium_native.apply_gradients(store, steps)


def _take_complete(
    pending: dict[int, dict[int, Any]], next_step: int, ranks: int, complete: list[tuple[int, dict[int, Any]]]
) -> int:
    """Move the steps every rank's gradients have arrived for from `pending` to `complete`, in step
    order and none skipped: a step after a missing one waits for it. An embedding worker answers
    a rank's push once it is durable and sends the next meanwhile, so a step whose send failed
    can be followed by later ones on the topic; the attempt fails on that error, and its shard
    must not apply past the hole meanwhile (nor export a version with it). A step before
    `next_step` (sent again) is taken, for the ledger to count. Returns the next step to apply."""
    while (first := min(pending, default=None)) is not None and first <= next_step and len(pending[first]) == ranks:
        complete.append((first, pending.pop(first)))
        next_step = max(next_step, first + 1)
    return next_step


def _messages(step: dict[int, _Message]) -> list[_Message]:
    """A step's messages by rank, each once (one holds the gradients of every rank an embedding
    worker serves), in rank order."""
    return list({id(entry): entry for _, entry in sorted(step.items())}.values())


class _AppliedTrim:
    """Deletes a checkpoint-less job's applied gradient records (see TRIM_APPLIED_SECONDS)."""

    def __init__(self, conn: KafkaConnection, partition: TopicPartition) -> None:
        self.conn, self.partition = conn, partition
        self._admin: AIOKafkaAdminClient | None = None
        self._trimmed = 0  # the partition's first offset as far as this shard knows
        self._next = 0.0

    async def behind(self, position: int, now: float) -> None:
        if now < self._next or position <= self._trimmed:
            return
        self._next = now + TRIM_APPLIED_SECONDS
        try:
            if self._admin is None:
                self._admin = kafka.admin(self.conn, request_timeout_ms=int(KAFKA_TRIM_S * 1000))
                await self._admin.start()
            await self._admin.delete_records({self.partition: RecordsToDelete(before_offset=position)})
        except Exception as err:  # noqa: BLE001 (a broker away now: the next try deletes these too)
            logger.warning("applied gradients not trimmed", extra={"before": position, "error": str(err)})
            await self.close()
        else:
            self._trimmed = position

    async def close(self) -> None:
        if self._admin is not None:
            admin, self._admin = self._admin, None
            with contextlib.suppress(Exception):
                await admin.close()


def main() -> None:
    run_service(EmbeddingPS)
