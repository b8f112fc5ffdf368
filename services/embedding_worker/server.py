"""The embedding_worker service: a batch's embeddings for the NN workers (gRPC), and
their gradients back to the parameter servers (Kafka).

The hot path is native (`trillium_native.WorkerServer`, native/src/worker), with no Python on it:
LookupBatches waits while the lookup would exceed the staleness bound, dedups the batch's IDs per
table, looks them up on every owning PS shard at once and pools them per slot; in a training batch
replayed from before a forget, the forgotten IDs are asked of no shard and read as zeros.
PushGradients sums the gradient per unique ID and, once every rank this worker serves has pushed
the step, writes one message per PS shard holding all of their gradients. Both are streams, one
per NN rank and job, as are the lookups on each PS shard.

This process sets each job up and ends it, follows the PS shards' applied watermarks (Redis) into
the plane's staleness gate, and produces each step's messages to the gradients topic (partition =
shard) through one idempotent producer, in step order, so each shard applies them in that order:
a step's pushes are answered once its messages are durable (the plane is told), and the next steps
are handled meanwhile.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from dataclasses import dataclass
from typing import Any

from prometheus_client import REGISTRY

import trillium_native
from trillium import pooling
from trillium.config import GRPC_MAX_MESSAGE_BYTES
from trillium.job.record import JobRecord
from trillium.runtime.memory import EMBEDDING_WORKER_MMAP_THRESHOLD, EMBEDDING_WORKER_TRIM_THRESHOLD
from trillium.runtime.native_metrics import Counts, NativeHistograms
from trillium.runtime.process import run_service
from trillium.runtime.progress import AppliedWatermark, JobProgress
from trillium.runtime.service import Service
from trillium.timeouts import GRPC_KEEPALIVE_S, GRPC_KEEPALIVE_TIMEOUT_S
from trillium.wire import kafka, rpc, state

logger = logging.getLogger("trillium.embedding_worker")
DROPPED_REPORT_S = 1.0  # how often dropped plans are looked for (they are an error: none should be)


@dataclass(frozen=True)
class _Step:
    """A step's gradient messages as the native plane hands them over, one per PS shard."""

    attempt: int
    step: int
    epoch: int
    publish: bool
    key_rank: int  # the first of the step's ranks: the messages' key
    frames: list[bytes]


