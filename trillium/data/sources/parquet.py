"""Parquet files: row groups -> RowBlocks, streamed with `pyarrow.parquet.ParquetFile.iter_batches`.

Why pyarrow's reader: it reads only the columns asked for, one record batch at a time (memory stays
that of a batch, not of a file or a row group), and decodes in C++ with the GIL released. Columns
keep their stored types; `trillium.data.features` reads a categorical column of any type as text (an
integer ID hashes as its decimal digits, as in CSV) and a dense one as numbers. Loaders share a
split's files by row groups; a malformed row is reported with its row number in the file as its
"line" and the row (every column), as JSON, as its raw text.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from functools import partial
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from trillium.data.sources.files import SplitFiles, Unit, column_list, share
from trillium.data.sources.rows import SPLIT_VALUE, BlockTask, Malformed, RowBlock, Split
from trillium.data.sources.split import FILE_SHIFT, policy_column, split_rows

if TYPE_CHECKING:
    from trillium.job import JobConfig, ParquetData, SplitPolicy

__all__ = ["ParquetSource"]

_BATCH_ROWS = 1 << 15  # rows per record batch read


def _block(
    batch: pa.RecordBatch, file: str, first_key: int, first_row: int, policy: SplitPolicy | None, split: Split
) -> RowBlock:
    table = pa.Table.from_batches([batch])
    keep, problems = split_rows(policy, table, split, first_key)
    kept = np.arange(table.num_rows) if keep is None else np.flatnonzero(keep)

    def locate_parsed(rows: np.ndarray) -> list[tuple[int, str]]:
        # The whole rows (every column, not only those read), taken from the file again.
        whole = ds.dataset(file, format="parquet").take(pa.array(first_row + rows, pa.int64())).to_pylist()
        return [(first_row + int(r) + 1, json.dumps(row, default=str)) for r, row in zip(rows, whole, strict=True)]

    bad = ()
    if problems:
        rows = np.array(sorted(problems), np.int64)
        bad = tuple(
            Malformed(file, line, raw, SPLIT_VALUE, problems[int(r)])
            for r, (line, raw) in zip(rows, locate_parsed(rows), strict=True)
        )
    if keep is not None:
        table = table.filter(pa.array(keep))
    return RowBlock(file, table, bad, lambda rows: locate_parsed(kept[np.asarray(rows, np.int64)]))


class ParquetSource:
    """A `parquet` job's files."""

    def __init__(self, data: ParquetData) -> None:
        self._policy = data.split
        self._files = SplitFiles(data.train, data.test, data.split)

    def has(self, split: Split) -> bool:
        return self._files.has(split)

    def check(self, job: JobConfig, *, missing_files_ok: bool = False) -> None:
        self._files.check(job.column_uses(), lambda path: pq.read_schema(path).names, missing_ok=missing_files_ok)

    def blocks(self, split: Split, columns: Sequence[str], *, part: int = 0, parts: int = 1) -> Iterator[BlockTask]:
        wanted = list(dict.fromkeys([*columns, *filter(None, [policy_column(self._policy)])]))
        files = self._files.files(split)
        units, groups = [], {}
        for index, path in enumerate(files):
            meta = pq.read_metadata(path)
            groups[index] = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
            units += [Unit(index, path, g, g + 1, rows) for g, rows in enumerate(groups[index])]
        for unit in share(units, part, parts):
            yield from self._unit_tasks(split, unit, wanted, groups[unit.index])

    def _unit_tasks(self, split: Split, unit: Unit, wanted: list[str], group_rows: list[int]) -> Iterator[BlockTask]:
        parquet = pq.ParquetFile(unit.path)
        names = parquet.schema_arrow.names
        missing = [c for c in wanted if c not in names]
        if missing:
            raise ValueError(f"{unit.path}: no column {missing[0]!r}; its columns: {column_list(names)}")
        row = sum(group_rows[: unit.first])
        with parquet:
            for batch in parquet.iter_batches(_BATCH_ROWS, row_groups=range(unit.first, unit.last), columns=wanted):
                key = (unit.index << FILE_SHIFT) | row
                yield partial(_block, batch, str(unit.path), key, row, self._policy, split)
                row += batch.num_rows
