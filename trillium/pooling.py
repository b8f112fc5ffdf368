"""A batch's embedding work, done by the native core (`trillium_native.PoolingLayout`, the same
core the embedding worker's native plane runs: native/src/pooling.rs): dedup IDs per table (slots
sharing a table share rows), route them to PS shards, pool the looked-up rows per feature slot,
and (backwards) turn the gradients of the pooled embeddings into one summed gradient per unique
ID and shard. Serving pools with it; the worker's plane calls the core from Rust, the Layout
built here. Python does no numpy or torch work per slot or ID: per slot it only hands out views.

Letters: B samples; slot f reads table t(f) of dim D_f; P = sum of D_f over the pooled
(`sum`/`mean`) slots; U_t unique IDs of table t in the batch.

    layout = Layout(slots, tables, num_shards)     # once per job
    p = plan(layout, keyed_ids)                    # p.tables[t].ids: uint64[U_t], by shard
    rows[t][p.tables[t].shard_rows[s]] = <shard s's lookup of p.tables[t].ids[shard_rows[s]]>
    out = pool(p, rows)                            # out.pooled: [B, P]; out.sequences
    grads = scatter_gradients(p, slot_grads)       # per table float32[U_t, D], plan order

A table's unique IDs are grouped by owning shard, so each shard's IDs, rows and gradients
are contiguous: `shard_rows` are slices, and a lookup request or gradient message per
shard takes views, no gathers. `plan()` keeps everything the backward pass needs, so a
gradient push is pure scatter. Inputs are validated by the native core (shapes, dtypes,
a sequence longer than its `max_len`): ValueError, TypeError, KeyError name the slot.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

import trillium_native
from trillium.job import FeatureSlot, TableConfig
from trillium.wire.batch import KeyedIds


class Layout:
    """The job's feature slots over its tables and PS shards (built once per job)."""

    def __init__(self, slots: Sequence[FeatureSlot], tables: Mapping[str, TableConfig], num_shards: int) -> None:
        self.slots = list(slots)
        self.native = trillium_native.PoolingLayout(
            [(s.name, s.table, s.pooling, s.max_len) for s in self.slots],
            {name: t.dim for name, t in tables.items()},
            num_shards,
        )
        self.tables: list[str] = self.native.tables  # the tables the slots read
        self.columns = self.native.columns  # per slot: (start, stop) in pooled, or None
        self.num_shards = num_shards


@dataclass(frozen=True)
class TablePlan:
    ids: np.ndarray  # uint64[U]: the batch's unique IDs of this table, grouped by owning shard
    shard_rows: list[slice]  # per shard: its range of `ids` (and of the rows and gradients)

    def shard_ids(self, shard: int) -> np.ndarray:
        return self.ids[self.shard_rows[shard]]


@dataclass(frozen=True)
class BatchPlan:
    layout: Layout
    batch_size: int
    tables: dict[str, TablePlan]
    native: trillium_native.PoolingPlan


@dataclass(frozen=True)
class Pooled:
    """The model's embedding inputs of one batch."""

    layout: Layout
    pooled: np.ndarray  # float32|float16[B, P]: pooled slots side by side
    sequences: list[tuple[np.ndarray, np.ndarray]]  # per sequence slot: ([B, max_len, D], bool[B, max_len])

    def slots(self) -> list[tuple[np.ndarray, np.ndarray | None]]:
        """Per slot, in slot order: (values, mask); pooled slots are column views of `pooled`."""
        seqs = iter(self.sequences)
        return [(self.pooled[:, c[0] : c[1]], None) if c is not None else next(seqs) for c in self.layout.columns]


def plan(layout: Layout, ids: KeyedIds) -> BatchPlan:
    """Dedup per table and route by the ownership function."""
    native = layout.native.plan(ids.keys, ids.values, ids.lengths)
    tables = {}
    for table, unique, offsets in zip(layout.tables, native.ids, native.shard_offsets, strict=True):
        bounds = offsets.tolist()
        tables[table] = TablePlan(unique, [slice(a, b) for a, b in itertools.pairwise(bounds)])
    return BatchPlan(layout, native.batch_size, tables, native)


def pool(p: BatchPlan, rows: Mapping[str, np.ndarray], *, fp16: bool = False) -> Pooled:
    """Pool each table's looked-up rows (float32 [U_t, D], plan order) per slot."""
    pooled, sequences = p.native.pool([rows[t] for t in p.layout.tables], out_dtype="float16" if fp16 else "float32")
    return Pooled(p.layout, pooled, sequences)


def scatter_gradients(p: BatchPlan, grads: Sequence[np.ndarray]) -> dict[str, np.ndarray]:
    """Per table: the gradient of each unique ID [U, D] (plan order), summed over every use in
    the batch, from the gradients of `Pooled.slots()` (one float32 array per slot, in slot
    order; the pooled slots' ones are taken apart, not joined into [B, P] first)."""
    layout = p.layout
    if len(grads) != len(layout.slots):
        raise ValueError(f"expected a gradient per slot ({len(layout.slots)}), got {len(grads)}")
    pooled = [g for g, cols in zip(grads, layout.columns, strict=True) if cols is not None]
    sequences = [g for g, cols in zip(grads, layout.columns, strict=True) if cols is None]
    return dict(zip(layout.tables, p.native.scatter(pooled, sequences), strict=True))
