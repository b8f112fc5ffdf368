"""A batch's rows from the PS shards that own them.

Lookups released together (both ranks' of a step, woken by one watermark advance) share one
call per shard: a grpc.aio call costs about 0.4 ms of CPU on either side whatever it carries.
Each lookup keeps its own segments in the call, one per table, so a shard looks up (and
admits) their IDs exactly as it would in separate calls.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import grpc
import numpy as np
from prometheus_client import Histogram

from trillium.job import TableConfig
from trillium.pooling import BatchPlan
from trillium.wire import codec
from trillium.wire.pb import embedding_pb2 as pb
from trillium.wire.pb import embedding_pb2_grpc as pb_grpc

LOOKUPS_PER_CALL = Histogram(
    "trillium_lookups_per_shard_call", "batch lookups sharing one call to a PS shard", buckets=(1, 2, 3, 4, 8, 16)
)

Rows = dict[str, np.ndarray]  # per table: float32 [unique IDs of the plan, dim]


class ShardUnavailable(RuntimeError):
    """A PS shard did not answer a lookup."""


class ShardLookups:
    def __init__(
        self,
        stubs: list[pb_grpc.EmbeddingParameterServerStub],
        addresses: list[str],
        tables: Mapping[str, TableConfig],
    ) -> None:
        self.stubs = stubs
        self.addresses = addresses
        self.dims = {name: table.dim for name, table in tables.items()}
        # Lookups waiting for the next call, by (read_only, row_dtype): only alike ones share one.
        self._waiting: dict[tuple[bool, str], list[tuple[BatchPlan, asyncio.Future[Rows]]]] = {}
        self._calls: set[asyncio.Task[None]] = set()

    async def rows(self, plan: BatchPlan, *, read_only: bool, row_dtype: str) -> Rows:
        """Each table's rows for the plan's unique IDs (float32, whatever `row_dtype` the shards
        send them in); `read_only`: an unknown ID reads as zeros and no row is created."""
        future: asyncio.Future[Rows] = asyncio.get_running_loop().create_future()
        key = (read_only, row_dtype)
        waiting = self._waiting.setdefault(key, [])
        waiting.append((plan, future))
        if len(waiting) == 1:
            call = asyncio.create_task(self._call(key))
            self._calls.add(call)
            call.add_done_callback(self._calls.discard)
        return await future

    async def _call(self, key: tuple[bool, str]) -> None:
        await asyncio.sleep(0)  # the lookups the same wake-up released join this one
        group = self._waiting.pop(key)
        LOOKUPS_PER_CALL.observe(len(group))
        try:
            answers = await self._fetch([plan for plan, _ in group], *key)
        except Exception as err:  # noqa: BLE001 (each lookup's RPC answers with it)
            for _, future in group:
                if not future.done():
                    future.set_exception(err)
            return
        for (_, future), rows in zip(group, answers, strict=True):
            if not future.done():  # not cancelled (its caller gone)
                future.set_result(rows)

    async def _fetch(self, plans: list[BatchPlan], read_only: bool, row_dtype: str) -> list[Rows]:
        dims = self.dims
        rows = [{t: np.empty((len(p.ids), dims[t]), np.float32) for t, p in plan.tables.items()} for plan in plans]
        calls = []
        for shard, stub in enumerate(self.stubs):
            # (lookup, table, its IDs on this shard): the call's segments, in this order.
            asked = [
                (i, table, ids)
                for i, plan in enumerate(plans)
                for table, p in plan.tables.items()
                if len(ids := p.shard_ids(shard))
            ]
            if asked:
                request = pb.ShardLookupRequest(
                    read_only=read_only,
                    row_dtype=row_dtype,
                    tables=[table for _, table, _ in asked],
                    counts=[len(ids) for _, _, ids in asked],
                    ids=pb.Array(data=codec.pack_array(np.concatenate([ids for _, _, ids in asked]))),
                )
                calls.append((shard, asked, stub.Lookup(request)))
        answers = await asyncio.gather(*(self._answer(shard, call) for shard, _, call in calls))
        for (shard, asked, _), response in zip(calls, answers, strict=True):
            expected = [dims[table] for _, table, _ in asked]
            if list(response.dims) != expected:
                raise RuntimeError(
                    f"embedding_ps-{shard} answered rows of dims {list(response.dims)} for tables "
                    f"{[table for _, table, _ in asked]} of dims {expected}"
                )
            flat, start = codec.unpack_array(response.rows.data), 0
            if flat.dtype == np.float16:  # widened at once in the native core, not row by row by numpy
                flat = codec.from_fp16(flat, 1.0)
            for i, table, ids in asked:
                end = start + len(ids) * dims[table]
                rows[i][table][plans[i].tables[table].shard_rows[shard]] = flat[start:end].reshape(len(ids), -1)
                start = end
        return rows

    async def _answer(self, shard: int, call: grpc.aio.UnaryUnaryCall) -> pb.ShardLookupResponse:
        try:
            return await call
        except grpc.aio.AioRpcError as err:  # say which shard, in one line (not the raw dump)
            raise ShardUnavailable(
                f"embedding_ps-{shard} at {self.addresses[shard]}: {err.code().name}: {err.details()}"
            ) from None
