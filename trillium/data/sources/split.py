"""Which rows of the train files are the test split, when a job gives a split policy instead of
test files (`data.split`; the policies are `FractionSplit` and `ColumnSplit` in trillium.job).

- `{by: fraction, test_fraction: f, seed: s}`: a row is in the test split when a stable hash of
  `(s, its place)` falls below `f`; its place is `(file, block, index in block)`, with blocks
  as `files.py` cuts them (for Parquet, `(file, row number)`). So the split is the same for
  every epoch, every loader and every way of sharing the input, and a CSV file and its Parquet form
  split differently.
- `{by: <column>, test_from: v}`: a row is in the test split when its column is >= v (a cut in
  time): compared as numbers when v is one, else as text. A row whose value is missing or, for a
  number, not numeric, is in neither split: it is reported (`split_value`) with the train split.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

import trillium_native
from trillium.data.sources.cells import as_numbers, as_text, present
from trillium.data.sources.rows import Split

if TYPE_CHECKING:
    from trillium.job import SplitPolicy

__all__ = ["policy_column", "split_rows"]

_BUCKETS = 1 << 30  # a row's draw is one of this many buckets
# Row places are packed into one u64 key: file (20 bits) | block (22 bits) | index (22 bits).
FILE_SHIFT, BLOCK_SHIFT = 44, 22


def policy_column(policy: SplitPolicy | None) -> str | None:
    """The column a policy reads, if any."""
    return policy.by if policy is not None and policy.by != "fraction" else None


def split_rows(
    policy: SplitPolicy | None, table: pa.Table, split: Split, first_key: int
) -> tuple[np.ndarray | None, dict[int, str]]:
    """`(keep, problems)`: which rows of `table` belong to `split` (None: all of them), and
    `{row: reason}` of rows in neither split (given for the train split only, so that each is
    reported once). Row `i`'s place is `first_key + i`."""
    if policy is None:
        return None, {}
    n = table.num_rows
    problems: dict[int, str] = {}
    if policy.by == "fraction":
        keys = np.arange(first_key, first_key + n, dtype=np.uint64)
        salt = trillium_native.hash_ints("split", np.array([policy.seed], np.int64))
        # shard_of is the stable splitmix64 hash of the key, mod the bucket count.
        buckets = trillium_native.shard_of(keys ^ salt, _BUCKETS)
        test = buckets < round(policy.test_fraction * _BUCKETS)
        return (test if split == "test" else ~test), {}
    column = table.column(policy.by)
    if isinstance(policy.test_from, (int, float)):
        values, problems = as_numbers(column, policy.by)
        missing = np.isnan(values)
        test = np.greater_equal(values, policy.test_from, where=~missing, out=np.zeros(n, bool))
    else:
        text = as_text(column)
        missing = ~present(text)
        test = pc.fill_null(pc.greater_equal(text, policy.test_from), False).to_numpy(zero_copy_only=False)
    for i in np.flatnonzero(missing):
        problems.setdefault(int(i), f"{policy.by}: missing value")
    keep = test if split == "test" else ~test
    keep[list(problems)] = False
    return keep, problems if split == "train" else {}
