"""What every source yields: blocks of rows as Arrow columns, with where each row came from.

A source turns its files into `RowBlock`s of one split: the columns asked for (text as Arrow
string arrays, Parquet columns in their stored types), only the rows of that split, in file order.
Rows a source cannot take (a wrong field count, a split column that is no number) are not in the
table: they come with the block as `Malformed` records. `RowBlock.locate` finds the file line
and raw text of rows that `trillium.data.features` rejects later; it is only called for those, so a
source may make it slow.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

if TYPE_CHECKING:  # annotations only: importing the package stays light (see __init__)
    import numpy as np
    import pyarrow as pa

    from trillium.job import JobConfig

__all__ = [
    "DENSE_VALUE",
    "FIELD_COUNT",
    "LABEL",
    "SPLIT_VALUE",
    "BlockTask",
    "Malformed",
    "RowBlock",
    "Source",
    "Split",
]

Split = Literal["train", "test"]

# Why a row is malformed: the keys of the counts the loader reports.
FIELD_COUNT, DENSE_VALUE, LABEL, SPLIT_VALUE = "field_count", "dense_value", "label", "split_value"


@dataclass(frozen=True)
class Malformed:
    """A row skipped, with where it is: quarantined as `{"file", "line", "reason", "raw"}`."""

    file: str
    line: int  # 1-based; for Parquet, the row's number in its file
    raw: str  # the line as read, without its line ending (Parquet: the row as JSON)
    kind: str  # FIELD_COUNT, DENSE_VALUE, LABEL or SPLIT_VALUE
    reason: str


@dataclass(frozen=True, eq=False)
class RowBlock:
    """Consecutive rows of one file (the split's rows among them)."""

    file: str
    table: pa.Table  # the requested columns (and the split column), one row per row of the split
    rejected: tuple[Malformed, ...]  # rows of the block the source could not take, in line order
    # Row indices of `table` -> (line, raw) of each; slow (called for malformed rows only).
    locate: Callable[[np.ndarray], list[tuple[int, str]]]

    @property
    def rows(self) -> int:
        return self.table.num_rows


# Reading and parsing one block: sources hand these out in order, and the caller runs them in
# worker threads (pyarrow releases the GIL while parsing).
BlockTask = Callable[[], RowBlock]


class Source(Protocol):
    """A job's data: rows of the train and test splits, in file order."""

    def has(self, split: Split) -> bool:
        """Whether the job has this split (a job without test files or a split policy has none)."""
        ...

    def check(self, job: JobConfig, *, missing_files_ok: bool = False) -> None:
        """Fail (`ValueError`) naming a column the job uses that some file lacks, the file, and
        the columns it has; or naming a missing file, unless `missing_files_ok`."""
        ...

    def blocks(self, split: Split, columns: Sequence[str], *, part: int = 0, parts: int = 1) -> Iterator[BlockTask]:
        """Tasks reading the rows of `split` (its `columns`) in `part` of `parts` disjoint
        shares of the input whose union is every row exactly once (see `files.share`)."""
        ...
