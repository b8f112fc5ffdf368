"""The embedding_ps service: one shard of the parameter server.

It holds the job's embedding tables in the native store, serves lookups over gRPC,
and applies the gradients of its Kafka partition (`gradients` topic, partition =
shard) with the native optimizers, recording per rank how far it has applied them —
the watermark the staleness bound is enforced against.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import grpc
import numpy as np
import trillium_native
from aiokafka import TopicPartition
from prometheus_client import Counter, Gauge, Histogram

from trillium import codec, kafka, rpc, state
from trillium.job import JobRecord
from trillium.pb import embedding_pb2 as pb
from trillium.pb import embedding_pb2_grpc as pb_grpc
from trillium.progress import JobProgress
from trillium.service import Service, run_service

logger = logging.getLogger("trillium.embedding_ps")

LOOKUP_SECONDS = Histogram("trillium_ps_lookup_seconds", "PS lookup latency", ["shard"])
ROWS_APPLIED = Counter("trillium_ps_gradient_rows_applied_total", "embedding rows updated", ["shard"])
GRADIENT_LAG = Gauge("trillium_ps_gradient_lag_messages", "gradient messages not yet applied", ["shard"])
TABLE_ROWS = Gauge("trillium_ps_table_rows", "rows stored", ["shard", "table"])
TABLE_BYTES = Gauge("trillium_ps_table_memory_bytes", "memory of a table", ["shard", "table"])


class _Servicer(pb_grpc.EmbeddingParameterServerServicer):
    def __init__(self, ps: "EmbeddingPS") -> None:
        self.ps = ps

    async def Lookup(self, request: pb.ShardLookupRequest, context: grpc.aio.ServicerContext) -> pb.ShardLookupResponse:
        store = self.ps.store
        if store is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.ps.name} holds no tables yet (no job set up)")
        out_dtype = request.row_dtype or "float32"
        with LOOKUP_SECONDS.labels(self.ps.settings.index).time():
            try:
                rows = await asyncio.to_thread(
                    lambda: [store.lookup(t.table, codec.unpack_array(t.ids.data), out_dtype=out_dtype)
                             for t in request.tables])
            except (KeyError, ValueError, TypeError) as err:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        return pb.ShardLookupResponse(tables=[pb.TableRows(table=t.table, rows=pb.Array(data=codec.pack_array(r)))
                                              for t, r in zip(request.tables, rows)])

    async def Stats(self, request: pb.ShardStatsRequest, context: grpc.aio.ServicerContext) -> pb.ShardStatsResponse:
        return pb.ShardStatsResponse(shard=self.ps.settings.index, tables=[
            pb.TableStats(table=name, **{k: int(s[k]) for k in ("rows", "memory_bytes", "admitted", "evicted",
                                                                 "expired", "nan_grads_skipped")})
            for name, s in self.ps.table_stats().items()])


class EmbeddingPS(Service):
    role = "embedding_ps"

    def __init__(self, settings) -> None:
        super().__init__(settings)
        self.store: trillium_native.EmbeddingStore | None = None
        self.applied_messages = 0

    async def start(self) -> None:
        self.grpc_server = await rpc.serve(
            self.settings.host, self.settings.grpc_port, self.settings.grpc,
            lambda server: pb_grpc.add_EmbeddingParameterServerServicer_to_server(_Servicer(self), server))
        self.redis = state.connect(self.settings.redis_url)

    async def stop(self) -> None:
        await self.grpc_server.stop(grace=2)
        await self.redis.aclose()

    def table_stats(self) -> dict[str, dict[str, Any]]:
        store = self.store
        return {t: store.stats(t) for t in store.tables()} if store is not None else {}

    def health(self) -> dict[str, Any]:
        stats = self.table_stats()
        shard = str(self.settings.index)
        for table, s in stats.items():
            TABLE_ROWS.labels(shard, table).set(s["rows"])
            TABLE_BYTES.labels(shard, table).set(s["memory_bytes"])
        return {"shard": self.settings.index, "applied_messages": self.applied_messages,
                "tables": {t: {k: s[k] for k in ("rows", "memory_bytes", "admitted", "evicted", "expired")}
                           for t, s in stats.items()}}

    async def run_job(self, job: JobRecord) -> None:
        config = job.config
        shard = self.settings.index
        store = trillium_native.EmbeddingStore()
        for name, table in config.tables.items():
            store.create_table(name, **table.store_kwargs(config.training.seed))
        self.store = store
        progress = JobProgress(self.redis, job.id)
        consumer = kafka.consumer(self.settings.kafka, group_id=f"{job.id}.ps")
        partition = TopicPartition(job.topics.gradients, shard)
        consumer.assign([partition])
        await consumer.start()
        self.set_job_phase("ready")
        lag = GRADIENT_LAG.labels(str(shard))
        loop = asyncio.get_running_loop()
        next_commit = loop.time()
        try:
            while True:
                records = (await consumer.getmany(partition, timeout_ms=200, max_records=64)).get(partition, [])
                for record in records:
                    update = codec.decode_gradients(record.value)
                    rows = await asyncio.to_thread(self._apply, store, update)
                    ROWS_APPLIED.labels(str(shard)).inc(rows)
                    # Ranks step in lock-step, so a rank's batch_id // nn_ranks is its step.
                    await progress.set_applied(shard, update.rank, update.batch_id // config.topology.nn_ranks)
                    self.applied_messages += 1
                # Offsets and lag are bookkeeping, not on the training path: twice a second.
                if records and loop.time() >= next_commit:
                    await consumer.commit()
                    end = (await consumer.end_offsets([partition]))[partition]
                    lag.set(end - (await consumer.position(partition)))
                    next_commit = loop.time() + 0.5
        finally:
            with contextlib.suppress(Exception):
                await consumer.stop()

    @staticmethod
    def _apply(store: trillium_native.EmbeddingStore, update) -> int:
        rows = 0
        for table, (ids, grads) in update.tables.items():
            if len(ids):
                rows += store.update(table, np.asarray(ids), np.asarray(grads))
        return rows


def main() -> None:
    run_service(EmbeddingPS)
