"""The embedding_worker service: a batch's embeddings for the NN workers (gRPC), and
their gradients back to the parameter servers (Kafka).

LookupBatches: wait while the lookup would exceed the staleness bound, dedup the batch's
IDs per table, look them up on every owning PS shard in parallel, pool per slot. In a batch
replayed from before a forget, the forgotten IDs are asked of no shard and read as zeros (forget.py).
PushGradients: sum the gradient per unique ID and, once every rank this worker serves has pushed
the step, produce one message per PS shard to the gradients topic (partition = shard) holding
all of their gradients. A rank's pushes arrive in step order and are handled one at a time, so
the steps complete in order and go out through one idempotent producer: each shard applies
them in that order. A push is answered once its step's messages are durable, and the next is
handled meanwhile (rpc.Later).
Both are streams, one per NN rank and job (trillium.wire.rpc.OrderedStream), as are the
lookups on each PS shard.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import OrderedDict
from typing import Any

import grpc
import numpy as np
from prometheus_client import Histogram

from trillium import pooling
from trillium.job.record import JobRecord
from trillium.runtime.memory import EMBEDDING_WORKER_MMAP_THRESHOLD, EMBEDDING_WORKER_TRIM_THRESHOLD
from trillium.runtime.process import run_service
from trillium.runtime.progress import JobProgress
from trillium.runtime.service import Service
from trillium.wire import codec, kafka, rpc, state
from trillium.wire.batch import EmbeddingRef, GradientUpdate
from trillium.wire.pb import embedding_pb2 as pb
from trillium.wire.pb import embedding_pb2_grpc as pb_grpc

from .forget import Forgotten, MaskedPlan

logger = logging.getLogger("trillium.embedding_worker")

LOOKUP_SECONDS = Histogram("trillium_lookup_seconds", "batch lookup latency (staleness wait included)")
STALENESS_WAIT = Histogram("trillium_staleness_wait_seconds", "time a lookup waited for the staleness bound")
PUSH_SECONDS = Histogram("trillium_push_gradients_seconds", "gradient push latency (Kafka acks included)")
# Plans kept for gradients not pushed yet; far more than any staleness bound keeps in flight.
MAX_PENDING = 4096
# Lookups of one stream handled at once: more than a rank keeps in flight (services/nn_worker).
LOOKUP_WINDOW = 16


class ShardUnavailable(RuntimeError):
    """A PS shard did not answer a lookup."""


class _JobContext:
    def __init__(
        self,
        job: JobRecord,
        ps: list[rpc.OrderedStream[pb.ShardLookupRequest, pb.ShardLookupResponse]],
        ps_addresses: list[str],
        producer,
        progress: JobProgress,
        worker_index: int,
    ) -> None:
        self.job = job
        self.ps = ps
        self.ps_addresses = ps_addresses
        self.producer = producer
        self.progress = progress
        self.watermark = progress.watermark(job.config.topology.ps_shards, job.config.topology.nn_ranks)
        self.layout = pooling.Layout(job.config.slots, job.config.tables, job.config.topology.ps_shards)
        self.widths = [c[1] - c[0] if c is not None else 0 for c in self.layout.columns]
        self.pending: OrderedDict[tuple[int, int], pooling.BatchPlan] = OrderedDict()
        topology = job.config.topology
        # The ranks whose lookups and gradients come here (an NN rank's worker is rank % workers).
        self.ranks = [r for r in range(topology.nn_ranks) if r % topology.embedding_workers == worker_index]
        self.steps: dict[int, _StepGradients] = {}  # steps some of our ranks have pushed, not all
        self.forgotten = Forgotten(job.forgotten)


class _StepGradients:
    """A step's gradients as its ranks push them, until the last one's: they go out together."""

    def __init__(self) -> None:
        self.ranks: dict[int, tuple[pooling.BatchPlan, dict[str, np.ndarray]]] = {}
        self.publish = False
        self.sent: asyncio.Future[int] = asyncio.get_running_loop().create_future()


class _Servicer(pb_grpc.EmbeddingWorkerServicer):
    def __init__(self, worker: "EmbeddingWorker") -> None:
        self.worker = worker

    async def _context(self, context: grpc.aio.ServicerContext, attempt: int) -> _JobContext:
        ctx = self.worker.ctx
        if ctx is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.worker.name} has no job set up")
        if attempt != ctx.job.attempt:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{self.worker.name} serves attempt {ctx.job.attempt} of job {ctx.job.id}, not attempt {attempt}",
            )
        return ctx

    @rpc.streamed(window=LOOKUP_WINDOW)
    async def LookupBatches(self, request: pb.BatchLookupRequest, context) -> pb.BatchLookupResponse:
        ctx = await self._context(context, request.attempt)
        start = time.perf_counter()
        try:
            batch = codec.decode_batch(request.batch)
        except codec.CodecError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        config = ctx.job.config
        if request.training:
            staleness = await self.worker.wait_for_staleness(ctx, batch.batch_id)
        else:  # evaluation reads the tables as the steps before it left them, and changes nothing
            staleness = 0
            await ctx.watermark.wait_applied(request.applied)
        try:
            plan = pooling.plan(ctx.layout, batch.ids)
        except (KeyError, ValueError) as err:  # slots or IDs that are not the job's
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"batch {batch.batch_id}: {err.args[0]}")
        if request.training and ctx.job.forgotten:  # its forgotten IDs go to no shard: no lookup, no gradient
            plan = ctx.forgotten.mask(plan, batch.batch_id)
        try:
            rows = await self.worker.lookup_rows(ctx, plan, evaluation=not request.training, fp16=request.fp16)
        except ShardUnavailable as err:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(err))
        pooled = pooling.pool(plan, rows, fp16=request.fp16)
        if request.training:
            ctx.pending[(batch.rank, batch.batch_id)] = plan
            while len(ctx.pending) > MAX_PENDING:
                dropped = ctx.pending.popitem(last=False)[0]
                logger.error("gradients never pushed; plan dropped", extra={"rank": dropped[0], "batch_id": dropped[1]})
        sequence_slots = [s for s, cols in zip(config.slots, ctx.layout.columns, strict=True) if cols is None]
        slots = [
            pb.SlotEmbedding(
                slot=slot.name,
                values=pb.Array(data=codec.pack_array(values)),
                mask=pb.Array(data=codec.pack_array(mask)),
            )
            for slot, (values, mask) in zip(sequence_slots, pooled.sequences, strict=True)
        ]
        LOOKUP_SECONDS.observe(time.perf_counter() - start)
        ref = pb.EmbeddingRef(
            worker=self.worker.name,
            rank=batch.rank,
            batch_id=batch.batch_id,
            epoch=batch.epoch,
            attempt=ctx.job.attempt,
        )
        return pb.BatchLookupResponse(
            ref=ref,
            slots=slots,
            staleness=staleness,
            pooled=pb.Array(data=codec.pack_array(pooled.pooled)),
            widths=ctx.widths,
        )

    @rpc.streamed(window=1)
    async def PushGradients(self, request: pb.PushGradientsRequest, context) -> rpc.Later[pb.PushGradientsResponse]:
        ctx = await self._context(context, request.ref.attempt)
        ref = EmbeddingRef(
            worker=request.ref.worker,
            rank=request.ref.rank,
            batch_id=request.ref.batch_id,
            epoch=request.ref.epoch,
            attempt=request.ref.attempt,
        )
        if ref.rank not in ctx.ranks:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{self.worker.name} takes the gradients of ranks {ctx.ranks}, not of rank {ref.rank}",
            )
        plan = ctx.pending.pop((ref.rank, ref.batch_id), None)
        if plan is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no embeddings handed out for {ref}")
        start = time.perf_counter()
        try:
            pooled = codec.unpack_array(request.pooled.data)
            if pooled.dtype == np.float16:
                pooled = codec.from_fp16(pooled, request.pooled_scale or 1.0)
            grads = pooling.scatter_wire(plan, pooled, [codec.unpack_array(s.grad.data) for s in request.slots])
        except (ValueError, TypeError, codec.CodecError) as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad gradients for {ref}: {err}")
        sent = await self.worker.push_gradients(ctx, ref, plan, grads, publish=request.publish)
        # Answered once durable; the rank's next push is handled meanwhile, so the round trips
        # to Kafka of a rank's pushes overlap instead of adding up (one a step: across 20 ms
        # links, a step's push took longer than the step).
        return rpc.Later(asyncio.ensure_future(_answer_when_sent(sent, start)))


async def _answer_when_sent(sent: asyncio.Future[int], start: float) -> pb.PushGradientsResponse:
    # Shielded: a rank's stream that ends leaves the others' wait for the step as it is.
    messages = await asyncio.shield(sent)
    PUSH_SECONDS.observe(time.perf_counter() - start)
    return pb.PushGradientsResponse(messages=messages)


class EmbeddingWorker(Service):
    role = "embedding_worker"
    # glibc's thresholds, fixed at their highest: the lookups in flight reuse the heap's pages
    # (trimmed, they faulted in afresh), and its gRPC threads keep an arena each.
    lean_malloc, malloc_arenas = True, None
    malloc_mmap_threshold, malloc_trim_threshold = EMBEDDING_WORKER_MMAP_THRESHOLD, EMBEDDING_WORKER_TRIM_THRESHOLD

    def __init__(self, settings) -> None:
        super().__init__(settings)
        self.ctx: _JobContext | None = None

    async def start(self) -> None:
        self.grpc_server = await rpc.serve(
            self.settings.host,
            self.settings.grpc_port,
            self.settings.grpc,
            lambda s: pb_grpc.add_EmbeddingWorkerServicer_to_server(_Servicer(self), s),
        )
        self.redis = state.connect(self.settings.redis_url)

    async def stop(self) -> None:
        await self.grpc_server.stop(grace=2)
        await self.redis.aclose()

    def health(self) -> dict[str, Any]:
        return {"pending_gradients": len(self.ctx.pending) if self.ctx else 0}

    async def run_job(self, job: JobRecord) -> None:
        shards = await self.peers("embedding_ps", job.config.topology.ps_shards)
        channels = [rpc.channel(w["grpc_address"], self.settings.grpc) for w in shards]
        # Gradients are on the critical path of synchronous training: no linger.
        producer = kafka.producer(self.settings.kafka, linger_ms=0)
        await producer.start()
        try:
            self.ctx = _JobContext(
                job,
                [rpc.OrderedStream(pb_grpc.EmbeddingParameterServerStub(c).Lookups) for c in channels],
                [w["grpc_address"] for w in shards],
                producer,
                JobProgress(self.redis, job.id, job.attempt),
                self.settings.index,
            )
            self.set_job_phase("ready")
            await self.ctx.watermark.run()  # serve until the job ends (this task is cancelled)
        finally:
            if self.ctx is not None:
                for step in self.ctx.steps.values():  # pushes waiting for ranks that will not come
                    step.sent.cancel()
                for stream in self.ctx.ps:
                    await stream.close()
            self.ctx = None
            await producer.stop()
            for channel in channels:
                await channel.close()

    async def wait_for_staleness(self, ctx: _JobContext, batch_id: int) -> int:
        """Block while looking up this batch would exceed the bound; returns its staleness."""
        topo = ctx.job.config.topology
        started = time.perf_counter()
        staleness = await ctx.watermark.wait_within_bound(batch_id // topo.nn_ranks)
        STALENESS_WAIT.observe(time.perf_counter() - started)
        await ctx.progress.record_staleness(batch_id % topo.nn_ranks, staleness)
        return staleness

    async def lookup_rows(
        self, ctx: _JobContext, plan: pooling.BatchPlan, *, evaluation: bool = False, fp16: bool = False
    ) -> dict[str, np.ndarray]:
        """Each table's rows for its unique IDs, fetched from all owning shards in parallel (as
        float16 with `fp16`). An evaluation's lookups are read-only (an unknown ID reads as zeros,
        as a not-yet-admitted one does in training, and no row is created) and their rows come as
        a model version serves them (`publish.dtype`): the job's evaluation measures what replicas
        answer."""
        publish = ctx.job.config.publish
        served16 = evaluation and publish is not None and publish.dtype == "fp16"
        row_dtype = "float16" if fp16 or served16 else "float32"
        dims = {t: ctx.job.config.tables[t].dim for t in plan.tables}
        rows = {t: np.empty((len(p.ids), dims[t]), dtype=np.float32) for t, p in plan.tables.items()}
        if isinstance(plan, MaskedPlan):  # forgotten IDs, asked of no shard
            for table, masked in plan.masked.items():
                rows[table][masked] = 0
        requests, asked = [], {}
        for shard, lookups in enumerate(ctx.ps):
            ids = {t: p.shard_ids(shard) for t, p in plan.tables.items()}
            asked[shard] = [(t, len(i)) for t, i in ids.items() if len(i)]
            if asked[shard]:
                request = pb.ShardLookupRequest(
                    read_only=evaluation,
                    row_dtype=row_dtype,
                    tables=[t for t, _ in asked[shard]],
                    counts=[n for _, n in asked[shard]],
                    ids=pb.Array(data=codec.pack_array(np.concatenate([ids[t] for t, _ in asked[shard]]))),
                )
                requests.append((shard, lookups(request)))

        async def answer(shard: int, call) -> pb.ShardLookupResponse:
            try:
                return await call
            except grpc.aio.AioRpcError as err:  # say which shard, in one line (not the raw dump)
                raise ShardUnavailable(
                    f"embedding_ps-{shard} at {ctx.ps_addresses[shard]}: {err.code().name}: {err.details()}"
                ) from None
            except rpc.StreamEnded as err:
                raise ShardUnavailable(f"embedding_ps-{shard} at {ctx.ps_addresses[shard]}: {err}") from None

        for shard, response in zip(
            (s for s, _ in requests), await asyncio.gather(*(answer(s, r) for s, r in requests)), strict=True
        ):
            expected = [dims[t] for t, _ in asked[shard]]
            if list(response.dims) != expected:
                raise RuntimeError(
                    f"embedding_ps-{shard} answered rows of dims {list(response.dims)} for tables "
                    f"{[t for t, _ in asked[shard]]} of dims {expected}"
                )
            flat, start = codec.unpack_array(response.rows.data), 0
            if flat.dtype == np.float16:  # widened at once in the native core, not row by row by numpy
                flat = codec.from_fp16(flat, 1.0)
            for table, n in asked[shard]:
                end = start + n * dims[table]
                rows[table][plan.tables[table].shard_rows[shard]] = flat[start:end].reshape(n, dims[table])
                start = end
        return rows

    async def push_gradients(
        self,
        ctx: _JobContext,
        ref: EmbeddingRef,
        plan: pooling.BatchPlan,
        grads: dict[str, np.ndarray],
        publish: bool = False,
    ) -> asyncio.Future[int]:
        """Hold a rank's gradients of a step until every rank we serve has pushed that step, then
        queue them all to Kafka (`produce_gradients`). Returns once they are queued, in step
        order; the future it returns gives the messages sent once they are durable."""
        step_id = ref.batch_id // ctx.job.config.topology.nn_ranks
        step = ctx.steps.setdefault(step_id, _StepGradients())
        step.ranks[ref.rank] = (plan, grads)
        step.publish |= publish
        if len(step.ranks) == len(ctx.ranks):
            del ctx.steps[step_id]
            try:
                deliveries = await self.produce_gradients(ctx, step_id, ref.epoch, step)
            except asyncio.CancelledError:
                step.sent.cancel()
                raise
            except Exception as err:  # noqa: BLE001 (every rank's push of the step fails with it)
                step.sent.set_exception(err)
            else:
                asyncio.gather(*deliveries).add_done_callback(functools.partial(_settle, step.sent))
        return step.sent

    async def produce_gradients(
        self, ctx: _JobContext, step_id: int, epoch: int, step: _StepGradients
    ) -> list[asyncio.Future[Any]]:
        """One message per shard with every rank's gradients of the step, in rank order — empty
        ones too: they advance that shard's watermark (and, at a publish cut, carry the cut to
        it in step order). Returns once they are queued in the producer (so the steps go out in
        the order they were queued), with their deliveries: acks=all, each done once durable."""
        topic = ctx.job.topics.gradients
        ranks = sorted(step.ranks)
        held = [step.ranks[rank] for rank in ranks]
        deliveries = []
        for shard in range(len(ctx.ps)):
            tables = {}
            for table in ctx.layout.tables:
                ids, grads = [], []
                for plan, rank_grads in held:
                    rows = plan.tables[table].shard_rows[shard]
                    ids.append(plan.tables[table].ids[rows])
                    grads.append(rank_grads[table][rows])
                tables[table] = (ids[0], grads[0]) if len(held) == 1 else (np.concatenate(ids), np.concatenate(grads))
            update = GradientUpdate(ranks=tuple(ranks), step=step_id, epoch=epoch, shard=shard, tables=tables)
            deliveries.append(
                await ctx.producer.send(
                    topic,
                    codec.encode_gradients(update, fp16=ctx.job.config.training.wire_dtype == "fp16"),
                    partition=shard,
                    key=str(ranks[0]).encode(),
                    headers=kafka.headers(ctx.job.attempt, publish=step.publish),
                )
            )
        return deliveries


def _settle(sent: asyncio.Future[int], deliveries: asyncio.Future[list[Any]]) -> None:
    """The step's pushes answered with the messages sent once all are durable, or with why not."""
    if sent.done():
        return
    if deliveries.cancelled():
        sent.cancel()
    elif (error := deliveries.exception()) is not None:
        sent.set_exception(error)
    else:
        sent.set_result(len(deliveries.result()))


def main() -> None:
    run_service(EmbeddingWorker)
