"""A forget's masks in the embedding worker's native plane (native/src/worker/forget.rs; its masking
of IDs by batch is checked against sets in its Rust tests): in a training batch up to a mask's
`through_batch` the IDs it names are asked of no PS shard, so the real shards behind the plane
create no row for them, they read as zeros, and the gradients sent skip them; after it, the same
IDs are new data. Evaluation lookups are not masked."""

from __future__ import annotations

import asyncio

import numpy as np
from worker_oracle import SIZE, Ranks, encoded, pooled_oracle, push_of, row, tiny_job
from worker_plane import shard_servers, tiny_shards, worker_plane

from trillium.job.record import ForgetMask
from trillium.wire import codec
from trillium.wire.batch import KeyedIds
from trillium.wire.pb import embedding_pb2 as pb

# The tiny job's tables are a and b; c is no table of it.
MASKS = [
    ForgetMask(receipt="r1", tables={"a": [1, 2, 3, 1 << 63, (1 << 64) - 1], "b": [7]}, through_batch=10),
    ForgetMask(receipt="r2", tables={"a": [3, 4, 9], "c": [5]}, through_batch=25),
    ForgetMask(receipt="r3", tables={"a": [2, 11], "b": []}, through_batch=4),
]


def oracle(table: str, batch_id: int) -> set[int]:
    """The IDs of `table` masked in batch `batch_id`: those of every mask through it or later."""
    return {i for m in MASKS if m.through_batch >= batch_id for i in m.tables.get(table, [])}


def tiny_ids(seed: int) -> KeyedIds:
    """IDs of the tiny job's 26 slots, one each, from a small vocabulary: the masks' IDs among them."""
    keys = tuple(f"c{i}" for i in range(1, 27))
    values = np.random.default_rng(seed).integers(0, 14, len(keys) * SIZE, dtype=np.uint64)
    return KeyedIds(keys, values, np.ones(len(keys) * SIZE, dtype=np.int32))


def held(stores, table: str) -> set[int]:
    return {i for i in range(14) if any(s.get_row(table, i) is not None for s in stores)}


async def test_a_replayed_training_lookup_asks_no_shard_for_a_forgotten_id_and_sends_no_gradient() -> None:
    stores, record = tiny_shards(), tiny_job("fp32")
    record.forgotten = MASKS
    ids = tiny_ids(0)
    used = {t: {int(i) for s in record.config.slots if s.table == t for i in ids.slot(s.name)[0]} for t in "ab"}
    with shard_servers(stores, record) as ports, worker_plane(record, ports, ranks=[0, 1]) as plane:
        ranks = Ranks(plane.server.port)
        try:
            # Batch 10 (rank 0): masked by r1 and r2, not r3.
            answer = await ranks.lookup(0, pb.BatchLookupRequest(batch=encoded(10, ids), training=True, attempt=1))
            for table in "ab":
                gone = oracle(table, 10) & used[table]
                assert gone and used[table] - gone, table  # the batch holds both
                assert held(stores, table) == used[table] - gone
            pooled = codec.unpack_array(answer.pooled.data)
            np.testing.assert_allclose(pooled, pooled_oracle(stores, ids, missing_as_zeros=True), rtol=1e-6, atol=1e-7)
            width = sum(answer.widths)
            other = await ranks.lookup(1, pb.BatchLookupRequest(batch=encoded(11, ids), training=True, attempt=1))
            pushes = [
                await ranks.push(rank, push_of(a, np.ones((SIZE, width), np.float32)))
                for rank, a in ((0, answer), (1, other))
            ]
            await asyncio.gather(*pushes)
            [(*_, frames)] = plane.wait_steps(1)
            sent: dict[str, list[int]] = {"a": [], "b": []}
            for frame in frames:
                for table, (table_ids, _) in codec.decode_gradients(frame).tables.items():
                    sent[table] += table_ids.tolist()
            for table in "ab":  # each rank's unique IDs but its batch's masked ones
                kept = sorted(used[table] - oracle(table, 10)) + sorted(used[table] - oracle(table, 11))
                assert sorted(sent[table]) == sorted(kept), table
            # Evaluation is not masked: it reads the rows there are (created above), as the job's
            # model versions serve them (publish.dtype fp16).
            read = await ranks.lookup(1, pb.BatchLookupRequest(batch=encoded(3, ids), training=False, attempt=1))
            served = pooled_oracle(stores, ids, missing_as_zeros=True, rows_as=np.float16)
            np.testing.assert_allclose(codec.unpack_array(read.pooled.data), served, rtol=1e-6, atol=1e-7)
            # After the newest mask's through_batch the same IDs are new data: looked up, rows created.
            await ranks.lookup(0, pb.BatchLookupRequest(batch=encoded(26, ids), training=True, attempt=1))
            for table in "ab":
                assert held(stores, table) == used[table]
                for i in used[table]:
                    assert row(stores, table, i).any()
        finally:
            await ranks.close()
