"""REFERENCE ONLY: the embedding worker's pooling as it was in numpy + torch, per slot in
Python, before it moved into the native core (issue 11). Kept unchanged as the oracle of
tests/unit/test_pooling.py and the baseline of bench/pooling.py; nothing else imports it.

Dedup IDs per table, route them to PS shards, pool the looked-up rows per feature slot, and
(backwards) turn the gradients of the pooled embeddings into one summed gradient per unique
ID and shard.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

import trillium_native
from trillium.job import FeatureSlot
from trillium.wire.batch import KeyedIds


@dataclass(frozen=True)
class TablePlan:
    ids: np.ndarray  # uint64[U]: the batch's unique IDs of this table
    shard_rows: list[np.ndarray]  # per shard: positions in `ids` owned by that shard


@dataclass(frozen=True)
class SlotPlan:
    slot: FeatureSlot
    inverse: torch.Tensor  # int64[n]: each ID's position in its table's unique IDs
    sample: torch.Tensor  # int64[n]: the sample each ID belongs to
    position: torch.Tensor | None  # int64[n]: position within the sequence (pooling "none")
    lengths: np.ndarray  # int32[B]


@dataclass(frozen=True)
class BatchPlan:
    batch_size: int
    tables: dict[str, TablePlan]
    slots: list[SlotPlan]


def plan(ids: KeyedIds, slots: list[FeatureSlot], num_shards: int) -> BatchPlan:
    """Dedup per table (slots sharing a table share rows) and route by the ownership function."""
    by_table: dict[str, list[tuple[FeatureSlot, np.ndarray, np.ndarray]]] = {}
    for slot in slots:
        values, lengths = ids.slot(slot.name)
        by_table.setdefault(slot.table, []).append((slot, values, lengths))
    batch = ids.batch_size
    tables: dict[str, TablePlan] = {}
    slot_plans: dict[str, SlotPlan] = {}
    for table, members in by_table.items():
        unique, inverse = np.unique(np.concatenate([v for _, v, _ in members]), return_inverse=True)
        owner = trillium_native.shard_of(unique, num_shards)
        tables[table] = TablePlan(unique, [np.flatnonzero(owner == s) for s in range(num_shards)])
        start = 0
        for slot, values, lengths in members:
            n = len(values)
            sample = np.repeat(np.arange(batch, dtype=np.int64), lengths)
            position = None
            if slot.pooling == "none":
                starts = np.cumsum(lengths, dtype=np.int64) - lengths
                position = torch.from_numpy(np.arange(n, dtype=np.int64) - starts[sample])
            slot_plans[slot.name] = SlotPlan(
                slot,
                torch.from_numpy(inverse[start : start + n].astype(np.int64)),
                torch.from_numpy(sample),
                position,
                np.asarray(lengths),
            )
            start += n
    return BatchPlan(batch, tables, [slot_plans[s.name] for s in slots])


def pool(p: BatchPlan, rows: dict[str, np.ndarray]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Per slot: the pooled embeddings [B, dim] (sequence slots: [B, max_len, dim] and a mask)."""
    out = []
    for sp in p.slots:
        table_rows = torch.from_numpy(rows[sp.slot.table])
        values = table_rows.index_select(0, sp.inverse)
        dim = table_rows.shape[1]
        if sp.position is None:
            pooled = torch.zeros(p.batch_size, dim).index_add_(0, sp.sample, values)
            if sp.slot.pooling == "mean":
                pooled /= torch.from_numpy(np.maximum(sp.lengths, 1).astype(np.float32)).unsqueeze(1)
            out.append((pooled, None))
        else:
            seq = torch.zeros(p.batch_size, sp.slot.max_len, dim)
            mask = torch.zeros(p.batch_size, sp.slot.max_len, dtype=torch.bool)
            seq[sp.sample, sp.position] = values
            mask[sp.sample, sp.position] = True
            out.append((seq, mask))
    return out


def scatter_gradients(p: BatchPlan, grads: list[np.ndarray]) -> dict[str, np.ndarray]:
    """Per table: the gradient of each unique ID [U, dim], summed over every use in the batch."""
    out: dict[str, torch.Tensor] = {}
    for sp, grad in zip(p.slots, grads, strict=True):
        g = torch.from_numpy(np.array(grad, dtype=np.float32))  # a writable float32 copy
        if sp.position is None:
            if sp.slot.pooling == "mean":
                g /= torch.from_numpy(np.maximum(sp.lengths, 1).astype(np.float32)).unsqueeze(1)
            per_id = g.index_select(0, sp.sample)
        else:
            per_id = g[sp.sample, sp.position]
        table = sp.slot.table
        if table not in out:
            out[table] = torch.zeros(len(p.tables[table].ids), g.shape[-1])
        out[table].index_add_(0, sp.inverse, per_id)
    return {t: g.numpy() for t, g in out.items()}
