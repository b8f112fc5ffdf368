"""What the embedding worker's native plane should answer, computed with numpy from what the PS
shards hold (tests/worker_plane.py serves them): the pooled embeddings of a batch of the tiny job
and the gradient of each unique ID; and two NN ranks' streams to the plane."""

from __future__ import annotations

import asyncio
from collections import defaultdict

import grpc
import numpy as np
from tiny_record import tiny_record
from worker_plane import METADATA

from trillium.job.record import JobRecord
from trillium.wire import codec
from trillium.wire.batch import Batch, KeyedIds
from trillium.wire.pb import embedding_pb2 as pb
from trillium.wire.pb import embedding_pb2_grpc as pb_grpc

KEYS = tuple(f"c{i}" for i in range(1, 27))
SIZE = 8


def random_ids(seed: int) -> KeyedIds:
    """0 to 3 IDs a sample and slot from a small vocabulary: repeats within and across slots."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 4, len(KEYS) * SIZE).astype(np.int32)
    return KeyedIds(KEYS, rng.integers(0, 12, int(lengths.sum()), dtype=np.uint64), lengths)


def encoded(batch_id: int, ids: KeyedIds) -> bytes:
    rank = batch_id % 2
    return codec.encode_batch(
        Batch(batch_id, 0, rank, ids, np.zeros((SIZE, 13), np.float32), np.zeros(SIZE, np.float32))
    )


def row(stores, table: str, id_: int, *, missing_as_zeros: bool = False) -> np.ndarray:
    """The row of `id_` on the one shard that holds it (zeros where none does, if allowed)."""
    held = [r for r in (s.get_row(table, id_) for s in stores) if r is not None]
    if not held and missing_as_zeros:
        return np.zeros(tiny_record().config.tables[table].dim, np.float32)
    assert len(held) == 1, (table, id_, len(held))
    return held[0]


def slot_columns(widths: list[int]) -> list[tuple[int, int]]:
    bounds = np.concatenate([[0], np.cumsum(widths)])
    return [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def pooled_oracle(
    stores, ids: KeyedIds, *, missing_as_zeros: bool = False, rows_as=np.float32, size: int = SIZE
) -> np.ndarray:
    """Each slot's rows pooled in float32, as the shards hold them (rounded to `rows_as` first)."""
    config = tiny_record().config
    out = []
    for slot in config.slots:
        values, lengths = ids.slot(slot.name)
        start, pooled = 0, np.zeros((size, config.tables[slot.table].dim), np.float32)
        for i, n in enumerate(lengths):
            for id_ in values[start : start + n]:
                held = row(stores, slot.table, int(id_), missing_as_zeros=missing_as_zeros)
                pooled[i] += held.astype(rows_as).astype(np.float32)
            if slot.pooling == "mean" and n > 1:
                pooled[i] /= n
            start += n
        out.append(pooled)
    return np.concatenate(out, axis=1)


def gradient_oracle(ids: KeyedIds, grad: np.ndarray, widths: list[int]) -> dict[tuple[str, int], np.ndarray]:
    config = tiny_record().config
    out: dict[tuple[str, int], np.ndarray] = defaultdict(lambda: 0.0)
    for slot, (a, b) in zip(config.slots, slot_columns(widths), strict=True):
        values, lengths = ids.slot(slot.name)
        start = 0
        for i, n in enumerate(lengths):
            for id_ in values[start : start + n]:
                share = grad[i, a:b] / (n if slot.pooling == "mean" and n > 1 else 1)
                out[(slot.table, int(id_))] = out[(slot.table, int(id_))] + share
            start += n
    return dict(out)


def tiny_job(wire_dtype: str) -> JobRecord:
    """The tiny job's attempt 1, its gradients on the wire as `wire_dtype`."""
    record = tiny_record("running", 1)
    training = record.config.training.model_copy(update={"wire_dtype": wire_dtype})
    record.config = record.config.model_copy(update={"training": training})
    return record


class Ranks:
    """Two ranks' streams to the plane (lookups and pushes of each)."""

    def __init__(self, port: int) -> None:
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        stub = pb_grpc.EmbeddingWorkerStub(self.channel)
        self.calls = {
            (kind, rank): (stub.LookupBatches if kind == "lookup" else stub.PushGradients)(metadata=METADATA)
            for kind in ("lookup", "push")
            for rank in (0, 1)
        }
        self.reads: dict[int, asyncio.Task] = {}  # each push stream's last answer read

    async def lookup(self, rank: int, request: pb.BatchLookupRequest) -> pb.BatchLookupResponse:
        call = self.calls[("lookup", rank)]
        await call.write(request)
        return await call.read()

    async def push(self, rank: int, request: pb.PushGradientsRequest) -> asyncio.Task:
        """Write a push; its answer to await later (a stream's answers are read one at a time, in order)."""
        call = self.calls[("push", rank)]
        await call.write(request)
        before = self.reads.get(rank)

        async def read() -> pb.PushGradientsResponse:
            if before is not None:
                await asyncio.wait([before])
            return await call.read()

        self.reads[rank] = task = asyncio.create_task(read())
        return task

    async def close(self) -> None:
        await self.channel.close()


def push_of(answer: pb.BatchLookupResponse, grad: np.ndarray) -> pb.PushGradientsRequest:
    return pb.PushGradientsRequest(ref=answer.ref, pooled=pb.Array(data=codec.pack_array(grad)))
