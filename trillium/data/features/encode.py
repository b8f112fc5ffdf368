"""A block of rows -> encoded rows: dense columns parsed and normalized, labels checked, each
slot's cells hashed to u64 IDs (`Encoder`); encoded rows (`EncodedBlock`) -> one `Batch`
(`batch_of`); and the worker threads blocks are encoded on (`in_order`)."""

from __future__ import annotations

import math
import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

import trillium_native
from trillium.data.sources import DENSE_VALUE, LABEL, BlockTask, Malformed, RowBlock
from trillium.data.sources.cells import as_numbers, as_text, present, text_buffers
from trillium.job import FeatureSlot, JobConfig
from trillium.wire.batch import Batch, KeyedIds

from .labels import single_label, task_labels

DenseStats = dict[str, dict[str, float]]  # {column: {"mean", "std"} | {"min", "max"}}

# Blocks are parsed and encoded in parallel (pyarrow, numpy and the native hasher release the GIL).
_THREADS = max(1, min(8, os.cpu_count() or 1))

T = TypeVar("T")


@dataclass(frozen=True, eq=False)
class EncodedBlock:
    """Encoded rows: slot `k`'s IDs of row `i` are `values[k][offsets[k, i]:offsets[k, i + 1]]`
    (offsets rather than lengths: a shuffle buffer holds many of these, and slicing needs them).
    Not validated on construction: only the encoder and these methods build one, on the hot path;
    the `Batch` cut from them is validated."""

    offsets: np.ndarray  # int32 (int64 past 2**31 IDs)[slots, rows + 1], from 0
    values: tuple[np.ndarray, ...]  # uint64[offsets[k, -1]] per slot
    dense: np.ndarray  # float32[rows, num_dense], normalized, missing = 0
    labels: np.ndarray  # float32[rows]; a multi-task job's [rows, T], NaN: no label for the task

    @staticmethod
    def from_lengths(
        lengths: np.ndarray, values: tuple[np.ndarray, ...], dense: np.ndarray, labels: np.ndarray
    ) -> EncodedBlock:
        """From int[slots, rows] lengths."""
        wide = lengths.shape[1] and int(lengths.sum(axis=1, dtype=np.int64).max()) >= 1 << 31
        offsets = np.zeros((lengths.shape[0], lengths.shape[1] + 1), np.int64 if wide else np.int32)
        np.cumsum(lengths, axis=1, out=offsets[:, 1:])
        return EncodedBlock(offsets, values, dense, labels)

    @property
    def rows(self) -> int:
        return len(self.labels)

    def lengths(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """int32[slots, rows] of rows `start:stop`."""
        stop = self.rows if stop is None else stop
        return np.diff(self.offsets[:, start : stop + 1], axis=1).astype(np.int32, copy=False)

    def slice(self, start: int, stop: int) -> EncodedBlock:
        """Rows `start:stop`: views where `take` of those rows would copy each slot's IDs."""
        offsets = self.offsets[:, start : stop + 1]
        values = tuple(v[offsets[k, 0] : offsets[k, -1]] for k, v in enumerate(self.values))
        return EncodedBlock(offsets - offsets[:, :1], values, self.dense[start:stop], self.labels[start:stop])

    def take(self, rows: np.ndarray) -> EncodedBlock:
        """These rows, in this order."""
        values = []
        lengths = self.offsets[:, rows + 1] - self.offsets[:, rows]
        for k, slot_values in enumerate(self.values):
            starts = self.offsets[k, rows]
            # Output j comes from starts[row of j] + (j - the first output position of that row).
            shift = np.repeat(starts - (np.cumsum(lengths[k]) - lengths[k]), lengths[k])
            values.append(slot_values[shift + np.arange(len(shift))])
        return EncodedBlock.from_lengths(lengths, tuple(values), self.dense[rows], self.labels[rows])

    @staticmethod
    def empty(job: JobConfig) -> EncodedBlock:
        slots = len(job.slots)
        return EncodedBlock(
            np.zeros((slots, 1), np.int32),
            tuple(np.zeros(0, np.uint64) for _ in range(slots)),
            np.zeros((0, len(job.dense)), np.float32),
            np.zeros((0, *job.label_shape), np.float32),
        )

    @staticmethod
    def concat(blocks: Sequence[EncodedBlock]) -> EncodedBlock:
        return EncodedBlock.from_lengths(
            np.concatenate([b.lengths() for b in blocks], axis=1),
            tuple(np.concatenate(v) for v in zip(*(b.values for b in blocks), strict=True)),
            np.concatenate([b.dense for b in blocks]),
            np.concatenate([b.labels for b in blocks]),
        )


@dataclass(frozen=True, eq=False)
class _Checked:
    """A block's rows after the dense and label checks."""

    keep: np.ndarray  # bool[rows]: well formed
    dense: np.ndarray  # float64[rows, num_dense], raw; NaN where missing
    labels: np.ndarray  # bool[rows]: positive; a multi-task job's float32[rows, T], NaN: none
    bad: tuple[Malformed, ...]  # the block's malformed rows, in line order


@dataclass(frozen=True, eq=False)
class TextCells:
    """Rows as Python text cells (None or "": missing), read natively for `Encoder.check_cells`
    and `encode_cells`: each slot's IDs (`hash_cells`) and the dense values (`parse_floats`),
    with the cells left to Python's float() (`odd`) and the labels as they are."""

    rows: int
    lengths: np.ndarray  # int32[slots, rows]: each row's IDs of each slot
    ids: tuple[np.ndarray, ...]  # uint64 per slot, the rows' IDs in order
    dense: np.ndarray  # float64[rows, num_dense], NaN: missing, or an `odd` cell
    odd: list[tuple[int, int]]  # (row, dense column) of the cells the native parser left to Python
    labels: Sequence[str | Sequence[str] | None]  # a joined multi-task job's: a text per task
    cell: Callable[[int, str], str | None]  # (row, column) -> the cell's text

    @staticmethod
    def of_columns(job: JobConfig, columns: Mapping[str, Sequence[str | None]], *, labelled: bool = True) -> TextCells:
        """Cells given as a column of each of the job's columns (a label column only if `labelled`)."""
        rows = len(columns[job.label.column]) if labelled else len(next(iter(columns.values()), ()))
        ids = [
            trillium_native.hash_cells(job.id_space(s), columns[s.column], s.separator, s.max_len) for s in job.slots
        ]
        dense, odd = np.empty((rows, len(job.dense))), []
        for j, d in enumerate(job.dense):
            dense[:, j], odd_rows = trillium_native.parse_floats(columns[d.column])
            odd += [(i, j) for i in odd_rows.tolist()]
        return TextCells(
            rows,
            np.array([lengths for lengths, _ in ids], np.int32).reshape(len(job.slots), rows),
            tuple(i for _, i in ids),
            dense,
            sorted(odd),
            columns[job.label.column] if labelled else (),
            lambda row, column: columns[column][row],
        )

    @staticmethod
    def of_rows(
        job: JobConfig,
        texts: list[str],
        separator: str,
        fields: Sequence[str],
        labels: Sequence[str | Sequence[str] | None],
    ) -> TextCells:
        """Cells given as one text a row, the cells of `fields` (column names) joined by
        `separator` (a stream's events), read in one native pass; the labels apart (a joined
        multi-task job's: a text per task, each the cell of its task's column)."""
        at = {f: i for i, f in enumerate(fields)}
        joined = {t.column: k for k, t in enumerate(job.tasks) if t.column not in at} if job.multitask else {}

        def cell(row: int, column: str) -> str:
            if column in joined:
                return labels[row][joined[column]]  # type: ignore[index]
            return texts[row].split(separator)[at[column]]

        slots = [(s.name, at[s.column], s.separator, s.max_len) for s in job.slots]
        dense_fields = [at[d.column] for d in job.dense]
        lengths, ids, dense, odd = trillium_native.row_cells(texts, separator, len(fields), slots, dense_fields)
        return TextCells(
            len(texts),
            lengths,
            tuple(ids),
            dense,
            [(int(i), int(j)) for i, j in odd],
            labels,
            cell,
        )


class Encoder:
    """A job's features: which columns to read, and a block's rows -> `EncodedBlock`.

    `stats` are the normalization statistics of the job's `standard` and `minmax` columns
    (see `dense_stats`), needed to encode, not to check; a column without them fails naming it
    (they may come from a checkpoint)."""

    def __init__(self, job: JobConfig, stats: DenseStats | None) -> None:
        self.job = job
        self.stats = stats
        slots = [s.column for s in job.slots]
        labels = [c for t in job.tasks for c in (t.column, t.mask) if c is not None]
        self.columns = tuple(dict.fromkeys([*slots, *(d.column for d in job.dense), *labels]))
        self.checked_columns = tuple(dict.fromkeys([*(d.column for d in job.dense), *labels]))

    def check(self, block: RowBlock) -> _Checked:
        """Parse the dense columns and the labels; find the malformed rows (a row's first problem,
        in order: dense columns, label) and where they are."""
        job, table = self.job, block.table
        problems: dict[int, tuple[str, str]] = {}  # row -> (kind, reason)
        dense = np.empty((block.rows, len(job.dense)))
        for j, d in enumerate(job.dense):
            dense[:, j], bad = as_numbers(table.column(d.column), d.column)
            for row, reason in bad.items():
                problems.setdefault(row, (DENSE_VALUE, reason))
        if job.multitask:
            labels = task_labels(job, table.column, block.rows, problems)
        else:
            labels = single_label(job, table.column, problems)
        keep = np.ones(block.rows, bool)
        bad = list(block.rejected)
        if problems:
            rows = np.array(sorted(problems), np.int64)
            keep[rows] = False
            for row, (line, raw) in zip(rows, block.locate(rows), strict=True):
                kind, reason = problems[int(row)]
                bad.append(Malformed(block.file, line, raw, kind, reason))
            bad.sort(key=lambda m: m.line)
        return _Checked(keep, dense, labels, tuple(bad))

    def encode(self, block: RowBlock, checked: _Checked, *, skip: int = 0) -> EncodedBlock:
        """The well-formed rows of a block but the first `skip` of them, encoded."""
        keep = checked.keep
        if skip:
            keep = keep.copy()
            keep[np.flatnonzero(keep)[:skip]] = False
        lengths = np.empty((len(self.job.slots), int(keep.sum())), np.int32)
        values = []
        for k, slot in enumerate(self.job.slots):
            ids, lengths[k] = _slot_ids(slot, self.job.id_space(slot), as_text(block.table.column(slot.column)), keep)
            values.append(ids)
        dense, labels = self._normalize(checked.dense[keep]), checked.labels[keep].astype(np.float32)
        return EncodedBlock.from_lengths(lengths, tuple(values), dense, labels)

    # ---- rows as Python text cells: events and prediction requests, a few rows at a time ----------
    # Arrow's per-column calls cost tens of microseconds each, a batch of one event's worth several
    # milliseconds; these take the cells as they come (`TextCells`), with the very checks and
    # encoding of `check` and `encode` (tests/unit/test_features.py holds the paths to the same bits).

    def check_cells(
        self, cells: TextCells, locate: Callable[[int], tuple[int, str]], *, file: str, labelled: bool = True
    ) -> _Checked:
        """`check` of rows given as text cells; `locate(row)` says where a malformed row is. Rows
        to predict (`labelled=False`) have no label to check: every label reads 0."""
        job = self.job
        problems: dict[int, tuple[str, str]] = {}
        dense = cells.dense.copy()
        for i, j in cells.odd:  # what the native parser left to Python's float(), as before
            column = job.dense[j].column
            cell = cells.cell(i, column)
            try:
                dense[i, j] = value = float(cell)
            except ValueError:
                problems.setdefault(i, (DENSE_VALUE, f"{column}: non-numeric value {cell!r}"))
                continue
            if not math.isfinite(value):
                problems.setdefault(i, (DENSE_VALUE, f"{column}: non-finite value {cell!r}"))
        positive = np.zeros((cells.rows, len(job.tasks)) if job.multitask else cells.rows, bool)
        if labelled and job.multitask:  # each task's cells as a column: a block's very checks

            def column(name: str) -> pa.Array:
                return pa.array([cells.cell(i, name) for i in range(cells.rows)], pa.string())

            positive = task_labels(job, column, cells.rows, problems)
        elif labelled:
            label, pos, neg = job.label, set(job.label.positive), set(job.label.negative or ())
            for i, cell in enumerate(cells.labels):
                if cell in pos:
                    positive[i] = True
                elif not (cell in neg if label.negative is not None else bool(cell)):
                    problems.setdefault(i, (LABEL, f"{label.column}: unknown label {cell or ''!r}"))
        keep = np.ones(cells.rows, bool)
        keep[list(problems)] = False
        bad = tuple(Malformed(file, *locate(i), *problems[i]) for i in sorted(problems))
        return _Checked(keep, dense, positive, bad)

    def encode_cells(self, cells: TextCells, checked: _Checked) -> EncodedBlock:
        """`encode` of rows given as text cells (`check_cells` checked them): the well-formed ones."""
        keep = np.flatnonzero(checked.keep)
        every = len(keep) == len(checked.keep)
        lengths = np.zeros((len(self.job.slots), len(keep)), np.int32)
        values = []
        for k, ids in enumerate(cells.ids):
            counts = cells.lengths[k]
            lengths[k] = counts if every else counts[keep]
            values.append(ids if every else ids[np.repeat(checked.keep, counts)])
        dense, labels = self._normalize(checked.dense[keep]), checked.labels[keep].astype(np.float32)
        return EncodedBlock.from_lengths(lengths, tuple(values), dense, labels)

    @property
    def stats(self) -> DenseStats | None:
        return self._stats

    @stats.setter
    def stats(self, stats: DenseStats | None) -> None:
        """The normalization statistics in use (a stream's change as it goes): checked, and turned
        into the columns' offsets and scales once, not per batch."""
        if stats is not None:
            _check_stats(self.job, stats)
        self._stats = stats
        kinds = [d.normalization for d in self.job.dense]
        self._affine = np.array([j for j, k in enumerate(kinds) if k in ("standard", "minmax")], np.int64)
        self._log = np.array([j for j, k in enumerate(kinds) if k == "log1p"], np.int64)
        offsets, scales = [], []
        for d in self.job.dense:
            s = (stats or {}).get(d.column, {})
            if d.normalization == "standard" and s:
                offsets.append(s["mean"])
                scales.append(s["std"])
            elif d.normalization == "minmax" and s:
                offsets.append(s["min"])
                scales.append(s["max"] - s["min"])
        self._offsets, self._scales = np.array(offsets, np.float64), np.array(scales, np.float64)

    def _normalize(self, raw: np.ndarray) -> np.ndarray:
        """float64 [rows, num_dense] raw values -> float32, normalized, missing = 0: `standard`
        (x - mean) / std, `minmax` (x - min) / (max - min), `log1p` sign(x) log(1 + |x|), each
        column at once per kind."""
        if self._stats is None:
            raise ValueError("the encoder was made without dense statistics: it can check rows, not encode them")
        x = raw.copy()
        if len(self._affine):
            x[:, self._affine] = (raw[:, self._affine] - self._offsets) / self._scales
        if len(self._log):
            x[:, self._log] = np.sign(raw[:, self._log]) * np.log1p(np.abs(raw[:, self._log]))
        return np.nan_to_num(x, nan=0.0).astype(np.float32)


def _check_stats(job: JobConfig, stats: DenseStats) -> None:
    for d in job.dense:
        if d.normalization not in ("standard", "minmax"):
            continue
        low, high = ("mean", "std") if d.normalization == "standard" else ("min", "max")
        given = stats.get(d.column)
        values = [given.get(key) for key in (low, high)] if isinstance(given, dict) else [None, None]
        if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in values) or (
            values[1] <= (0 if d.normalization == "standard" else values[0])
        ):
            need = "a mean and a std > 0" if d.normalization == "standard" else "a min and a max > min"
            raise ValueError(f"dense column {d.column!r} ({d.normalization}): stats need {need}, got {given!r}")


