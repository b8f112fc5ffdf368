"""The nn_worker service: rank r of the synchronous dense training.

Rank r reads its partition of the `samples` topic from its position (feed.py), asks the
embedding worker for each batch's embeddings ahead of time (the staleness bound decides how
far ahead the lookups really get), runs forward/backward of the job's model under DDP (step.py:
NCCL when every rank has a GPU of its own, gloo otherwise), and hands the gradients of the
embeddings back without waiting for them to be applied. After the last epoch it scores its
partition of the `eval` topic (evaluate.py); rank 0 gathers the scores and computes the metrics.

In each step's one all-reduce the ranks also agree (step.py) on the step's sample count, on
whether the job is paused, and on the newest checkpoint request: they hold or cut before the
next step. At a checkpoint cut — on request, every `every_steps`, after the last step — each rank hands its gradients to Kafka,
holds and says so in its health; the coordinator captures the PS shards and releases the
ranks; each rank then writes its progress (and rank 0 the dense model and optimizer) while
training goes on. A new attempt restores all of it from the checkpoint and seeks the samples
partition to the recorded position.

An attempt the rank abandons (the job recovers, stops, or the rank fails) may leave a
collective blocking the rank's torch thread: the process then exits to be started afresh
(`EXIT_RESTART`), as torchelastic restarts its workers, and joins the next attempt new.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from functools import partial
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from fastapi import HTTPException, status
from prometheus_client import Counter, Gauge
from torch.nn.parallel import DistributedDataParallel

from trillium.job.record import CheckpointRef, JobRecord, PartitionLineage
from trillium.models import Objective, build_dense_optimizer, build_model
from trillium.runtime.autobound import CALIBRATION_STEPS
from trillium.runtime.checkpoint import DENSE, CheckpointDir, CutReport, ReleaseRequest, rank_file
from trillium.runtime.model_store import DENSE as MODEL_DENSE
from trillium.runtime.model_store import EVAL, ModelPart, ModelStore, PublishCut, VersionFile, parts_name
from trillium.runtime.process import run_service
from trillium.runtime.progress import JobProgress, StalenessCounts, StepTiming
from trillium.runtime.service import Service, describe_error
from trillium.runtime.storage import StorageDir
from trillium.timeouts import COLLECTIVE_S
from trillium.train import progressive_validation
from trillium.wire import codec, rpc, state
from trillium.wire.pb import embedding_pb2 as pb
from trillium.wire.pb import embedding_pb2_grpc as pb_grpc

from . import evaluate, rendezvous
from .cuts import decide_cuts
from .embeddings import embeddings_of, gradients_request
from .feed import EpochEnd, Feed, GradientPusher, prefetch, push_window
from .rank_state import RankState
from .step import Control, Placement, Trainer, choose_backend, local_placement

logger = logging.getLogger("trillium.nn_worker")

SAMPLES = Counter("trillium_samples_trained_total", "samples trained", ["rank"])
STALENESS = Gauge("trillium_lookup_staleness", "staleness of the last lookup", ["rank"])
PROGRESS_EVERY_S = 0.25  # how often a rank tells Redis its totals (the job view, the pause tests)
FINAL_REPORT_S = 2.0  # how long a rank cancelled (stopped) waits to report its last progress
HOLD_TIMEOUT_S = 300.0  # a cut nobody releases (the coordinator is gone for good) is given up
DELAYS_REPORTED = 1000  # the latest event-to-trained delays a rank reports
COLLECTIVE_TIMEOUT = timedelta(seconds=COLLECTIVE_S)


@dataclass
class _Attempt:
    """One attempt of a job, as this rank runs it."""

    job: JobRecord
    trainer: Trainer
    stub: pb_grpc.EmbeddingWorkerStub
    progress: JobProgress
    state: RankState
    scores: progressive_validation.Scores | progressive_validation.TaskScores | None = None
    delays: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=DELAYS_REPORTED))
    next_scores: float = 0.0
    pusher: GradientPusher | None = None
    writes: list[asyncio.Task[None]] = field(default_factory=list)
    published: set[int] = field(default_factory=set)  # steps whose dense weights rank 0 wrote for a version
    streams: list[rpc.OrderedStream] = field(default_factory=list)  # to the embedding worker, closed at the end
    timing: dict[str, float] = field(default_factory=lambda: {"lookup_wait": 0.0, "step": 0.0, "cut": 0.0})
    timed_steps: int = 0  # the steps `timing` covers: this attempt's
    staleness: StalenessCounts = field(default_factory=StalenessCounts)  # training lookups' since the last report


def _bind(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_device(device)


class NNWorker(Service):
    role = "nn_worker"
    # Each job's process group starts threads of its own (gloo's): under glibc's
    # arenas (up to 8 a core) one more arena kept its high-water mark at nearly every job, about
    # 8 MB a job on a long-lived stack. Capped, they share two; glibc keeps tuning its thresholds.
    lean_malloc, malloc_mmap_threshold = True, None

    def __init__(self, settings) -> None:
        super().__init__(settings)
        # Ranks often share a host's cores with other ranks and services: one intra-op thread by default.
        torch.set_num_threads(self.settings.threads or 1)
        self.trained = 0
        # While the job is paused: the step this rank holds before (its progress reported), and
        # whether its feed has settled (every lookup ahead answered, no more to start).
        self.holding: dict[str, Any] | None = None
        self.placement: Placement | None = None
        self._held: dict[int, asyncio.Future[ReleaseRequest]] = {}
        self._released: set[int] = set()
        self._group_dirty = False  # a process group this process cannot tear down cleanly
        self._store: rendezvous.RedisStore | None = None  # the latest process group's

    async def start(self) -> None:
        self.redis = state.connect(self.settings.redis_url)

    async def stop(self) -> None:
        await self.redis.aclose()

    def health(self) -> dict[str, Any]:
        device = str(self.placement.device) if self.placement else None
        return {"rank": self.settings.index, "samples_trained": self.trained, "device": device, "holding": self.holding}

    async def left_attempt(self) -> None:
        if self._group_dirty and not self.stopping.is_set():
            logger.warning("left an attempt whose collectives may still block the torch thread")
            await self.restart_process()

    async def release(self, request: ReleaseRequest) -> None:
        held = self._held.get(request.step)
        if held is not None and not held.done():
            held.set_result(request)
        elif request.step not in self._released:
            raise HTTPException(status.HTTP_409_CONFLICT, f"{self.name} does not hold at step {request.step}")

    # ---- setup ---------------------------------------------------------------------------------------
    async def _process_group(self, job: JobRecord, thread: ThreadPoolExecutor) -> Any:
        """Join the attempt's process group, meeting the other ranks in Redis (rendezvous.py);
        returns the group for the control all-reduce."""
        rank, world = self.settings.index, job.config.topology.nn_ranks
        placement = self.placement
        assert placement is not None

        def join() -> Any:
            store = rendezvous.RedisStore.of_attempt(self.settings.redis_url, job.id, job.attempt, COLLECTIVE_TIMEOUT)
            # The group's C++ half calls back into this Python store: it must outlive the group.
            self._store = store
            idents = rendezvous.exchange_idents(store, rank, world, placement.ident)
            backend, why = choose_backend(idents)
            logger.info("collective backend", extra={"backend": backend, "why": why, "device": str(placement.device)})
            # torch names a group by how many this process began to form since its last world
            # group was torn down, and its keys in the store by that name: a rank kept after an
            # attempt whose group never formed (a peer cut off) would wait for keys its restarted
            # peer writes under another name, the store's whole timeout (bench/nemesis.py found
            # it). No group is left here, so every rank's first is "0".
            dist.distributed_c10d._world.group_count = 0
            dist.init_process_group(
                backend,
                store=store,
                rank=rank,
                world_size=world,
                timeout=COLLECTIVE_TIMEOUT,
                device_id=placement.device if backend == "nccl" else None,
            )
            self._group_dirty = True
            # Control words outside steps and gathered scores stay on the CPU: no GPU synchronization.
            return dist.new_group(backend="gloo") if backend == "nccl" else None

        return await asyncio.get_running_loop().run_in_executor(thread, join)

    async def _setup(self, job: JobRecord, thread: ThreadPoolExecutor) -> tuple[Trainer, RankState]:
        config = job.config
        rank, world = self.settings.index, config.topology.nn_ranks
        control_group = await self._process_group(job, thread)
        device = self.placement.device

        def build() -> Trainer:
            model = build_model(config).to(device)
            # DDP's constructor broadcasts rank 0's weights, waiting for every rank.
            ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
            optimizer = build_dense_optimizer(config.training.dense_optimizer, ddp.parameters())
            trainer = Trainer(
                thread,
                ddp,
                optimizer,
                device,
                world,
                rank,
                control_group,
                config.training.precision,
                objective=Objective.of(config),
            )
            if device.type == "cuda":  # the CPU has no kernels to load nor handles to create
                trainer.warm_up(config.training.batch_size, len(config.dense), config.embedding_shapes)
            return trainer

        loop = asyncio.get_running_loop()
        trainer = await loop.run_in_executor(thread, build)
        rank_state = RankState(epochs=config.training.epochs)
        source: CheckpointRef | None = job.restore or job.init_from
        if source is not None:
            ckdir = CheckpointDir(source.location)
            manifest = await asyncio.to_thread(ckdir.manifest)
            if manifest is None:
                raise RuntimeError(f"checkpoint {source.location} has no manifest")
            dense = await asyncio.to_thread(ckdir.read_verified, manifest, DENSE)
            await loop.run_in_executor(thread, trainer.load_dense, dense)
            if job.restore is not None:  # a recovery or resume also restores where the rank was
                raw = await asyncio.to_thread(ckdir.read_verified, manifest, rank_file(rank))
                rank_state = RankState(**json.loads(raw))
        return trainer, rank_state

    # ---- the job -------------------------------------------------------------------------------------
    async def run_job(self, job: JobRecord) -> None:
        config = job.config
        rank = self.settings.index
        self.placement = local_placement(rank)
        thread = ThreadPoolExecutor(1, thread_name_prefix="torch", initializer=_bind, initargs=(self.placement.device,))
        progress = JobProgress(self.redis, job.id, job.attempt)
        workers = await self.peers("embedding_worker", config.topology.embedding_workers)
        # A rank always talks to the same embedding worker: its pushes stay in step order.
        channel = rpc.channel(workers[rank % len(workers)]["grpc_address"], self.settings.grpc)
        streams: list[rpc.OrderedStream] = []
        clean = False
        try:
            trainer, rank_state = await self._setup(job, thread)
            run = _Attempt(job, trainer, pb_grpc.EmbeddingWorkerStub(channel), progress, rank_state, streams=streams)
            world = config.topology.nn_ranks
            run.scores = progressive_validation.of_job(config, max(config.training.progressive_samples // world, 1))
            self.trained = rank_state.trained
            await self._report_progress(run)
            self.set_job_phase("ready")
            await self.wait_until_running()
            await self._train(run)
            gathered = await self._evaluate(run)
            if rank == 0 and run.state.step > 0:
                await self._save_predictions(run, run.state.step - 1, gathered)
            await asyncio.gather(*run.writes)
            s = run.state
            result: dict[str, Any] = {
                "samples": s.trained,
                "steps": s.step,
                "train_seconds": s.train_seconds,
                "loss_curve": s.losses,
                "task_loss_curves": s.task_loss_curves(run.trainer.objective.names),
                "epochs": s.per_epoch,
                "seconds": run.timing,
                "attempt": job.attempt,
            }
            if rank == 0:
                result["eval"] = evaluate.summarize(gathered, run.job.config.evaluation.group_by, run.trainer.objective)
            await progress.set_rank_result(rank, result)
            await self._torch(run, run.trainer.finish)
            self._group_dirty = False
            clean = True
            self.set_job_phase("done")
        finally:
            for stream in streams:
                await stream.close()
            await channel.close()
            thread.shutdown(wait=clean)

    def _torch(self, run: _Attempt, fn, *args) -> asyncio.Future:
        return asyncio.get_running_loop().run_in_executor(run.trainer.thread, fn, *args)

    async def _evaluate(self, run: _Attempt) -> list[evaluate.Scored]:
        """Every rank's scores of the test split, gathered on every rank."""
        scores = await evaluate.score(
            self._feed(run, evaluation=True),
            lambda batch, embeddings: self._torch(run, run.trainer.scores, batch, embeddings),
            run.job.config.evaluation.group_by,
            run.trainer.objective,
        )
        return await self._torch(run, evaluate.gather, scores, run.trainer.control_group)

    @staticmethod
    def _stream(run: _Attempt, method) -> rpc.OrderedStream:
        stream = rpc.OrderedStream(method)
        run.streams.append(stream)
        return stream

    def _feed(self, run: _Attempt, *, evaluation: bool) -> Feed:
        """This rank's batches, each with its lookup asked ahead: the samples topic from the
        rank's position (fp16 embeddings on an fp16 wire), or the eval topic from its start, read
        once every step trained is applied (the tables as training left them)."""
        job, rank = run.job, self.settings.index
        lookups = self._stream(run, run.stub.LookupBatches)
        wire16 = job.config.training.wire_dtype == "fp16"
        if evaluation:
            topic, position, group_id = job.topics.eval, 0, None
        else:
            topic, position, group_id = job.topics.samples, run.state.position, f"{job.id}.nn"

        async def lookup(raw: bytes) -> pb.BatchLookupResponse:
            if evaluation:  # the tables as every step trained left them
                request = pb.BatchLookupRequest(batch=raw, attempt=job.attempt, training=False, applied=run.state.step)
                return await lookups(request)
            request = pb.BatchLookupRequest(batch=raw, attempt=job.attempt, training=True, fp16=wire16)
            response = await lookups(request)
            # Counted as it is answered (prefetched or not), as the worker answered it.
            run.staleness.add(response.staleness)
            return response

        return Feed(
            self.settings.kafka,
            topic,
            rank,
            position,
            PartitionLineage(job.lineage.get(topic, {}).get(rank)),
            job.attempt,
            lookup,
            ahead=prefetch(job.config, evaluation=evaluation),
            group_id=group_id,
        ).run()

    async def _report_progress(self, run: _Attempt, *, trained: bool = False) -> None:
        """The rank's progress, and its progressive scores once a second (they are larger) or
        when `trained`: the last steps' scores must not wait for a report that never comes."""
        s = run.state
        now = time.monotonic()
        if trained or now >= run.next_scores:
            run.next_scores = now + 1.0
            summary = run.scores.summary() | {"delays": list(run.delays)[-DELAYS_REPORTED:]}
            await run.progress.set_progressive(self.settings.index, summary)
        await run.progress.record_staleness(self.settings.index, run.staleness)
        await run.progress.set_training(
            self.settings.index,
            samples=s.trained,
            loss_sum=s.loss_sum,
            steps=s.step,
            epoch=s.epoch if s.epochs is None else min(s.epoch, max(s.epochs - 1, 0)),
            last_loss=s.losses[-1] if s.losses else None,
            timing=StepTiming(run.timed_steps, run.timing["lookup_wait"], run.timing["step"]),
        )

    async def _train(self, run: _Attempt) -> None:
        """Train the epochs left; cut for checkpoints on the way and after the last step."""
        job, s = run.job, run.state
        rank = self.settings.index
        checkpoint, publish = job.config.checkpoint, job.config.publish
        wire16 = job.config.training.wire_dtype == "fp16"
        auto_bound = job.config.training.staleness_bound == "auto"
        feed = self._feed(run, evaluation=False)
        run.pusher = GradientPusher(
            self._stream(run, run.stub.PushGradients).send, window=push_window(run.job.config)
        ).run()
        loop = asyncio.get_running_loop()
        clock = time.perf_counter
        next_report = loop.time()  # the first step is reported at once: the job view shows it going
        started = clock()
        # What the ranks agreed on in the last step (the first step's, before it: a collective of its own).
        control: Control | None = None
        try:
            while s.training():
                item = await feed.get()
                if isinstance(item, EpochEnd):
                    s.position, s.epoch = item.offset + 1, item.epoch + 1
                    continue
                batch = codec.decode_batch(item.raw)
                if control is None:
                    control = await self._torch(run, run.trainer.control, *self._heard())
                if control.paused:
                    await self._report_progress(run)  # the job view shows where it holds
                while control.paused:
                    settled = feed.settled
                    if settled:  # every lookup ahead answered: its staleness recorded before the rank says so
                        await run.progress.record_staleness(rank, run.staleness)
                    self.holding = {"step": s.step, "lookups_settled": settled}
                    if control.seq > s.seq and s.step > 0:
                        await self._cut(run, "request", control.seq)
                    await asyncio.sleep(0.2)
                    control = await self._torch(run, run.trainer.control, *self._heard())
                self.holding = None
                t0 = clock()
                response = await item.lookup
                t1 = clock()
                STALENESS.labels(str(rank)).set(response.staleness)
                result = await self._torch(run, run.trainer.step, batch, embeddings_of(response), *self._heard())
                grads, probs, control = result.grads, result.probs, result.control
                group_by = run.job.config.evaluation.group_by
                groups = None if group_by is None else batch.ids.first(group_by)
                run.scores.add(batch.labels, probs, batch.event_times, groups)
                if batch.event_times is not None and len(batch.event_times):  # how long after its event
                    # Never negative: another host's clock may run a little ahead of this one's.
                    run.delays.extend(
                        np.maximum(time.time() - batch.event_times[run.trainer.objective.positive(batch.labels)], 0.0)
                    )
                    s.event_time = max(s.event_time or 0.0, float(batch.event_times.max()))
                if batch.complete_through is not None:
                    s.complete_through = batch.complete_through
                run.timing["lookup_wait"] += t1 - t0
                run.timing["step"] += clock() - t1
                run.timed_steps += 1
                cuts = decide_cuts(
                    checkpoint, publish, control, step=s.step, served_checkpoint=s.seq, served_publish=s.publish_seq
                )
                push = gradients_request(response, grads, fp16=wire16)
                push.publish = cuts.publish is not None
                run.pusher.put(push)
                s.stepped(batch, item.offset + 1, result, run.trainer.objective.multitask)
                self.trained = s.trained
                SAMPLES.labels(str(rank)).inc(batch.batch_size)
                # An automatic bound is chosen (and checked) from whole calibration windows: the
                # coordinator hears of one as it ends, not up to a report period later.
                calibrated = auto_bound and run.timed_steps % CALIBRATION_STEPS == 0
                if calibrated or loop.time() >= next_report:
                    await self._report_progress(run)
                    next_report = loop.time() + PROGRESS_EVERY_S
                if cuts.publish is not None:
                    s.publish_seq = max(s.publish_seq, control.publish)
                    await self._publish_cut(run, cuts.publish)
                if cuts.checkpoint is not None:
                    await self._cut(run, *cuts.checkpoint)
            if checkpoint is not None and s.step > 0 and s.last_cut != s.step - 1:
                await self._cut(run, "final", s.seq)
            await run.pusher.join()  # every gradient handed over before evaluation reads the tables
            if publish is not None and s.step > 0:
                await self._publish_cut(run, "final")
        except asyncio.CancelledError:
            # A stop ends a continuous job's rank here: its last steps' scores still reach the job
            # view, within a bound (the attempt ends whatever Redis does).
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._report_progress(run, trained=True), FINAL_REPORT_S)
            raise
        finally:
            self.holding = None
            s.train_seconds += clock() - started
            await feed.stop()
            await run.pusher.stop()
        await self._report_progress(run, trained=True)

    def _heard(self) -> tuple[bool, int, int]:
        """What this rank tells the others in its control words: paused, and the newest checkpoint
        and model version requests."""
        job = self.job
        assert job is not None
        return self.job_is("paused"), job.checkpoint_seq, job.publish_seq

    async def _publish_cut(self, run: _Attempt, reason: str) -> None:
        """Say that this rank has passed a publish cut after the last step trained (without holding:
        services/coordinator/publish.py); rank 0 writes the dense weights of the version meanwhile."""
        job, s = run.job, run.state
        step = s.step - 1
        self.report_publish_cut(
            PublishCut(
                attempt=job.attempt,
                step=step,
                epoch=s.epoch,
                at=time.time(),
                reason=reason,
                event_time=s.event_time,
                complete_through=s.complete_through,
            )
        )
        if self.settings.index == 0 and step not in run.published:
            run.published.add(step)
            weights = await self._torch(run, run.trainer.dense_weights)
            run.writes.append(asyncio.create_task(self._write_dense(step, weights)))

    def _cut_files(self, step: int) -> StorageDir:
        """Where the files of the model version cut after `step` go."""
        job = self.job
        assert job is not None
        store = ModelStore.of(job.config, self.settings.shared_root)
        assert store is not None
        return store.parts(parts_name(job.id, job.attempt, step))

    async def _write_dense(self, step: int, weights: bytes) -> None:
        try:
            size, sha = await asyncio.to_thread(self._cut_files(step).write_bytes, MODEL_DENSE, weights)
            self.report_model_part(ModelPart(step=step, files=[VersionFile(name=MODEL_DENSE, bytes=size, sha256=sha)]))
        except Exception as err:  # noqa: BLE001 (the version is abandoned, not the job)
            logger.exception("writing the dense weights failed", extra={"step": step})
            self.report_model_part(ModelPart(step=step, error=describe_error(err)))

    async def _save_predictions(self, run: _Attempt, step: int, gathered: list[evaluate.Scored]) -> None:
        """The job's predictions for its test split at this cut, beside the cut's model files (rank 0)."""
        if run.job.config.publish is None:
            return
        try:
            await asyncio.to_thread(self._cut_files(step).write_bytes, EVAL, evaluate.in_batch_order(gathered))
        except Exception:  # noqa: BLE001 (the evaluation stands; only its saved predictions are missing)
            logger.exception("saving the predictions failed", extra={"step": step})

    async def _cut(self, run: _Attempt, reason: str, seq: int) -> None:
        """Hold at a checkpoint cut after the last step trained, until the coordinator releases us."""
        job, s = run.job, run.state
        rank = self.settings.index
        step = s.step - 1
        t0 = time.perf_counter()
        await run.pusher.join()  # the PS shards can apply everything up to the cut
        s.seq, s.last_cut = max(s.seq, seq), step
        dense = await self._torch(run, run.trainer.dense_state) if rank == 0 else None
        mine = json.dumps(asdict(s)).encode()
        await self._report_progress(run)
        held = asyncio.get_running_loop().create_future()
        self._held[step] = held
        self.report_cut(
            CutReport(
                attempt=job.attempt,
                step=step,
                epoch=s.epoch,
                at=time.time(),
                seq=seq,
                reason=reason,
                positions={job.topics.samples: {rank: s.position}},
            )
        )
        try:
            release = await asyncio.wait_for(held, HOLD_TIMEOUT_S)
        except TimeoutError:
            logger.error("checkpoint cut never released; going on without it", extra={"step": step})
            return
        finally:
            del self._held[step]
            self._released = {step}
            self.report_cut(None)
            run.timing["cut"] += time.perf_counter() - t0
        if release.location is not None:  # null: the coordinator abandoned the checkpoint
            metrics = None
            if release.evaluate:
                gathered = await self._evaluate(run)
                if rank == 0:
                    metrics = evaluate.summarize(gathered, run.job.config.evaluation.group_by, run.trainer.objective)
                    await self._save_predictions(run, step, gathered)
            write = asyncio.create_task(self._write_part(release.location, step, mine, dense, metrics))
            run.writes.append(write)
            if release.stop:
                await write
        if release.stop:
            # The job stops at this cut (a stop with a final checkpoint): no step may follow it.
            # The coordinator ends the attempt once the checkpoint is written or has failed.
            try:
                await asyncio.wait_for(asyncio.Event().wait(), HOLD_TIMEOUT_S)
            except TimeoutError:
                logger.error("the job did not stop after its final checkpoint; going on", extra={"step": step})

    async def _write_part(
        self, location: str, step: int, mine: bytes, dense: bytes | None, metrics: dict[str, Any] | None
    ) -> None:
        """Write this rank's part of the checkpoint (training goes on meanwhile) and report it."""
        ckdir = CheckpointDir(location)
        files = [(rank_file(self.settings.index), mine), *([(DENSE, dense)] if dense is not None else [])]
        writes = [(name, partial(asyncio.to_thread, ckdir.write_bytes, name, data)) for name, data in files]
        await self.write_part(step, writes, metrics=metrics)


def main() -> None:
    run_service(NNWorker)
