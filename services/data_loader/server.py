"""The data_loader service: reads its share of the job's source, builds batches as it reads
(trillium.data.features: bounded memory), and produces them to Kafka — test batches to the `eval`
topic first, then train batches to `samples`, partition = the NN rank a batch is for — with an
idempotent, acks=all producer. Every record carries the job's attempt (see trillium.job.record).

Several loaders: loader i of N reads share i of the input (`trillium.data.sources`: whole files,
Parquet row groups or CSV byte ranges) and feeds NN ranks i, i + N, ... (round robin over its
ranks), so each rank's partition has one writer and stays in step order. Batch ids are
`step * nn_ranks + rank` everywhere, so a rank's step is `batch_id // nn_ranks`. All ranks
take the same number of steps in an epoch (DDP needs that): at the end of its share of an epoch
each loader says how many steps it took (Redis) and pads its ranks with empty batches to the
most any loader took. Malformed rows are counted, logged with file and line, and quarantined
to `<run_dir>/quarantine/<job>.jsonl`.

A loader writes one deterministic sequence of records per phase (the test split; then per
epoch its batches, the padding and an end marker per rank) and counts what it has produced of
the current phase. At a checkpoint cut it captures that position with how far it has written
each partition; a new attempt regenerates the phase and skips what was produced.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from aiokafka import TopicPartition
from fastapi import HTTPException, status

from trillium.data.features import DenseStats, Quarantine, dense_stats, epoch_batches, stats_from_data
from trillium.data.sources.files import expand
from trillium.job import JobConfig, KafkaData
from trillium.job.record import JobRecord
from trillium.job.trust import PathRoots
from trillium.runtime.checkpoint import FORMAT_VERSION, CaptureRequest, CaptureResult, CheckpointDir, loader_file
from trillium.runtime.memory import LOADER_MMAP_THRESHOLD, release_free_memory
from trillium.runtime.process import run_service
from trillium.runtime.progress import JobProgress
from trillium.runtime.service import Service
from trillium.wire import codec, kafka, state
from trillium.wire.batch import Batch

from .placement import Record, Share
from .stream import StreamLoader, upgrade_state

AHEAD = 64  # encoded batches a reader thread may hold before the producer takes them


def _confine(config: JobConfig, roots: PathRoots) -> None:
    """Every file the job's data globs match here under the operator's roots (trillium.job.trust),
    checked before a byte is read: the record's paths were checked as written (by the coordinator,
    and by every worker as it takes the job), not where their matches and links lead."""
    for split in ("train", "test"):
        paths = getattr(config.data, split, None)
        if paths is not None:
            roots.check_files(expand(paths, f"data.{split}", missing_ok=True), f"data.{split}")


@dataclass
class LoaderPosition:
    """How far a loader has produced its sequence (checkpointed as loader-<i>.json)."""

    phase: Literal["eval", "train", "done"] = "eval"
    epoch: int = 0  # of the train phase
    produced: int = 0  # records of the current phase (an epoch, in the train phase) produced
    first_step: int = 0  # the epoch's first step
    batches: int | None = None  # the share's batches of the phase (epoch), once all were produced
    stats: DenseStats = field(default_factory=dict)  # the normalization statistics in use


async def _threaded(make: Callable[[], Iterator[Any]]) -> AsyncIterator[Any]:
    """Iterate a blocking iterator on a thread of its own, AHEAD items ahead of the consumer."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue(maxsize=AHEAD)
    done = object()
    stop = threading.Event()

    def run() -> None:
        try:
            for item in make():
                if stop.is_set():
                    return
                asyncio.run_coroutine_threadsafe(queue.put(item), loop).result()
            asyncio.run_coroutine_threadsafe(queue.put(done), loop).result()
        except BaseException as err:  # noqa: BLE001 (handed to the consumer, which raises it)
            if not stop.is_set():
                asyncio.run_coroutine_threadsafe(queue.put(err), loop).result()

    thread = threading.Thread(target=run, name="reader", daemon=True)
    thread.start()
    try:
        while (item := await queue.get()) is not done:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        while not queue.empty():  # unblock a reader waiting for room
            queue.get_nowait()