def _slot_ids(slot: FeatureSlot, space: str, text: pa.Array, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(IDs uint64, lengths int32[keep.sum()]) of one slot over the rows `keep`, hashed in `space`
    (`JobConfig.id_space`)."""
    if slot.separator is None:  # one ID per non-empty cell
        ok = present(text) & keep
        data, offsets = text_buffers(text)
        return trillium_native.hash_strings(space, data, offsets)[ok], ok[keep].astype(np.int32)
    parts = pc.split_pattern(text, pattern=slot.separator)
    row = pc.list_parent_indices(parts).to_numpy()
    data, offsets = text_buffers(parts.flatten())
    ok = (np.diff(offsets) > 0) & keep[row]  # non-empty values of kept rows
    if slot.max_len is not None and ok.any():  # keep the first max_len of each row
        rows = row[ok]
        first = np.maximum.accumulate(np.where(np.r_[True, rows[1:] != rows[:-1]], np.arange(len(rows)), 0))
        ok[np.flatnonzero(ok)[np.arange(len(rows)) - first >= slot.max_len]] = False
    ids = trillium_native.hash_strings(space, data, offsets)[ok]
    return ids, np.bincount(row[ok], minlength=len(keep))[keep].astype(np.int32)


def in_order(tasks: Iterable[BlockTask], work: Callable[[RowBlock], T]) -> Iterator[T]:
    """`work(task())` of each task on worker threads, in task order, a few tasks ahead."""
    with ThreadPoolExecutor(_THREADS, thread_name_prefix="trillium-features") as pool:
        pending: deque[Future[T]] = deque()
        try:
            for task in tasks:  # reads the next block's bytes in this thread
                pending.append(pool.submit(lambda t=task: work(t())))
                if len(pending) > 2 * _THREADS:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for future in pending:
                future.cancel()


def batch_of(
    job: JobConfig,
    block: EncodedBlock,
    *,
    batch_id: int,
    rank: int,
    epoch: int = 0,
    sample_ids: np.ndarray | None = None,
    event_times: np.ndarray | None = None,
    complete_through: float | None = None,
) -> Batch:
    """Every row of `block`, in order, as one batch."""
    return Batch(
        batch_id=batch_id,
        epoch=epoch,
        rank=rank,
        ids=KeyedIds(
            keys=tuple(s.name for s in job.slots),
            values=np.concatenate(block.values) if block.values else np.zeros(0, np.uint64),
            lengths=block.lengths().ravel(),
        ),
        dense=block.dense,
        labels=block.labels,
        sample_ids=sample_ids,
        event_times=event_times,
        complete_through=complete_through,
    )
