"""The IDs a forget removed (`ForgetMask`, trillium/job/record.py), masked in the training
batches written before it. A later attempt that recovers from an older checkpoint replays those
batches under the same batch_ids: in them a forgotten ID is asked of no PS shard (a training
lookup would create its row again), reads as zeros (as an unknown ID does in evaluation), and
sends no gradient. In a batch after the mask's `through_batch` the same ID is new data, trained
as any new ID.

Evaluation lookups are not masked: they create no rows (a removed row reads as zeros), and their
batch_ids count the eval topic's batches, not the training batches a mask's `through_batch` counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from trillium import pooling
from trillium.job.record import ForgetMask


@dataclass(frozen=True)
class MaskedPlan(pooling.BatchPlan):
    """A training batch's plan with its forgotten IDs routed to no shard: in their tables
    `shard_rows` are index arrays of the IDs kept (not slices), so the lookup asks for those only
    and `produce_gradients` sends only theirs. `lookup_rows` zeroes the `masked` rows."""

    masked: dict[str, np.ndarray]  # table -> int64[]: positions in its `ids` of the forgotten IDs


class Forgotten:
    """A job's masks (oldest first, as `JobRecord.forgotten` holds them), per table: the forgotten
    IDs, sorted, each with the newest batch it is masked in (the largest `through_batch` of the
    masks that name it): ID x is masked in batch b iff that is >= b."""

    def __init__(self, masks: Sequence[ForgetMask]) -> None:
        self.through = max((m.through_batch for m in masks), default=-1)  # no later batch is masked
        self.tables: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # table -> (uint64[N], int64[N])
        for table in {t for m in masks for t in m.tables}:
            named = [(np.asarray(m.tables[table], np.uint64), m.through_batch) for m in masks if m.tables.get(table)]
            if not named:
                continue
            ids = np.concatenate([i for i, _ in named])
            through = np.concatenate([np.full(len(i), b, np.int64) for i, b in named])
            order = np.lexsort((through, ids))  # by ID, then through_batch: an ID's last is its newest
            ids, through = ids[order], through[order]
            last = np.append(ids[1:] != ids[:-1], True)
            self.tables[table] = (ids[last], through[last])

    def masked(self, table: str, ids: np.ndarray, batch_id: int) -> np.ndarray:
        """bool[len(ids)]: which of `ids` (uint64) are masked in batch `batch_id`."""
        if table not in self.tables or batch_id > self.through:
            return np.zeros(len(ids), bool)
        forgotten, through = self.tables[table]
        at = np.minimum(np.searchsorted(forgotten, ids), len(forgotten) - 1)
        return (forgotten[at] == ids) & (through[at] >= batch_id)

    def mask(self, plan: pooling.BatchPlan, batch_id: int) -> pooling.BatchPlan:
        """The plan of a training lookup of batch `batch_id`: a `MaskedPlan` if any of its IDs are
        masked in it, else `plan` itself."""
        if batch_id > self.through:
            return plan
        tables, masked = dict(plan.tables), {}
        for table, p in plan.tables.items():
            hit = self.masked(table, p.ids, batch_id)
            if hit.any():
                kept = [rows.start + np.flatnonzero(~hit[rows]) for rows in p.shard_rows]
                tables[table] = pooling.TablePlan(p.ids, kept)
                masked[table] = np.flatnonzero(hit)
        if not masked:
            return plan
        return MaskedPlan(plan.layout, plan.batch_size, tables, plan.native, masked)
