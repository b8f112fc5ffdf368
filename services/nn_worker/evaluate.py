"""Scoring a rank's partition of the eval topic, gathering every rank's scores on every rank,
the metrics over them, and the predictions in the order of the test batches (saved beside a
model version's files).

The gather carries data, never code: each rank's scores travel as msgpack (`encode`), their
arrays as raw bytes of the dtypes `Scored` fixes, in uint8 tensors over the control group; a
peer's bytes are checked against that layout (`decode`), never unpickled (`all_gather_object`
would run whatever a peer's pickle names).
"""

from __future__ import annotations

import io
import math
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple

import msgpack
import numpy as np
import torch
import torch.distributed as dist

from trillium import metrics
from trillium.models import Objective
from trillium.wire import codec

from .embeddings import embeddings_of
from .feed import EpochEnd, Feed


class Scored(NamedTuple):
    """A rank's scores of its test batches."""

    labels: np.ndarray  # float32[samples] (a multi-task job's [samples, T], NaN: no label)
    probs: np.ndarray  # float32, as `labels`: `Objective.scores`
    batch_ids: np.ndarray  # int64[samples]: each sample's batch
    groups: np.ndarray  # uint64[samples]: each sample's first ID in `evaluation.group_by`'s slot
    grouped: np.ndarray  # bool[samples]: whether it has one (all False without group_by)


async def score(
    feed: Feed, scores: Callable[..., Awaitable[np.ndarray]], group_by: str | None, objective: Objective
) -> Scored:
    """The labels, predicted probabilities, batch ids and GAUC groups (from slot `group_by`) of
    every batch of the feed's first epoch;
    `scores(batch, embeddings)` runs the model (on the rank's torch thread). The feed is stopped on
    the way out: its consumer, left running, would poll the job's topics forever — and, once they
    are deleted, spin on metadata requests (35% of a core per idle NN worker, and the broker's as much)."""
    labels, probs, batch_ids, groups, grouped = [], [], [], [], []
    try:
        while not isinstance(item := await feed.get(), EpochEnd):
            response = await item.lookup
            batch = codec.decode_batch(item.raw)
            probs.append(await scores(batch, embeddings_of(response)))
            labels.append(np.asarray(batch.labels))
            batch_ids.append(np.full(batch.batch_size, batch.batch_id, np.int64))
            if group_by is None:
                groups.append(np.zeros(batch.batch_size, np.uint64))
                grouped.append(np.zeros(batch.batch_size, bool))
            else:
                first, has = batch.ids.first(group_by)
                groups.append(first)
                grouped.append(has)
    finally:
        await feed.stop()
    if not labels:
        empty = np.zeros((0, *objective.label_shape), np.float32)
        return Scored(empty, empty, *(np.zeros(0, dtype) for dtype in (np.int64, np.uint64, bool)))
    return Scored(*(np.concatenate(x) for x in (labels, probs, batch_ids, groups, grouped)))


# Each field's dtype and numbers of dimensions it may have (labels: a one-label or a multi-task job's).
_LAYOUT = {
    "labels": (np.float32, (1, 2)),
    "probs": (np.float32, (1, 2)),
    "batch_ids": (np.int64, (1,)),
    "groups": (np.uint64, (1,)),
    "grouped": (np.bool_, (1,)),
}


def encode(scored: Scored) -> bytes:
    """`scored` as msgpack: a map of field name to [shape, raw bytes]."""
    fields = {}
    for name, (dtype, _) in _LAYOUT.items():
        array = np.ascontiguousarray(getattr(scored, name), dtype)
        fields[name] = [list(array.shape), array.tobytes()]
    return msgpack.packb(fields)


