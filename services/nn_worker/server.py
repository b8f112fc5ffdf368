"""The nn_worker service: rank r of the synchronous dense training.

Rank r reads its partition of the `samples` topic, asks the embedding worker for each
batch's embeddings ahead of time (the staleness bound decides how far ahead the lookups
really get), runs forward/backward of the job's model under DDP (gloo on CPU, NCCL on
GPU: the dense gradients are all-reduced every step), and hands the gradients of the
embeddings back without waiting for them to be applied. After the last epoch it scores
its partition of the `eval` topic; rank 0 gathers the scores and computes the metrics.

Loss scaling: each rank's loss is `R * sum(losses of its batch) / samples in the step`,
so DDP's gradient average is the gradient of the mean loss over the whole step; the
embedding gradients are divided by R for the same reason. With one rank this is plain
mean-loss SGD, which the golden test compares against a single-process reference.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from aiokafka import TopicPartition
from prometheus_client import Counter, Gauge
from torch.nn.parallel import DistributedDataParallel

from trillium import codec, kafka, metrics, rpc, state
from trillium.job import JobRecord
from trillium.models import build_dense_optimizer, build_model
from trillium.pb import embedding_pb2 as pb
from trillium.pb import embedding_pb2_grpc as pb_grpc
from trillium.progress import JobProgress
from trillium.service import Service, run_service

logger = logging.getLogger("trillium.nn_worker")

SAMPLES = Counter("trillium_samples_trained_total", "samples trained", ["rank"])
STALENESS = Gauge("trillium_lookup_staleness", "staleness of the last lookup", ["rank"])
# Lookups requested ahead of the step being trained; the embedding worker holds back any
# that would exceed the staleness bound, so this only caps the memory in flight.
PREFETCH = 8
_EPOCH_END = object()


def _device(rank: int) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


class NNWorker(Service):
    role = "nn_worker"

    def __init__(self, settings) -> None:
        super().__init__(settings)
        # Ranks share the machine's cores in the local stack; one intra-op thread each by default.
        torch.set_num_threads(int(os.environ.get("TRILLIUM_TORCH_THREADS", "1")))
        self.trained = 0

    async def start(self) -> None:
        self.redis = state.connect(self.settings.redis_url)

    async def stop(self) -> None:
        await self.redis.aclose()

    def health(self) -> dict[str, Any]:
        return {"rank": self.settings.index, "samples_trained": self.trained, "device": str(_device(self.settings.index))}

    # ---- setup -------------------------------------------------------------------------
    async def _init_process_group(self, job: JobRecord, progress: JobProgress, device: torch.device) -> None:
        rank, world = self.settings.index, job.config.topology.nn_ranks
        timeout = timedelta(minutes=10)
        if rank == 0:
            store = await asyncio.to_thread(dist.TCPStore, self.advertised_host, 0, world, True, timeout,
                                            wait_for_workers=False)
            await progress.set_rendezvous(f"{self.advertised_host}:{store.port}")
        else:
            while (address := await progress.rendezvous()) is None:
                await asyncio.sleep(0.2)
            host, port = address.rsplit(":", 1)
            store = await asyncio.to_thread(dist.TCPStore, host, int(port), world, False, timeout)
        backend = "nccl" if device.type == "cuda" else "gloo"
        await asyncio.to_thread(dist.init_process_group, backend, store=store, rank=rank, world_size=world,
                                timeout=timeout)

    # ---- the job -----------------------------------------------------------------------
    async def run_job(self, job: JobRecord) -> None:
        config = job.config
        rank, world = self.settings.index, config.topology.nn_ranks
        device = _device(rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        progress = JobProgress(self.redis, job.id)
        self.trained = 0
        workers = await self.peers("embedding_worker", config.topology.embedding_workers)
        # A rank always talks to the same embedding worker: its pushes stay in step order.
        channel = rpc.channel(workers[rank % len(workers)]["grpc_address"], self.settings.grpc)
        stub = pb_grpc.EmbeddingWorkerStub(channel)
        await self._init_process_group(job, progress, device)
        try:
            # DDP's constructor broadcasts the weights, waiting for every rank: off the event loop.
            model = build_model(config).to(device)
            ddp = await asyncio.to_thread(DistributedDataParallel, model,
                                          device_ids=[device.index] if device.type == "cuda" else None)
            optimizer = build_dense_optimizer(config.training.dense_optimizer, ddp.parameters())
            self.set_job_phase("ready")
            # Train only once the job runs: it may still read "submitted" here, when its heartbeat
            # came before the coordinator's next tick, and the embedding workers may not be ready.
            while self.job is not None and self.job.state in ("submitted", "starting"):
                await asyncio.sleep(0.05)
            started = time.perf_counter()
            losses, per_epoch, timing = await self._train(job, stub, ddp, optimizer, device, progress)
            train_s = time.perf_counter() - started
            scores = await self._evaluate(job, stub, model, device)
            gathered: list[Any] = [None] * world
            await asyncio.to_thread(dist.all_gather_object, gathered, scores)
            result: dict[str, Any] = {"samples": self.trained, "steps": len(losses), "train_seconds": train_s,
                                      "loss_curve": losses, "epochs": per_epoch, "seconds": timing}
            if rank == 0:
                labels = np.concatenate([g[0] for g in gathered])
                probs = np.concatenate([g[1] for g in gathered])
                result["eval"] = {"auc": metrics.auc(labels, probs), "logloss": metrics.logloss(labels, probs),
                                  "samples": int(len(labels))}
            await progress.set_rank_result(rank, result)
            self.set_job_phase("done")
        finally:
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
            await channel.close()

    async def _feed(self, job: JobRecord, topic: str, stub, queue: asyncio.Queue, epochs: int, training: bool) -> None:
        """Read this rank's partition in order; start each batch's lookup as soon as it arrives."""
        consumer = kafka.consumer(self.settings.kafka, group_id=f"{job.id}.nn")
        partition = TopicPartition(topic, self.settings.index)
        consumer.assign([partition])
        await consumer.start()
        try:
            ended = 0
            while ended < epochs:
                records = (await consumer.getmany(partition, timeout_ms=500)).get(partition, [])
                for record in records:
                    if kafka.epoch_end(record.headers) is not None:
                        ended += 1
                        await queue.put(_EPOCH_END)
                        continue
                    lookup = asyncio.ensure_future(stub.LookupBatch(pb.BatchLookupRequest(batch=record.value,
                                                                                          training=training)))
                    await queue.put((record.value, lookup))
                if records:
                    await consumer.commit()
        finally:
            await consumer.stop()

    @staticmethod
    def _embeddings(response: pb.BatchLookupResponse) -> list[np.ndarray]:
        # Copies: torch wants writable arrays, and fp16 wire values become float32.
        return [np.array(codec.unpack_array(s.values.data), dtype=np.float32) for s in response.slots]

    async def _train(self, job: JobRecord, stub, ddp, optimizer, device: torch.device,
                     progress: JobProgress) -> tuple[list[float], list[dict[str, float]], dict[str, float]]:
        """Train every epoch; returns the loss of each step, per epoch the samples trained
        and the sum of their labels (what proves each sample was trained once), and where
        the time went: waiting for embeddings, in the step (all-reduce included), waiting
        for the last gradients to be handed over."""
        config = job.config
        rank, world = self.settings.index, config.topology.nn_ranks
        queue: asyncio.Queue = asyncio.Queue(maxsize=PREFETCH)
        pushes: asyncio.Queue = asyncio.Queue()
        feeder = asyncio.create_task(self._feed(job, job.topics.samples, stub, queue, config.training.epochs, True))
        pusher = asyncio.create_task(self._push_loop(stub, pushes))
        losses: list[float] = []
        per_epoch = [{"samples": 0, "label_sum": 0.0} for _ in range(config.training.epochs)]
        timing = {"lookup_wait": 0.0, "step": 0.0, "push_drain": 0.0}
        clock = time.perf_counter
        try:
            for epoch in range(config.training.epochs):
                while (item := await queue.get()) is not _EPOCH_END:
                    await self._hold_while_paused(device)
                    raw, lookup = item
                    t0 = clock()
                    response = await lookup
                    t1 = clock()
                    batch = codec.decode_batch(raw)
                    STALENESS.labels(str(rank)).set(response.staleness)
                    loss_sum, step_samples, grads = await asyncio.to_thread(
                        self._step, ddp, optimizer, device, world, batch, self._embeddings(response))
                    timing["lookup_wait"] += t1 - t0
                    timing["step"] += clock() - t1
                    await pushes.put(pb.PushGradientsRequest(ref=response.ref, slots=[
                        pb.SlotGradient(slot=s.slot, grad=pb.Array(data=codec.pack_array(g)))
                        for s, g in zip(response.slots, grads)]))
                    self.trained += batch.batch_size
                    per_epoch[batch.epoch]["samples"] += batch.batch_size
                    per_epoch[batch.epoch]["label_sum"] += float(np.sum(batch.labels))
                    SAMPLES.labels(str(rank)).inc(batch.batch_size)
                    losses.append(loss_sum / step_samples)
                    await progress.add_step(rank, epoch, batch.batch_size, loss_sum)
            t0 = clock()
            await pushes.join()  # every gradient handed over before evaluation reads the tables
            timing["push_drain"] = clock() - t0
            if pusher.done():
                pusher.result()  # a failed push fails the job
        finally:
            feeder.cancel()
            pusher.cancel()
            for task in (feeder, pusher):
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        return losses, per_epoch, timing

    async def _hold_while_paused(self, device: torch.device) -> None:
        """Wait here while the job is paused. The ranks agree on it (an all-reduce of what each
        has heard), so they all hold before the same step and none waits inside a step's
        collectives, which would time out during a long pause."""
        while True:
            paused = torch.tensor([float(self.job is not None and self.job.state == "paused")], device=device)
            await asyncio.to_thread(dist.all_reduce, paused, dist.ReduceOp.MAX)
            if not paused.item():
                return
            await asyncio.sleep(0.2)

    @staticmethod
    async def _push_loop(stub, pushes: asyncio.Queue) -> None:
        while True:
            request = await pushes.get()
            try:
                await stub.PushGradients(request)
            finally:
                pushes.task_done()

    @staticmethod
    def _step(ddp, optimizer, device: torch.device, world: int, batch, embeddings: list[np.ndarray]):
        """One synchronous step; returns (sum of losses, samples in the step, embedding gradients)."""
        dense = torch.from_numpy(np.array(batch.dense, dtype=np.float32)).to(device)
        labels = torch.from_numpy(np.array(batch.labels, dtype=np.float32)).to(device)
        embs = [torch.from_numpy(e).to(device).requires_grad_() for e in embeddings]
        step_samples = torch.tensor([float(batch.batch_size)], device=device)
        dist.all_reduce(step_samples)
        loss_sum = F.binary_cross_entropy_with_logits(ddp(dense, embs), labels, reduction="sum")
        optimizer.zero_grad(set_to_none=True)
        (loss_sum * world / step_samples).backward()
        optimizer.step()
        grads = [(e.grad if e.grad is not None else torch.zeros_like(e)).div(world).cpu().numpy() for e in embs]
        return float(loss_sum), float(step_samples), grads

    async def _evaluate(self, job: JobRecord, stub, model, device: torch.device) -> tuple[np.ndarray, np.ndarray]:
        queue: asyncio.Queue = asyncio.Queue(maxsize=PREFETCH)
        feeder = asyncio.create_task(self._feed(job, job.topics.eval, stub, queue, 1, False))
        labels, probs = [], []
        model.eval()
        try:
            while (item := await queue.get()) is not _EPOCH_END:
                raw, lookup = item
                response = await lookup
                batch = codec.decode_batch(raw)
                embeddings = self._embeddings(response)
                with torch.no_grad():
                    dense = torch.from_numpy(np.array(batch.dense, dtype=np.float32)).to(device)
                    logits = model(dense, [torch.from_numpy(e).to(device) for e in embeddings])
                labels.append(np.asarray(batch.labels))
                probs.append(torch.sigmoid(logits).cpu().numpy())
        finally:
            feeder.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await feeder
        return np.concatenate(labels), np.concatenate(probs)


def main() -> None:
    run_service(NNWorker)
