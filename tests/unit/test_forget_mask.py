"""A forget's masks in the embedding worker (services/embedding_worker/forget.py): an ID that a mask
names for a table is masked in the training batches up to the mask's `through_batch` and not after,
by any of several masks; checked against sets. A masked plan routes those IDs to no PS shard: a
lookup through real PS shards (their servicer and native store, on loopback) creates no row for
them and reads them as zeros, and the gradients sent skip them. The servicer masks training
lookups only."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import grpc
import numpy as np
import pytest
from grpc_in_thread import channel_to
from shard_server import shard_server
from tiny_record import tiny_record, worker_context

import trillium_native
from trillium import pooling
from trillium.config import GrpcCredentials
from trillium.job.record import ForgetMask
from trillium.services.embedding_worker.forget import Forgotten, MaskedPlan
from trillium.services.embedding_worker.server import EmbeddingWorker
from trillium.services.embedding_worker.server import _Servicer as WorkerServicer
from trillium.wire import codec, rpc
from trillium.wire.batch import Batch, KeyedIds
from trillium.wire.pb import embedding_pb2 as pb
from trillium.wire.pb import embedding_pb2_grpc as pb_grpc

TOKEN = "the-stack-token-0123456789"
METADATA = (("authorization", f"Bearer {TOKEN}"),)
# The tiny job's tables are a and b; c is no table of it.
MASKS = [
    ForgetMask(receipt="r1", tables={"a": [1, 2, 3, 1 << 63, (1 << 64) - 1], "b": [7]}, through_batch=10),
    ForgetMask(receipt="r2", tables={"a": [3, 4, 9], "c": [5]}, through_batch=25),
    ForgetMask(receipt="r3", tables={"a": [2, 11], "b": []}, through_batch=4),
]


def oracle(masks: list[ForgetMask], table: str, batch_id: int) -> set[int]:
    """The IDs of `table` masked in batch `batch_id`: those of every mask through it or later."""
    return {i for m in masks if m.through_batch >= batch_id for i in m.tables.get(table, [])}


def random_masks(rng: np.random.Generator) -> list[ForgetMask]:
    """A few masks of overlapping IDs over tables a, b and c, some tables left out of some."""
    return [
        ForgetMask(
            receipt=f"r{k}",
            tables={t: rng.integers(0, 60, rng.integers(0, 30)).tolist() for t in "abc" if rng.random() < 0.7},
            through_batch=int(rng.integers(0, 40)),
        )
        for k in range(rng.integers(1, 5))
    ]


def test_an_id_is_masked_through_the_newest_batch_of_a_mask_naming_it() -> None:
    ids = np.array([0, 1, 2, 3, 4, 5, 7, 9, 11, 12, 1 << 63, (1 << 64) - 2, (1 << 64) - 1], np.uint64)
    cases = [(MASKS, ids)] + [
        (m, np.arange(70, dtype=np.uint64)) for m in map(random_masks, map(np.random.default_rng, range(30)))
    ]
    for masks, queried in cases:
        forgotten = Forgotten(masks)
        for table in ("a", "b", "c", "z"):
            for batch_id in range(-1, 45):
                expected = oracle(masks, table, batch_id)
                got = forgotten.masked(table, queried, batch_id)
                assert got.tolist() == [i in expected for i in queried.tolist()], (masks, table, batch_id)
    assert Forgotten([]).masked("a", ids, 0).tolist() == [False] * len(ids)


def tiny_ids(seed: int, size: int = 8) -> KeyedIds:
    """IDs of the tiny job's 26 slots, one each, from a small vocabulary: the masks' IDs among them."""
    keys = tuple(f"c{i}" for i in range(1, 27))
    values = np.random.default_rng(seed).integers(0, 14, len(keys) * size, dtype=np.uint64)
    return KeyedIds(keys, values, np.ones(len(keys) * size, dtype=np.int32))


def tiny_plan(seed: int) -> pooling.BatchPlan:
    config = tiny_record().config
    return pooling.plan(pooling.Layout(config.slots, config.tables, config.topology.ps_shards), tiny_ids(seed))


def test_a_masked_plan_routes_the_masked_ids_to_no_shard() -> None:
    forgotten = Forgotten(MASKS)
    for seed in range(5):
        plan = tiny_plan(seed)
        for batch_id in (0, 4, 5, 10, 11, 25, 26):
            masked = forgotten.mask(plan, batch_id)
            gone = {t: oracle(MASKS, t, batch_id) & set(p.ids.tolist()) for t, p in plan.tables.items()}
            if not any(gone.values()):
                assert masked is plan
                continue
            assert isinstance(masked, MaskedPlan) and masked.native is plan.native
            for table, p in plan.tables.items():
                assert set(p.ids[masked.masked.get(table, [])].tolist()) == gone[table]
                grads = np.arange(len(p.ids), dtype=np.float32)  # a gradient row per ID, its position
                for shard in range(2):
                    rows = masked.tables[table].shard_rows[shard]
                    kept = p.shard_ids(shard)[~np.isin(p.shard_ids(shard), list(gone[table]))]
                    # what a lookup asks and a gradient message holds (produce_gradients), in plan order
                    assert masked.tables[table].ids[rows].tolist() == kept.tolist()
                    assert p.ids[grads[rows].astype(int)].tolist() == kept.tolist()


class Shard:
    """A real native store holding the tiny job's tables, served by a PS shard's native server."""

    def __init__(self, index: int) -> None:
        self.store = trillium_native.EmbeddingStore(threads=1)
        for name, table in tiny_record().config.tables.items():
            self.store.create_table(name, table.dim, seed=7)


async def test_a_replayed_lookup_asks_no_shard_for_a_forgotten_id_and_reads_zeros() -> None:
    shards = [Shard(0), Shard(1)]
    with contextlib.ExitStack() as servers:
        ports = [servers.enter_context(shard_server(sh.store, TOKEN, shard=i)).port for i, sh in enumerate(shards)]
        await _replayed_lookups(shards, ports)


async def _replayed_lookups(shards: list[Shard], ports: list[int]) -> None:
    channels = [rpc.channel(f"127.0.0.1:{port}", GrpcCredentials(token=TOKEN)) for port in ports]
    record = tiny_record("running", 1)
    record.forgotten = MASKS
    ctx = SimpleNamespace(
        job=record,
        ps=[rpc.OrderedStream(pb_grpc.EmbeddingParameterServerStub(c).Lookups) for c in channels],
        ps_addresses=[f"127.0.0.1:{port}" for port in ports],
    )
    worker = EmbeddingWorker.__new__(EmbeddingWorker)
    plan, forgotten = tiny_plan(0), Forgotten(MASKS)
    try:
        rows = await worker.lookup_rows(ctx, forgotten.mask(plan, 10))
        for table, p in plan.tables.items():
            gone = np.isin(p.ids, list(oracle(MASKS, table, 10)))
            assert gone.any() and not gone.all(), table  # the batch holds both
            assert not rows[table][gone].any()
            for shard, held in enumerate(shards):
                owned = np.zeros(len(p.ids), bool)
                owned[p.shard_rows[shard]] = True
                assert held.store.num_rows(table) == (owned & ~gone).sum()
                for i in np.flatnonzero(owned):
                    row = held.store.get_row(table, int(p.ids[i]))
                    assert row is None if gone[i] else np.array_equal(row, rows[table][i]) and row.any()
        # after through_batch the same IDs are new data: looked up, their rows created
        assert forgotten.mask(plan, 26) is plan
        rows = await worker.lookup_rows(ctx, plan)
        for table, p in plan.tables.items():
            assert sum(held.store.num_rows(table) for held in shards) == len(p.ids)
            assert np.abs(rows[table]).sum(axis=1).all()
    finally:
        for stream in ctx.ps:
            await stream.close()
        for channel in channels:
            await channel.close()


class Worker:
    """What the worker servicer reads of its worker (as tests/security/test_grpc_fuzz_worker.py
    has it): the tiny job with MASKS, rows of zeros, and the plans it was handed."""

    name = "embedding_worker-0"

    def __init__(self) -> None:
        job = tiny_record("running", 1)
        job.forgotten = MASKS
        self.ctx = worker_context(job, forgotten=Forgotten(MASKS))
        self.plans: list[pooling.BatchPlan] = []

    async def wait_for_staleness(self, ctx, batch_id: int) -> int:
        return 0

    async def lookup_rows(self, ctx, plan, *, evaluation: bool = False, fp16: bool = False) -> dict[str, np.ndarray]:
        self.plans.append(plan)
        dims = {name: table.dim for name, table in ctx.job.config.tables.items()}
        return {t: np.zeros((len(p.ids), dims[t]), dtype=np.float32) for t, p in plan.tables.items()}


def test_the_servicer_masks_training_lookups_up_to_the_newest_mask() -> None:
    worker = Worker()
    service = pb.DESCRIPTOR.services_by_name["EmbeddingWorker"].full_name
    with channel_to(
        lambda s: pb_grpc.add_EmbeddingWorkerServicer_to_server(WorkerServicer(worker), s), TOKEN
    ) as channel:
        lookup = channel.stream_stream(f"/{service}/LookupBatches")
        for batch_id, training in ((10, True), (25, True), (26, True), (10, False)):
            size, rank = 8, batch_id % 2
            batch = Batch(
                batch_id, 0, rank, tiny_ids(0, size), np.zeros((size, 13), np.float32), np.zeros(size, np.float32)
            )
            request = pb.BatchLookupRequest(batch=codec.encode_batch(batch), training=training, attempt=1)
            try:
                next(iter(lookup(iter([request.SerializeToString()]), metadata=METADATA, timeout=20)))
            except grpc.RpcError as err:
                pytest.fail(f"batch {batch_id}: {err.code()}: {err.details()}")
    masked = [isinstance(plan, MaskedPlan) for plan in worker.plans]
    assert masked == [True, True, False, False]  # 25: mask r2 names 3, 4 and 9; evaluation unmasked
    assert worker.ctx.pending[(0, 10)] is worker.plans[0]  # its gradients go by the masked plan