class EmbeddingWorker(Service):
    role = "embedding_worker"
    # glibc's thresholds, fixed at their highest: the lookups in flight reuse the heap's pages
    # (trimmed, they faulted in afresh), and its gRPC threads keep an arena each.
    lean_malloc, malloc_arenas = True, None
    malloc_mmap_threshold, malloc_trim_threshold = EMBEDDING_WORKER_MMAP_THRESHOLD, EMBEDDING_WORKER_TRIM_THRESHOLD

    def __init__(self, settings) -> None:
        super().__init__(settings)
        self.plane: trillium_native.WorkerServer | None = None
        self._steps: asyncio.Queue[_Step] = asyncio.Queue()
        self._dropped = 0  # plans dropped (gradients never pushed) already logged, this job
        self._histograms = NativeHistograms(
            {
                "trillium_lookup_seconds": ("batch lookup latency (staleness wait included)", self._reader("lookup")),
                "trillium_staleness_wait_seconds": (
                    "time a lookup waited for the staleness bound",
                    self._reader("staleness_wait"),
                ),
                "trillium_push_gradients_seconds": (
                    "gradient push latency (Kafka acks included)",
                    self._reader("push"),
                ),
            },
            {},
        )

    def _reader(self, name: str):
        def read() -> Counts | None:
            return self.plane.metrics()[name] if self.plane is not None else None

        return read

    async def start(self) -> None:
        creds = self.settings.grpc
        loop, steps = asyncio.get_running_loop(), self._steps
        self.plane = trillium_native.WorkerServer(
            self.settings.host,
            self.settings.grpc_port,
            creds.token.get_secret_value(),
            name=self.name,
            # From the plane's thread, in step order: the queue keeps that order to the producer.
            on_step=lambda *step: loop.call_soon_threadsafe(steps.put_nowait, _Step(*step)),
            **rpc.native_server_options(creds),
        )
        REGISTRY.register(self._histograms)
        self.redis = state.connect(self.settings.redis_url)

    async def stop(self) -> None:
        REGISTRY.unregister(self._histograms)
        await asyncio.to_thread(self.plane.stop)
        await self.redis.aclose()

    def health(self) -> dict[str, Any]:
        held, _ = self.plane.pending() if self.plane is not None else (0, 0)
        return {"pending_gradients": held}

    async def _report_dropped(self) -> None:
        """Log, once a second at most, the plans the plane dropped because their gradients never came."""
        while True:
            await asyncio.sleep(DROPPED_REPORT_S)
            _, dropped = self.plane.pending()
            if dropped > self._dropped:
                logger.error("gradients never pushed; plans dropped", extra={"plans": dropped - self._dropped})
                self._dropped = dropped

    async def run_job(self, job: JobRecord) -> None:
        config, topology = job.config, job.config.topology
        shards = await self.peers("embedding_ps", topology.ps_shards)
        # Gradients are on the critical path of synchronous training: no linger.
        producer = kafka.producer(self.settings.kafka, linger_ms=0)
        await producer.start()
        creds = self.settings.grpc
        publish = config.publish
        self.plane.start_job(
            job_id=job.id,
            attempt=job.attempt,
            nn_ranks=topology.nn_ranks,
            # The ranks whose lookups and gradients come here (an NN rank's worker is rank % workers).
            ranks=[r for r in range(topology.nn_ranks) if r % topology.embedding_workers == self.settings.index],
            layout=pooling.Layout(config.slots, config.tables, topology.ps_shards).native,
            shards=[w["grpc_address"] for w in shards],
            # An evaluation's rows come as a model version serves them: the job's evaluation
            # measures what replicas answer.
            served_fp16=publish is not None and publish.dtype == "fp16",
            gradients_fp16=config.training.wire_dtype == "fp16",
            forgotten=[(m.through_batch, dict(m.tables)) for m in job.forgotten],
            ps_token=creds.token.get_secret_value(),
            ps_tls_ca=rpc.read_file(creds.tls.ca_file) if creds.tls else None,
            max_message_bytes=GRPC_MAX_MESSAGE_BYTES,
            keepalive_s=GRPC_KEEPALIVE_S,
            keepalive_timeout_s=GRPC_KEEPALIVE_TIMEOUT_S,
        )
        watermark = JobProgress(self.redis, job.id, job.attempt).watermark(
            topology.ps_shards, topology.nn_ranks, on_change=functools.partial(self._gate, job.attempt)
        )
        self._dropped = 0  # counted per job by the plane
        tasks = [
            asyncio.create_task(watermark.run()),
            asyncio.create_task(self._produce(job, producer)),
            asyncio.create_task(self._report_dropped()),
        ]
        try:
            self.set_job_phase("ready")
            await asyncio.gather(*tasks)  # serve until the job ends (this task is cancelled)
        finally:
            self.plane.end_job()  # pushes waiting for ranks or acks that will not come fail
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await producer.stop()

    def _gate(self, attempt: int, watermark: AppliedWatermark) -> None:
        self.plane.set_watermark(attempt, watermark.steps, watermark.bound, watermark.loaded)

    async def _produce(self, job: JobRecord, producer) -> None:
        """Each step's messages to the gradients topic as the plane completes them, in step order:
        queued in the producer one step after the other (so they go out in that order), each step
        answered to the plane once all its messages are durable (acks=all) or failed."""
        topic = job.topics.gradients
        while True:
            step = await self._steps.get()
            if step.attempt != job.attempt:
                continue  # a step of an attempt that ended: the plane answered its pushes already
            try:
                deliveries = [
                    await producer.send(
                        topic,
                        frame,
                        partition=shard,
                        key=str(step.key_rank).encode(),
                        headers=kafka.headers(job.attempt, publish=step.publish),
                    )
                    for shard, frame in enumerate(step.frames)
                ]
            except Exception as err:  # noqa: BLE001 (every rank's push of the step fails with it)
                self.plane.step_failed(step.attempt, step.step, str(err))
                continue
            asyncio.gather(*deliveries).add_done_callback(functools.partial(self._settle, step))

    def _settle(self, step: _Step, deliveries: asyncio.Future[list[Any]]) -> None:
        """The step's pushes answered with the messages sent once all are durable, or with why not."""
        if deliveries.cancelled():
            self.plane.step_failed(step.attempt, step.step, "its delivery was cancelled")
        elif (error := deliveries.exception()) is not None:
            self.plane.step_failed(step.attempt, step.step, f"{type(error).__name__}: {error}")
        else:
            self.plane.step_sent(step.attempt, step.step, len(deliveries.result()))


def main() -> None:
    run_service(EmbeddingWorker)
