"""The data_loader service: reads the job's source, builds batches, and produces them to
Kafka — test batches to the `eval` topic first, then train batches to `samples`, partition
= the NN rank a batch is for — with an idempotent, acks=all producer. Every record carries
the job's attempt (see trillium.jobrecord).

Batch ids run on across epochs, and every epoch is padded with empty batches to a whole
number of steps, so all ranks take the same number of steps (DDP needs that) and a rank's
step is `batch_id // nn_ranks` everywhere. Malformed rows are counted, logged with file
and line, and quarantined to `<run_dir>/quarantine/<job>.jsonl`.

The loader writes one deterministic sequence of records per phase (the test split; then per
epoch its batches and an end marker per partition) and counts what it has produced of the
current phase. At a checkpoint cut it captures that position with how far it has written
each partition; a new attempt regenerates the phase and skips what was produced.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from aiokafka import TopicPartition

from trillium import codec, kafka
from trillium.batch import Batch, KeyedIds
from trillium.checkpoint import CaptureRequest, CaptureResult, CheckpointDir, PartFile, PartReport, loader_file
from trillium.data import BatchBuilder
from trillium.jobrecord import JobRecord
from trillium.service import Service, describe_error, run_service


def _empty_batch(like: Batch, batch_id: int, rank: int) -> Batch:
    keys = like.ids.keys
    return Batch(batch_id=batch_id, epoch=like.epoch, rank=rank,
                 ids=KeyedIds(keys=keys, values=np.zeros(0, np.uint64), lengths=np.zeros(0, np.int32)),
                 dense=np.zeros((0, like.dense.shape[1]), np.float32), labels=np.zeros(0, np.float32))


def numbered(batches: Iterator[Batch], first_id: int, ranks: int) -> Iterator[Batch]:
    """Renumber an epoch's batches from `first_id` and pad them to a multiple of `ranks`."""
    batch_id, last = first_id, None
    for batch in batches:
        last = dataclasses.replace(batch, batch_id=batch_id, rank=batch_id % ranks)
        yield last
        batch_id += 1
    while last is not None and batch_id % ranks:
        yield _empty_batch(last, batch_id, batch_id % ranks)
        batch_id += 1


@dataclass
class LoaderPosition:
    """How far a loader has produced its sequence (checkpointed as loader-<i>.json)."""

    phase: Literal["eval", "train", "done"] = "eval"
    epoch: int = 0  # of the train phase
    produced: int = 0  # records of the current phase (an epoch, in the train phase) produced
    first_id: int = 0  # the batch id of the epoch's first batch


@dataclass(frozen=True)
class _Record:
    topic: str
    partition: int
    value: bytes
    batch: Batch | None  # None for an epoch's end marker
    epoch_end: int | None = None