class DataLoader(Service):
    role = "data_loader"
    lean_malloc = True  # its large buffers (states, checkpoint files) come and go: give them back
    malloc_mmap_threshold = LOADER_MMAP_THRESHOLD  # but its batch records are reused from the heap
    fresh_per_attempt = True  # a recovery restores its stream from the checkpoint anyway

    def __init__(self, settings) -> None:
        super().__init__(settings)
        self.counts: dict[str, Any] = {}
        self.produce_lock = asyncio.Lock()  # held while records are handed to the producer; a capture takes it
        self.stream: StreamLoader | None = None
        self._attempt = 0
        self._producer = None
        self._position = LoaderPosition()
        self._ends: dict[tuple[str, int], int] = {}  # (topic, partition) -> offset of the next record
        self._captures: dict[int, CaptureResult] = {}

    def health(self) -> dict[str, Any]:
        return {"produced": self.counts} | ({"stream": self.stream.health()} if self.stream is not None else {})

    async def run_job(self, job: JobRecord) -> None:
        config = job.config
        await asyncio.to_thread(_confine, config, self.roots)
        share = Share(config, self.settings.index)
        # The last attempt's stream (its joiner's events) goes before the saved one is parsed:
        # both alive at once made every recovery a new high-water mark of the heap.
        self._captures = {}
        self.stream = None
        saved = await self._restore(job)
        producer = kafka.producer(self.settings.kafka)
        await producer.start()
        try:
            topics = (
                [job.topics.samples] if isinstance(config.data, KafkaData) else [job.topics.samples, job.topics.eval]
            )
            # Where each partition ends now: what an earlier attempt wrote counts as written.
            self._ends = await self._end_offsets([TopicPartition(t, r) for t in topics for r in share.ranks])
            self._producer = producer
            self._attempt = job.attempt
            if isinstance(config.data, KafkaData):
                # The parsed state is as large as the joiner it rebuilds: not kept for the attempt's life.
                self.stream, saved = StreamLoader(self, job, share, saved), None
                release_free_memory()
                await self.stream.run(producer)  # until the job ends
            else:
                await self._files(job, share, LoaderPosition(**saved) if saved else LoaderPosition())
        finally:
            self._producer = None
            await producer.stop()

    async def _files(self, job: JobRecord, share: Share, position: LoaderPosition) -> None:
        """Produce the test split, then every epoch, from `position` on; then hold."""
        config = job.config
        quarantine_path = self.settings.run_dir / "quarantine" / f"{job.id}.jsonl"
        self._position = position
        if self._position.phase != "done" and not self._position.stats:
            # One pass over the whole train split (every loader gets the same); loader 0 reports
            # its malformed rows, as it is their first reading.
            reporter = Quarantine("train", quarantine_path) if self.settings.index == 0 else None
            self._position.stats = await asyncio.to_thread(dense_stats, config, quarantine=reporter)
        self.counts = {"train_batches": 0, "train_samples": 0, "eval_batches": 0, "eval_samples": 0}
        progress = JobProgress(self.redis, job.id)
        await progress.set_dense_stats(self.settings.index, self._position.stats)  # what a model version takes
        self.set_job_phase("ready")
        if self._position.phase == "eval":
            await self._produce(self._eval_records(job, share, quarantine_path), "eval")
            self._position = LoaderPosition(
                phase="train" if config.training.epochs else "done", stats=self._position.stats
            )
        while self._position.phase == "train":
            pos = self._position
            # The train split's rows were reported by the statistics pass when it read them.
            reports = pos.epoch == 0 and not stats_from_data(config)
            quarantine = Quarantine("train", quarantine_path) if reports else None
            steps = await self._produce(self._epoch_records(job, share, pos, quarantine, progress), "train")
            more = pos.epoch + 1 < config.training.epochs
            self._position = LoaderPosition(
                phase="train" if more else "done",
                epoch=pos.epoch + 1,
                first_step=pos.first_step + steps,
                stats=pos.stats,
            )
        await self._producer.flush()
        self.set_job_phase("done")
        await asyncio.Event().wait()  # keep reporting "done" (and answering captures) until the job ends

    async def start(self) -> None:
        self.redis = state.connect(self.settings.redis_url)

    async def stop(self) -> None:
        await self.redis.aclose()

    async def _end_offsets(self, partitions: list[TopicPartition]) -> dict[tuple[str, int], int]:
        consumer = kafka.consumer(self.settings.kafka, group_id=None)
        await consumer.start()
        try:
            ends = await consumer.end_offsets(partitions)
        finally:
            await consumer.stop()
        return {(tp.topic, tp.partition): offset for tp, offset in ends.items()}

    async def _restore(self, job: JobRecord) -> dict[str, Any] | None:
        """This loader's saved state in the attempt's checkpoint (None: a fresh start)."""
        if job.restore is None:
            return None
        ckdir = CheckpointDir(job.restore.location)
        manifest = await asyncio.to_thread(ckdir.manifest)
        if manifest is None:
            raise RuntimeError(f"checkpoint {job.restore.location} has no manifest")
        saved = json.loads(await asyncio.to_thread(ckdir.read_verified, manifest, loader_file(self.settings.index)))
        return (
            upgrade_state(saved, job.config, manifest.format)
            if manifest.format < FORMAT_VERSION and isinstance(job.config.data, KafkaData)
            else saved
        )

    def _batches(
        self, job: JobRecord, split: str, epoch: int, skip: int, quarantine: Quarantine | None
    ) -> Iterator[Batch]:
        config = job.config
        return epoch_batches(
            config,
            split,
            stats=self._position.stats,
            epoch=epoch,
            part=self.settings.index,
            parts=config.topology.data_loaders,
            skip=skip,
            quarantine=quarantine,
        )

    async def _eval_records(self, job: JobRecord, share: Share, quarantine_path) -> AsyncIterator[Record]:
        """The test split's batches (placed like train steps from 0) and an end marker per rank,
        from the position's record on."""
        pos = self._position
        produced = pos.produced
        if pos.batches is None:
            quarantine = Quarantine("test", quarantine_path)
            batches = produced
            async for record in _threaded(
                lambda: share.records(job.topics.eval, self._batches(job, "test", 0, produced, quarantine), produced, 0)
            ):
                yield record
                batches += 1
            pos.batches = batches
        tail = [Record(job.topics.eval, rank, b"", 0, epoch_end=0) for rank in share.ranks]
        for i, record in enumerate(tail, pos.batches):
            if i >= produced:
                yield record

    async def _epoch_records(
        self, job: JobRecord, share: Share, pos: LoaderPosition, quarantine: Quarantine | None, progress: JobProgress
    ) -> AsyncIterator[Record]:
        """An epoch's batches of our share, the padding to the epoch's steps and an end marker per
        rank, from the position's record on."""
        topic, loaders = job.topics.samples, job.config.topology.data_loaders
        produced = pos.produced
        if pos.batches is None:
            batches = produced
            async for record in _threaded(
                lambda: share.records(
                    topic, self._batches(job, "train", pos.epoch, produced, quarantine), produced, pos.first_step
                )
            ):
                yield record
                batches += 1
            pos.batches = batches
        await progress.set_loader_steps(pos.epoch, self.settings.index, share.steps(pos.batches))
        # Polls Redis: the other loaders say it there, and no event here tells us when.
        while (counts := await progress.loader_steps(pos.epoch, loaders)) is None:  # noqa: ASYNC110
            await asyncio.sleep(0.1)  # the other loaders are still reading their shares
        self._epoch_steps = steps = max(counts)
        tail = [
            Record(topic, pad.rank, codec.encode_batch(pad), 0)
            for pad in share.padding(pos.epoch, pos.batches, steps, pos.first_step)
        ]
        tail += [Record(topic, rank, b"", 0, epoch_end=pos.epoch) for rank in share.ranks]
        for i, record in enumerate(tail, pos.batches):
            if i >= produced:
                yield record

    async def send(self, topic: str, partition: int, value: bytes, epoch_end: int | None = None) -> asyncio.Future:
        """Hand a record to the producer, tagged with the attempt; call with `produce_lock` held
        (a capture takes it between records). Returns the delivery."""
        future = await self._producer.send(
            topic, value, partition=partition, headers=kafka.headers(self._attempt, epoch_end=epoch_end)
        )
        future.add_done_callback(lambda f, key=(topic, partition): self._delivered(key, f))
        return future

    async def _produce(self, records: AsyncIterator[Record], kind: str) -> int:
        """Produce a phase's records (those after the position's); returns the epoch's steps
        (train phase)."""
        deliveries = []
        i = self._position.produced  # the records before were produced by an earlier attempt
        self._epoch_steps = 0
        async for record in records:
            i += 1
            async with self.produce_lock:
                deliveries.append(await self.send(record.topic, record.partition, record.value, record.epoch_end))
                self._position.produced = i
            if record.epoch_end is None:
                self.counts[f"{kind}_batches"] += 1
                self.counts[f"{kind}_samples"] += record.samples
            if len(deliveries) >= 1024:  # bounded: a large split is not held in flight whole
                await asyncio.gather(*deliveries)
                deliveries.clear()
        await asyncio.gather(*deliveries)
        return self._epoch_steps

    def _delivered(self, key: tuple[str, int], future: asyncio.Future) -> None:
        if not future.cancelled() and future.exception() is None:
            self._ends[key] = max(self._ends.get(key, 0), future.result().offset + 1)

    async def capture(self, request: CaptureRequest) -> CaptureResult:
        if request.step in self._captures:
            return self._captures[request.step]  # asked again (a restarted coordinator)
        job = self.job
        assert job is not None
        async with self.produce_lock:
            if self._producer is None:
                raise HTTPException(status.HTTP_409_CONFLICT, f"{self.name} is not producing job {job.id}")
            await self._producer.flush()
            written: dict[str, dict[int, int]] = {}
            for (topic, partition), end in self._ends.items():
                written.setdefault(topic, {})[partition] = end
            if self.stream is not None:
                state, positions = self.stream.state(), self.stream.written_positions()
            else:
                state, positions = dataclasses.asdict(self._position), {}
        result = CaptureResult(written=written, positions=positions)
        self._captures[request.step] = result
        asyncio.create_task(self._write(request, state))
        return result

    async def _write(self, request: CaptureRequest, state: dict[str, Any]) -> None:
        async def write() -> tuple[int, str]:
            # A stream's state (its joiner's) may be large: encoded off the event loop.
            data = await asyncio.to_thread(lambda: json.dumps(state).encode())
            return await asyncio.to_thread(CheckpointDir(request.location).write_bytes, name, data)

        name = loader_file(self.settings.index)
        await self.write_part(request.step, [(name, write)])


def main() -> None:
    run_service(DataLoader)