def decode(raw: bytes) -> Scored:
    """The scores `encode` wrote, checked against `_LAYOUT` (a peer wrote them); the arrays are
    read-only views of `raw`."""
    try:
        fields = msgpack.unpackb(raw)
    except (ValueError, TypeError) as err:
        raise codec.CodecError(f"scores: not msgpack ({err})") from None
    if not isinstance(fields, dict) or set(fields) != set(_LAYOUT):
        raise codec.CodecError(f"scores: fields must be {list(_LAYOUT)}")
    arrays = {}
    for name, (dtype, ndims) in _LAYOUT.items():
        match fields[name]:
            case [list(shape), bytes(data)] if len(shape) in ndims and all(type(n) is int and n >= 0 for n in shape):
                pass
            case _:
                raise codec.CodecError(f"scores: {name} must be [shape of {ndims} dimensions, bytes]")
        if len(data) != math.prod(shape) * np.dtype(dtype).itemsize:
            raise codec.CodecError(f"scores: {name} has {len(data)} bytes, not those of {np.dtype(dtype)}{shape}")
        # bool through uint8: any byte but 0 is True, as numpy would not make it from other bytes
        array = np.frombuffer(data, np.uint8) != 0 if dtype is np.bool_ else np.frombuffer(data, dtype)
        arrays[name] = array.reshape(shape)
    scored = Scored(**arrays)
    samples = {len(a) for a in scored}
    if len(samples) != 1 or scored.labels.shape != scored.probs.shape:
        raise codec.CodecError(f"scores: fields of {[a.shape for a in scored]} do not describe one set of samples")
    return scored


def gather_bytes(data: bytes, group: Any = None) -> list[bytes]:
    """Every rank's `data`, by rank: the lengths first, then every rank's bytes padded to the
    longest (all_gather takes tensors of one size), as uint8 tensors on the CPU (`group`: gloo)."""
    world = dist.get_world_size(group)
    length = torch.tensor([len(data)], dtype=torch.int64)
    lengths = [torch.zeros_like(length) for _ in range(world)]
    dist.all_gather(lengths, length, group=group)
    sizes = [int(n) for n in lengths]
    if min(sizes) < 0:
        raise codec.CodecError(f"gathered lengths {sizes}: negative")
    mine = torch.zeros(max(sizes), dtype=torch.uint8)
    mine.numpy()[: len(data)] = np.frombuffer(data, np.uint8)
    out = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(out, mine, group=group)
    return [t.numpy()[:n].tobytes() for t, n in zip(out, sizes, strict=True)]


def gather(scored: Scored, group: Any = None) -> list[Scored]:
    """Every rank's scores, on every rank, by rank (a collective of `group`; run it on the torch thread)."""
    return [decode(raw) for raw in gather_bytes(encode(scored), group)]


def summarize(gathered: list[Scored], group_by: str | None, objective: Objective) -> dict[str, Any]:
    """Every task's metrics over the scores of every rank (`tasks`, by name: `metrics.task_metrics`,
    GAUC over the samples that have a group with `group_by`), the first task's also at the top
    (a one-label job's `auc`, `logloss`, `gauc` as ever), and `samples`."""
    labels = np.concatenate([g.labels for g in gathered])
    probs = np.concatenate([g.probs for g in gathered])
    shape = (len(labels), -1)  # a one-label job's (N,) as one task's column
    groups = np.concatenate([g.groups for g in gathered]) if group_by is not None else None
    grouped = np.concatenate([g.grouped for g in gathered]) if group_by is not None else None
    kinds = [t.kind for t in objective.tasks]
    per_task = metrics.task_metrics(kinds, labels.reshape(shape), probs.reshape(shape), groups, grouped)
    return {**per_task[0], "samples": int(len(labels)), "tasks": dict(zip(objective.names, per_task, strict=True))}


def in_batch_order(gathered: list[Scored]) -> bytes:
    """Every rank's predictions as one float32 array ((samples,), or (samples, T) for several
    tasks) in the order of the test batches' ids (the test split's file order with one data
    loader), saved as `.npy` bytes."""
    probs = np.concatenate([g.probs for g in gathered]).astype(np.float32)
    order = np.argsort(np.concatenate([g.batch_ids for g in gathered]), kind="stable")
    out = io.BytesIO()
    np.save(out, probs[order])
    return out.getvalue()