class DataLoader(Service):
    role = "data_loader"

    def __init__(self, settings) -> None:
        super().__init__(settings)
        self.counts: dict[str, Any] = {}
        self._lock = asyncio.Lock()  # held while a record is handed to the producer; a capture takes it
        self._producer = None
        self._position = LoaderPosition()
        self._ends: dict[tuple[str, int], int] = {}  # (topic, partition) -> offset of the next record
        self._captures: dict[int, CaptureResult] = {}

    def health(self) -> dict[str, Any]:
        return {"produced": self.counts}

    async def run_job(self, job: JobRecord) -> None:
        config = job.config
        ranks = config.topology.nn_ranks
        quarantine = self.settings.run_dir / "quarantine" / f"{job.id}.jsonl"
        quarantine.parent.mkdir(parents=True, exist_ok=True)
        self._position = await self._restore(job)
        self._captures = {}
        # A recovery re-reads rows it read before: quarantine them once.
        builder = BatchBuilder(config, quarantine=quarantine if job.restore is None else None)
        # Reading and encoding the source is CPU work: keep the event loop (heartbeats) free.
        await asyncio.to_thread(builder.split, "train")
        producer = kafka.producer(self.settings.kafka)
        await producer.start()
        try:
            partitions = [TopicPartition(t, r) for t in (job.topics.samples, job.topics.eval) for r in range(ranks)]
            # Where each partition ends now: what an earlier attempt wrote counts as written.
            self._ends = await self._end_offsets(partitions)
            self._producer = producer
            self.counts = {"train_batches": 0, "train_samples": 0, "eval_batches": 0, "eval_samples": 0}
            self.set_job_phase("ready")
            position = self._position
            if position.phase == "eval":
                batches = await asyncio.to_thread(lambda: list(numbered(builder.batches("test"), 0, ranks)))
                await self._produce(job, self._records(job.topics.eval, batches, 0, ranks), "eval")
                self._position = LoaderPosition(phase="train" if config.training.epochs else "done")
            while self._position.phase == "train":
                position = self._position
                batches = await asyncio.to_thread(lambda e=position.epoch, n=position.first_id: list(
                    numbered(builder.batches("train", e), n, ranks)))
                await self._produce(job, self._records(job.topics.samples, batches, position.epoch, ranks), "train")
                more = position.epoch + 1 < config.training.epochs
                self._position = LoaderPosition(phase="train" if more else "done", epoch=position.epoch + 1,
                                                first_id=position.first_id + len(batches))
            await producer.flush()
            self.counts["malformed_rows"] = builder.malformed
            self.set_job_phase("done")
            await asyncio.Event().wait()  # keep reporting "done" (and answering captures) until the job ends
        finally:
            self._producer = None
            await producer.stop()

    async def _end_offsets(self, partitions: list[TopicPartition]) -> dict[tuple[str, int], int]:
        consumer = kafka.consumer(self.settings.kafka, group_id=None)
        await consumer.start()
        try:
            ends = await consumer.end_offsets(partitions)
        finally:
            await consumer.stop()
        return {(tp.topic, tp.partition): offset for tp, offset in ends.items()}

    async def _restore(self, job: JobRecord) -> LoaderPosition:
        if job.restore is None:
            return LoaderPosition()
        ckdir = CheckpointDir(job.restore.location)
        manifest = await asyncio.to_thread(ckdir.manifest)
        if manifest is None:
            raise RuntimeError(f"checkpoint {job.restore.location} has no manifest")
        raw = await asyncio.to_thread(ckdir.read_verified, manifest, loader_file(self.settings.index))
        return LoaderPosition(**json.loads(raw))

    @staticmethod
    def _records(topic: str, batches: list[Batch], epoch: int, ranks: int) -> Iterator[_Record]:
        for batch in batches:
            yield _Record(topic, batch.rank, codec.encode_batch(batch), batch)
        for rank in range(ranks):
            yield _Record(topic, rank, b"", None, epoch_end=epoch)

    async def _produce(self, job: JobRecord, records: Iterator[_Record], kind: str) -> None:
        """Produce a phase's records, skipping those an earlier attempt's position says were produced."""
        producer = self._producer
        deliveries = []
        for i, record in enumerate(records):
            if i < self._position.produced:
                continue
            async with self._lock:
                future = await producer.send(record.topic, record.value, partition=record.partition,
                                             headers=kafka.headers(job.attempt, epoch_end=record.epoch_end))
                future.add_done_callback(lambda f, key=(record.topic, record.partition): self._delivered(key, f))
                deliveries.append(future)
                self._position.produced += 1
            if record.batch is not None:
                self.counts[f"{kind}_batches"] += 1
                self.counts[f"{kind}_samples"] += record.batch.batch_size
        await asyncio.gather(*deliveries)

    def _delivered(self, key: tuple[str, int], future: asyncio.Future) -> None:
        if not future.cancelled() and future.exception() is None:
            self._ends[key] = max(self._ends.get(key, 0), future.result().offset + 1)

    async def capture(self, request: CaptureRequest) -> CaptureResult:
        if request.step in self._captures:
            return self._captures[request.step]  # asked again (a restarted coordinator)
        job = self.job
        assert job is not None
        async with self._lock:
            if self._producer is None:
                raise RuntimeError(f"{self.name} is not producing job {job.id}")
            await self._producer.flush()
            written: dict[str, dict[int, int]] = {}
            for (topic, partition), end in self._ends.items():
                written.setdefault(topic, {})[partition] = end
            position = dataclasses.asdict(self._position)
        result = CaptureResult(written=written)
        self._captures[request.step] = result
        asyncio.create_task(self._write(request, json.dumps(position).encode()))
        return result

    async def _write(self, request: CaptureRequest, data: bytes) -> None:
        name = loader_file(self.settings.index)
        try:
            started = time.monotonic()
            size, sha = await asyncio.to_thread(CheckpointDir(request.location).write_bytes, name, data)
            self.report_part(PartReport(step=request.step, files=[PartFile(
                name=name, role=self.role, index=self.settings.index, bytes=size, sha256=sha,
                seconds=time.monotonic() - started)]))
        except Exception as err:  # noqa: BLE001 (the checkpoint fails, not the job)
            self.report_part(PartReport(step=request.step, error=describe_error(err)))


def main() -> None:
    run_service(DataLoader)
