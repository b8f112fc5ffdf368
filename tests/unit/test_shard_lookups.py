"""The embedding worker's shard lookups: lookups released together share one call per PS
shard, and each gets exactly the rows it would have got alone. Two real PS servicers, each
over its own native store, behind in-process gRPC servers."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from types import SimpleNamespace

import grpc
import numpy as np

import trillium_native
from trillium import pooling
from trillium.job import FeatureSlot, TableConfig
from trillium.services.embedding_ps.server import _Servicer
from trillium.services.embedding_worker.shard_lookups import LOOKUPS_PER_CALL, ShardLookups, ShardUnavailable
from trillium.wire.batch import KeyedIds
from trillium.wire.pb import embedding_pb2_grpc as pb_grpc

TABLES = {"a": TableConfig(dim=4), "b": TableConfig(dim=3)}
SLOTS = [FeatureSlot(name="x", column="C0", table="a"), FeatureSlot(name="y", column="C1", table="b", pooling="mean")]
LAYOUT = pooling.Layout(SLOTS, TABLES, 2)


def _plan(seed: int, first_id: int = 0) -> pooling.BatchPlan:
    """A batch of 6 samples whose IDs overlap other seeds' (a universe of 20 from `first_id`)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 4, 12).astype(np.int32)
    values = rng.integers(first_id, first_id + 20, int(lengths.sum())).astype(np.uint64)
    x, y = lengths[:6], lengths[6:]
    return pooling.plan(LAYOUT, KeyedIds.from_slots({"x": (values[: x.sum()], x), "y": (values[x.sum() :], y)}))


def _calls_and_lookups() -> tuple[float, float]:
    samples = {s.name: s.value for s in LOOKUPS_PER_CALL.collect()[0].samples}
    return samples["trillium_lookups_per_shard_call_count"], samples["trillium_lookups_per_shard_call_sum"]


@contextlib.asynccontextmanager
async def _shards() -> AsyncIterator[tuple[ShardLookups, list[grpc.aio.Server]]]:
    servers, channels, stubs = [], [], []
    for shard in range(2):
        store = trillium_native.EmbeddingStore(threads=1)
        for name, table in TABLES.items():
            store.create_table(name, **table.store_kwargs(seed=3))
        ps = SimpleNamespace(store=store, disk_tier=False, settings=SimpleNamespace(index=shard), name=f"ps-{shard}")
        server = grpc.aio.server()
        pb_grpc.add_EmbeddingParameterServerServicer_to_server(_Servicer(ps), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        servers.append(server)
        channels.append(channel)
        stubs.append(pb_grpc.EmbeddingParameterServerStub(channel))
    yield ShardLookups(stubs, [f"shard {s}" for s in range(2)], TABLES), servers
    for channel in channels:
        await channel.close()
    for server in servers:
        await server.stop(None)


async def test_lookups_released_together_share_a_call_per_shard_and_get_their_own_rows() -> None:
    async with _shards() as (lookups, _):
        plans = [_plan(seed) for seed in range(3)]
        calls, asked = _calls_and_lookups()
        together = await asyncio.gather(*(lookups.rows(p, read_only=False, row_dtype="float32") for p in plans))
        assert _calls_and_lookups() == (calls + 1, asked + 3)
        alone = [await lookups.rows(p, read_only=False, row_dtype="float32") for p in plans]
        assert _calls_and_lookups() == (calls + 4, asked + 6)
        for plan, shared, own in zip(plans, together, alone, strict=True):
            assert set(shared) == set(own) == set(plan.tables)
            for table, rows in own.items():
                assert rows.shape == (len(plan.tables[table].ids), TABLES[table].dim)
                assert np.abs(rows).sum() > 0  # created and initialized, not zeros
                np.testing.assert_array_equal(shared[table], rows)
        # An ID in two plans got one row: the same in both.
        first, second = plans[0].tables["a"], plans[1].tables["a"]
        common = np.intersect1d(first.ids, second.ids)
        assert len(common)
        index = lambda ids: {int(i): k for k, i in enumerate(ids)}  # noqa: E731
        i0, i1 = index(first.ids), index(second.ids)
        for i in common:
            np.testing.assert_array_equal(together[0]["a"][i0[int(i)]], together[1]["a"][i1[int(i)]])


async def test_only_alike_lookups_share_a_call() -> None:
    """A read-only lookup reads unknown IDs as zeros and creates nothing, beside a training one."""
    async with _shards() as (lookups, _):
        fresh = _plan(7, first_id=1000)  # no other lookup asks for these
        calls, _ = _calls_and_lookups()
        read, half = await asyncio.gather(
            lookups.rows(fresh, read_only=True, row_dtype="float32"),
            lookups.rows(_plan(8), read_only=False, row_dtype="float16"),
        )
        assert _calls_and_lookups()[0] == calls + 2
        assert all(not rows.any() for rows in read.values())
        assert all(rows.dtype == np.float32 and rows.any() for rows in half.values())


async def test_a_shard_down_fails_every_lookup_of_the_call_naming_it() -> None:
    async with _shards() as (lookups, servers):
        await servers[1].stop(None)
        results = await asyncio.gather(
            *(lookups.rows(_plan(seed), read_only=False, row_dtype="float32") for seed in range(2)),
            return_exceptions=True,
        )
        for result in results:
            assert isinstance(result, ShardUnavailable) and "embedding_ps-1 at shard 1: UNAVAILABLE" in str(result)
