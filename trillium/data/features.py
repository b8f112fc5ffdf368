"""Features: blocks of rows (`trillium.data.sources`) -> `Batch`es.

For each block, in worker threads: the dense columns are parsed as numbers and the label checked
(`Encoder.check`); the well-formed rows are then encoded (`Encoder.encode`): each slot's cells
hashed to u64 IDs within the slot's namespace by `trillium_native.hash_strings` straight from the
Arrow buffers (jagged: int32 lengths per row; a multi-valued slot splits its cells on its separator
and keeps the first `max_len` non-empty values), dense values normalized to float32 (missing = 0),
labels 0/1 as float32. The blocks then pass, in order, through an optional shuffle buffer and are
cut into batches numbered 0, 1, ... within the epoch (`epoch_batches`).

Malformed rows (a wrong field count, a dense cell that is no finite number, an unknown label, a
split column without a value) are skipped, counted and reported to a `Quarantine`: logged with
file and line (the first 100 of a split one by one, then a total) and appended to a JSONL file,
`{"file", "line", "reason", "raw"}`; the job goes on.

**Dense statistics** (`standard`/`minmax` columns whose mean/std or min/max the job does not
give) come from one streaming pass over the train split before training (`dense_stats`), not
from a sample: a pass costs one read of the file, and exact statistics keep the presets' batches
identical to those of the readers this module replaced. The result is a small dict,
`{column: {"mean", "std"} | {"min", "max"}}`, that a loader can store in a checkpoint and hand
back (`stats=`) instead of reading the split again.

**Shuffling** (`training.shuffle_buffer` rows; 0 keeps file order): each block's rows join a
buffer of at most that many rows, and as many rows as overflow it leave, drawn uniformly from the
buffer and the block; the rest leave, shuffled, at the end of the epoch. The draws are a function
of (seed, epoch, part), so an epoch regenerates identically.

`BatchBuilder` is the in-memory convenience over the same code (the reference trainer, tests,
benchmarks): it encodes a split once and replays its batches.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

import trillium_native
from trillium.data.sources import (
    DENSE_VALUE,
    LABEL,
    BlockTask,
    Malformed,
    RowBlock,
    Split,
    check_columns,
    open_source,
)
from trillium.data.sources.cells import as_numbers, as_text, present, text_buffers
from trillium.job import FeatureSlot, JobConfig
from trillium.wire.batch import Batch, KeyedIds

__all__ = [
    "BatchBuilder",
    "DenseStats",
    "EncodedBlock",
    "EncodedSplit",
    "Encoder",
    "OnlineStats",
    "Quarantine",
    "batch_of",
    "dense_stats",
    "epoch_batches",
    "stats_from_data",
]

logger = logging.getLogger("trillium.data.features")

DenseStats = dict[str, dict[str, float]]  # {column: {"mean", "std"} | {"min", "max"}}

_LOGGED_PER_SPLIT = 100  # log this many malformed rows individually, then only the totals
_STATS_CHUNK = 1 << 17  # values of a column folded into its statistics at a time
# Blocks are parsed and encoded in parallel (pyarrow, numpy and the native hasher release the GIL).
_THREADS = max(1, min(8, os.cpu_count() or 1))

T = TypeVar("T")


class Quarantine:
    """Where one split's malformed rows go: counted by kind, the first 100 logged with file and
    line, each appended to `path` (JSONL) when given. `finish()` logs the total.

    A row already in the file (by file and line) is not appended again: a data loader restored
    from a checkpoint reads rows it read before."""

    def __init__(self, split: str, path: str | Path | None = None) -> None:
        self.split = split
        self.path = Path(path) if path is not None else None
        self.counts: Counter[str] = Counter()
        self._seen: set[tuple[str, int]] = set()
        if self.path is not None and self.path.exists():
            with self.path.open(encoding="utf-8") as f:
                for line in f:
                    entry = json.loads(line)
                    if isinstance(entry, dict) and "file" in entry and "line" in entry:
                        self._seen.add((entry["file"], entry["line"]))

    def add(self, rows: Sequence[Malformed]) -> None:
        if not rows:
            return
        for row in rows:
            self.counts[row.kind] += 1
            if self.total <= _LOGGED_PER_SPLIT:
                logger.warning("%s:%d: skipped malformed row: %s", row.file, row.line, row.reason)
        new = [row for row in rows if (row.file, row.line) not in self._seen]
        if self.path is not None and new:
            self._seen.update((row.file, row.line) for row in new)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a", encoding="utf-8") as f:
                for row in new:
                    record = {"file": row.file, "line": row.line, "reason": row.reason, "raw": row.raw}
                    f.write(json.dumps(record) + "\n")

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def finish(self) -> None:
        if self.counts:
            logger.warning("%s split: skipped %d malformed rows %s", self.split, self.total, dict(self.counts))


@dataclass(frozen=True, eq=False)
class EncodedBlock:
    """Encoded rows: slot `k`'s IDs of row `i` are `values[k][offsets[k, i]:offsets[k, i + 1]]`
    (offsets rather than lengths: a shuffle buffer holds many of these, and slicing needs them).
    Not validated on construction: only the encoder and these methods build one, on the hot path;
    the `Batch` cut from them is validated."""

    offsets: np.ndarray  # int32 (int64 past 2**31 IDs)[slots, rows + 1], from 0
    values: tuple[np.ndarray, ...]  # uint64[offsets[k, -1]] per slot
    dense: np.ndarray  # float32[rows, num_dense], normalized, missing = 0
    labels: np.ndarray  # float32[rows]

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
    def empty(slots: int, dense: int) -> EncodedBlock:
        return EncodedBlock(
            np.zeros((slots, 1), np.int32),
            tuple(np.zeros(0, np.uint64) for _ in range(slots)),
            np.zeros((0, dense), np.float32),
            np.zeros(0, np.float32),
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
    labels: np.ndarray  # bool[rows]: positive
    bad: tuple[Malformed, ...]  # the block's malformed rows, in line order


class Encoder:
    """A job's features: which columns to read, and a block's rows -> `EncodedBlock`.

    `stats` are the normalization statistics of the job's `standard` and `minmax` columns
    (see `dense_stats`), needed to encode, not to check; a column without them fails naming it
    (they may come from a checkpoint)."""

    def __init__(self, job: JobConfig, stats: DenseStats | None) -> None:
        if stats is not None:
            _check_stats(job, stats)
        self.job, self.stats = job, stats
        slots = [s.column for s in job.slots]
        self.columns = tuple(dict.fromkeys([*slots, *(d.column for d in job.dense), job.label.column]))
        self.checked_columns = tuple(dict.fromkeys([*(d.column for d in job.dense), job.label.column]))
        label = job.label
        self._positive = pa.array(label.positive, pa.string())
        self._negative = pa.array(label.negative, pa.string()) if label.negative is not None else None

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
        text = as_text(table.column(job.label.column))
        positive = self._member(text, self._positive)
        # Without negative values, any other value is 0 (but an empty cell is no value).
        negative = present(text) & ~positive if self._negative is None else self._member(text, self._negative)
        unknown = np.flatnonzero(~positive & ~negative)
        if len(unknown):
            cells = text.take(pa.array(unknown))
            cells = cells.view(pa.large_binary() if pa.types.is_large_string(text.type) else pa.binary())
            for row, cell in zip(unknown, cells.to_pylist(), strict=True):
                shown = (cell or b"").decode("utf-8", "replace")
                problems.setdefault(int(row), (LABEL, f"{job.label.column}: unknown label {shown!r}"))
        keep = np.ones(block.rows, bool)
        bad = list(block.rejected)
        if problems:
            rows = np.array(sorted(problems), np.int64)
            keep[rows] = False
            for row, (line, raw) in zip(rows, block.locate(rows), strict=True):
                kind, reason = problems[int(row)]
                bad.append(Malformed(block.file, line, raw, kind, reason))
            bad.sort(key=lambda m: m.line)
        return _Checked(keep, dense, positive, tuple(bad))

    @staticmethod
    def _member(text: pa.Array, values: pa.Array) -> np.ndarray:
        return pc.is_in(text, value_set=values.cast(text.type)).to_numpy(zero_copy_only=False)

    def encode(self, block: RowBlock, checked: _Checked, *, skip: int = 0) -> EncodedBlock:
        """The well-formed rows of a block but the first `skip` of them, encoded."""
        keep = checked.keep
        if skip:
            keep = keep.copy()
            keep[np.flatnonzero(keep)[:skip]] = False
        lengths = np.empty((len(self.job.slots), int(keep.sum())), np.int32)
        values = []
        for k, slot in enumerate(self.job.slots):
            ids, lengths[k] = _slot_ids(slot, as_text(block.table.column(slot.column)), keep)
            values.append(ids)
        dense, labels = self._normalize(checked.dense[keep]), checked.labels[keep].astype(np.float32)
        return EncodedBlock.from_lengths(lengths, tuple(values), dense, labels)

    def _normalize(self, raw: np.ndarray) -> np.ndarray:
        if self.stats is None:
            raise ValueError("the encoder was made without dense statistics: it can check rows, not encode them")
        out = np.empty(raw.shape, np.float32)
        for j, d in enumerate(self.job.dense):
            x, s = raw[:, j], self.stats.get(d.column, {})
            if d.normalization == "standard":
                x = (x - s["mean"]) / s["std"]
            elif d.normalization == "minmax":
                x = (x - s["min"]) / (s["max"] - s["min"])
            elif d.normalization == "log1p":
                x = np.sign(x) * np.log1p(np.abs(x))
            out[:, j] = np.nan_to_num(x, nan=0.0)
        return out


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


def _slot_ids(slot: FeatureSlot, text: pa.Array, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(IDs uint64, lengths int32[keep.sum()]) of one slot over the rows `keep`."""
    if slot.separator is None:  # one ID per non-empty cell
        ok = present(text) & keep
        data, offsets = text_buffers(text)
        return trillium_native.hash_strings(slot.name, data, offsets)[ok], ok[keep].astype(np.int32)
    parts = pc.split_pattern(text, pattern=slot.separator)
    row = pc.list_parent_indices(parts).to_numpy()
    data, offsets = text_buffers(parts.flatten())
    ok = (np.diff(offsets) > 0) & keep[row]  # non-empty values of kept rows
    if slot.max_len is not None and ok.any():  # keep the first max_len of each row
        rows = row[ok]
        first = np.maximum.accumulate(np.where(np.r_[True, rows[1:] != rows[:-1]], np.arange(len(rows)), 0))
        ok[np.flatnonzero(ok)[np.arange(len(rows)) - first >= slot.max_len]] = False
    ids = trillium_native.hash_strings(slot.name, data, offsets)[ok]
    return ids, np.bincount(row[ok], minlength=len(keep))[keep].astype(np.int32)


def _in_order(tasks: Iterable[BlockTask], work: Callable[[RowBlock], T]) -> Iterator[T]:
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


def stats_from_data(job: JobConfig) -> list[str]:
    """The dense columns whose statistics come from the train split (a pass over it is needed)."""
    return [
        d.column
        for d in job.dense
        if (d.normalization == "standard" and d.mean is None) or (d.normalization == "minmax" and d.min is None)
    ]


class _Moments:
    """Count, mean and sum of squared deviations of a column's values, and its min and max, folded
    in chunks of exactly `_STATS_CHUNK` values (Chan, Golub and LeVeque's update), so memory stays
    bounded and the result does not depend on how the input was cut into blocks. A column of fewer
    than two chunks' values gets numpy's own mean and std of them, as the replaced reader did."""

    def __init__(self) -> None:
        self.pending: list[np.ndarray] = []
        self.n, self.mean, self.m2 = 0, 0.0, 0.0
        self.lo, self.hi = np.inf, -np.inf

    def add(self, values: np.ndarray) -> None:
        self.pending.append(values)
        if sum(len(p) for p in self.pending) >= 2 * _STATS_CHUNK:
            values = np.concatenate(self.pending)
            whole = len(values) // _STATS_CHUNK * _STATS_CHUNK
            for start in range(0, whole - _STATS_CHUNK, _STATS_CHUNK):  # keep a chunk pending
                self._fold(values[start : start + _STATS_CHUNK])
            self.pending = [values[whole - _STATS_CHUNK :]]

    def _fold(self, x: np.ndarray) -> None:
        n, mean = len(x), float(x.mean())
        m2 = float(((x - mean) ** 2).sum())
        total = self.n + n
        delta = mean - self.mean
        self.mean += delta * n / total
        self.m2 += m2 + delta * delta * self.n * n / total
        self.n = total
        self.lo, self.hi = min(self.lo, float(x.min())), max(self.hi, float(x.max()))

    def stats(self, normalization: str) -> dict[str, float]:
        rest = np.concatenate(self.pending) if self.pending else np.empty(0)
        if self.n == 0:  # one chunk or less: numpy's statistics of the values
            mean = float(rest.mean()) if len(rest) else 0.0
            std = float(rest.std()) if len(rest) else 0.0
            lo = float(rest.min()) if len(rest) else 0.0
            hi = float(rest.max()) if len(rest) else 1.0
        else:
            for start in range(0, len(rest), _STATS_CHUNK):
                self._fold(rest[start : start + _STATS_CHUNK])
            mean, std, lo, hi = self.mean, float(np.sqrt(self.m2 / self.n)), self.lo, self.hi
        if normalization == "standard":  # a constant (or empty) column: nothing to scale
            return {"mean": mean, "std": std if std > 0 else 1.0}
        return {"min": lo, "max": hi if hi > lo else lo + 1.0}


class OnlineStats:
    """Normalization statistics of a stream, from the values seen so far: per `standard` or
    `minmax` column without statistics in the job, a count, mean and sum of squared deviations
    (Chan et al.'s batch update) and a min and max. Its state is a plain value (checkpoints)."""

    def __init__(self, job: JobConfig, state: dict[str, list[float]] | None = None) -> None:
        self.given = given_stats(job)
        self.columns = [(j, d) for j, d in enumerate(job.dense) if d.column in stats_from_data(job)]
        # column -> [n, mean, m2, min, max]
        self.moments: dict[str, list[float]] = state or {
            d.column: [0.0, 0.0, 0.0, math.inf, -math.inf] for _, d in self.columns
        }

    def update(self, raw: np.ndarray) -> None:
        """Fold in a block's raw dense values (float64[rows, num_dense], NaN where missing)."""
        for j, d in self.columns:
            x = raw[:, j][~np.isnan(raw[:, j])]
            if not len(x):
                continue
            n, mean, m2, lo, hi = self.moments[d.column]
            k, kmean = len(x), float(x.mean())
            total = n + k
            delta = kmean - mean
            self.moments[d.column] = [
                total,
                mean + delta * k / total,
                m2 + float(((x - kmean) ** 2).sum()) + delta * delta * n * k / total,
                min(lo, float(x.min())),
                max(hi, float(x.max())),
            ]

    def stats(self) -> DenseStats:
        out = dict(self.given)
        for _, d in self.columns:
            n, mean, m2, lo, hi = self.moments[d.column]
            if d.normalization == "standard":
                std = math.sqrt(m2 / n) if n else 0.0
                out[d.column] = {"mean": mean, "std": std if std > 0 else 1.0}  # nothing to scale yet
            else:
                lo, hi = (lo, hi) if n else (0.0, 1.0)
                out[d.column] = {"min": lo, "max": hi if hi > lo else lo + 1.0}
        return out

    def state(self) -> dict[str, list[float]]:
        return {column: list(m) for column, m in self.moments.items()}


def batch_of(
    job: JobConfig,
    block: EncodedBlock,
    *,
    batch_id: int,
    rank: int,
    epoch: int = 0,
    sample_ids: np.ndarray | None = None,
    event_times: np.ndarray | None = None,
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
    )


def given_stats(job: JobConfig) -> DenseStats:
    """The normalization statistics the job file states."""
    stats: DenseStats = {}
    for d in job.dense:
        if d.normalization == "standard" and d.mean is not None and d.std is not None:
            stats[d.column] = {"mean": d.mean, "std": d.std}
        elif d.normalization == "minmax" and d.min is not None and d.max is not None:
            stats[d.column] = {"min": d.min, "max": d.max}
    return stats


def dense_stats(job: JobConfig, *, quarantine: Quarantine | None = None) -> DenseStats:
    """The normalization statistics of the job's `standard` and `minmax` columns: given in the
    job, or from one pass over the whole train split (every part: all loaders get the same). The
    pass reports the split's malformed rows to `quarantine`."""
    stats = given_stats(job)
    needed = stats_from_data(job)
    if not needed:
        return stats
    encoder = Encoder(job, None)
    index = {d.column: j for j, d in enumerate(job.dense)}
    moments = {column: _Moments() for column in needed}
    tasks = open_source(job.data).blocks("train", encoder.checked_columns)
    for checked in _in_order(tasks, encoder.check):
        if quarantine is not None:
            quarantine.add(checked.bad)
        for column, m in moments.items():
            x = checked.dense[checked.keep, index[column]]
            m.add(x[~np.isnan(x)])
    normalization = {d.column: d.normalization for d in job.dense}
    return stats | {column: m.stats(normalization[column]) for column, m in moments.items()}


def _encoded(
    job: JobConfig,
    split: Split,
    encoder: Encoder,
    *,
    part: int,
    parts: int,
    skip_rows: int,
    quarantine: Quarantine | None,
) -> Iterator[EncodedBlock]:
    """The encoded rows of a split, block by block, but the first `skip_rows` well-formed rows,
    which are checked (to count them) but not encoded."""
    skipping = [skip_rows > 0]  # read by the workers: encode only past the skipped rows

    def work(block: RowBlock) -> tuple[RowBlock | None, _Checked, EncodedBlock | None]:
        checked = encoder.check(block)
        if skipping[0]:
            return block, checked, None
        return None, checked, encoder.encode(block, checked)

    remaining = skip_rows
    tasks = open_source(job.data).blocks(split, encoder.columns, part=part, parts=parts)
    for block, checked, encoded in _in_order(tasks, work):
        if quarantine is not None:
            quarantine.add(checked.bad)
        if remaining:
            good = int(checked.keep.sum())
            if good <= remaining:
                remaining -= good
                continue
            assert block is not None  # checked while skipping
            encoded, remaining = encoder.encode(block, checked, skip=remaining), 0
            skipping[0] = False
        elif encoded is None:  # read while the flag was still up
            assert block is not None
            encoded = encoder.encode(block, checked)
        if encoded.rows:
            yield encoded


def _shuffle(
    blocks: Iterable[EncodedBlock], size: int, rng: np.random.Generator, skip_rows: int
) -> Iterator[EncodedBlock]:
    """The rows of `blocks` through a shuffle buffer of `size` rows (see the module docstring),
    but the first `skip_rows` rows out, which are drawn but not gathered."""
    alive: dict[int, EncodedBlock] = {}  # blocks holding rows of the buffer, by id
    pool_block, pool_row = np.zeros(0, np.int64), np.zeros(0, np.int64)  # the buffer's rows
    emitted = 0

    def gather(block_ids: np.ndarray, rows: np.ndarray) -> EncodedBlock:
        parts, order = [], []
        for b in np.unique(block_ids):
            picked = np.flatnonzero(block_ids == b)
            parts.append(alive[int(b)].take(rows[picked]))
            order.append(picked)
        merged = EncodedBlock.concat(parts)
        return merged.take(np.argsort(np.concatenate(order)))  # back to the drawn order

    def emit(block_ids: np.ndarray, rows: np.ndarray) -> EncodedBlock | None:
        nonlocal emitted
        drop = min(len(rows), max(0, skip_rows - emitted))
        emitted += len(rows)
        return gather(block_ids[drop:], rows[drop:]) if drop < len(rows) else None

    for next_id, block in enumerate(blocks):
        alive[next_id] = block
        window_block = np.concatenate([pool_block, np.full(block.rows, next_id)])
        window_row = np.concatenate([pool_row, np.arange(block.rows)])
        leaving = len(window_row) - size
        if leaving > 0:
            out = rng.choice(len(window_row), leaving, replace=False)
            stay = np.ones(len(window_row), bool)
            stay[out] = False
            if (emitted_rows := emit(window_block[out], window_row[out])) is not None:
                yield emitted_rows
            window_block, window_row = window_block[stay], window_row[stay]
        pool_block, pool_row = window_block, window_row
        live = np.bincount(pool_block, minlength=next_id + 1)
        for b in [b for b in alive if not live[b]]:
            del alive[b]
        if sum(b.rows for b in alive.values()) > 2 * size + block.rows:  # compact the buffer
            alive = {next_id: gather(pool_block, pool_row)}
            pool_block, pool_row = np.full(len(pool_row), next_id), np.arange(len(pool_row))
    if len(pool_row):
        order = rng.permutation(len(pool_row))
        if (rest := emit(pool_block[order], pool_row[order])) is not None:
            yield rest


def _batches(blocks: Iterable[EncodedBlock], job: JobConfig, size: int, epoch: int, first_id: int) -> Iterator[Batch]:
    """Consecutive rows of `blocks` cut into batches of `size` (the last may be smaller),
    numbered from `first_id`; batch `b` is for NN rank `b % topology.nn_ranks`."""
    keys = tuple(s.name for s in job.slots)
    ranks = job.topology.nn_ranks
    pieces: list[tuple[EncodedBlock, int, int]] = []
    have, batch_id = 0, first_id

    def batch() -> Batch:
        lengths = np.concatenate([b.lengths(i, j) for b, i, j in pieces], axis=1)
        values = np.concatenate(
            [b.values[k][b.offsets[k, i] : b.offsets[k, j]] for k in range(len(keys)) for b, i, j in pieces]
        )
        return Batch(
            batch_id=batch_id,
            epoch=epoch,
            rank=batch_id % ranks,
            ids=KeyedIds(keys=keys, values=values, lengths=lengths.ravel()),
            dense=np.concatenate([b.dense[i:j] for b, i, j in pieces]),
            labels=np.concatenate([b.labels[i:j] for b, i, j in pieces]),
        )

    for block in blocks:
        start = 0
        while start < block.rows:
            take = min(size - have, block.rows - start)
            pieces.append((block, start, start + take))
            have, start = have + take, start + take
            if have == size:
                yield batch()
                pieces, have, batch_id = [], 0, batch_id + 1
    if have:
        yield batch()


def _batch_size(job: JobConfig, split: Split) -> int:
    return job.training.batch_size if split == "train" else job.training.eval_batch_size


def _epoch(
    job: JobConfig, split: Split, epoch: int, part: int, skip: int, read: Callable[[int], Iterable[EncodedBlock]]
) -> Iterator[Batch]:
    """The batches of an epoch from `read(skip_rows)`'s blocks: shuffled or not, cut."""
    size = _batch_size(job, split)
    buffer = job.training.shuffle_buffer if split == "train" else 0
    if not buffer:
        return _batches(read(skip * size), job, size, epoch, skip)
    rng = np.random.default_rng((job.training.seed, epoch, part))
    return _batches(_shuffle(read(0), buffer, rng, skip * size), job, size, epoch, skip)


def epoch_batches(
    job: JobConfig,
    split: Split,
    *,
    stats: DenseStats,
    epoch: int = 0,
    part: int = 0,
    parts: int = 1,
    skip: int = 0,
    quarantine: Quarantine | None = None,
) -> Iterator[Batch]:
    """The batches of one epoch of a split, streamed: `part` of `parts` disjoint shares of the
    input (their union is every row once), numbered 0, 1, ... within the share and the epoch
    (`rank` = `batch_id % nn_ranks`; renumbering across shares and epochs is the loader's).

    `stats`: from `dense_stats`. `skip=k` starts at batch `k` (resuming an epoch): without a
    shuffle buffer, the rows of the skipped batches are parsed and checked but not encoded; with
    one, they are encoded (the buffer must see them) but not gathered into batches. Malformed rows
    of the whole share, skipped batches included, go to `quarantine` (pass None for an epoch
    whose rows were reported already)."""
    encoder = Encoder(job, stats)

    def read(skip_rows: int) -> Iterator[EncodedBlock]:
        return _encoded(job, split, encoder, part=part, parts=parts, skip_rows=skip_rows, quarantine=quarantine)

    return _epoch(job, split, epoch, part, skip, read)


@dataclass(frozen=True, eq=False)
class EncodedSplit:
    """One split of a job's data, encoded, in memory: its blocks, and their rows as one block."""

    name: Split
    blocks: tuple[EncodedBlock, ...]  # at least one (an empty one for an empty split)

    @cached_property
    def _all(self) -> EncodedBlock:
        return EncodedBlock.concat(self.blocks)

    @property
    def rows(self) -> int:
        return sum(b.rows for b in self.blocks)

    @property
    def slot_values(self) -> tuple[np.ndarray, ...]:  # uint64[total IDs of the slot] per slot
        return self._all.values

    @property
    def dense(self) -> np.ndarray:  # float32[rows, num_dense]
        return self._all.dense

    @property
    def labels(self) -> np.ndarray:  # float32[rows]
        return self._all.labels


class BatchBuilder:
    """A job's batches from splits held in memory: each split is read and encoded once, on first
    use (the train split's dense statistics first), then replayed with `epoch_batches`'s shuffle
    and cutting for one loader. For the reference trainer, tests and benchmarks; a loader streams."""

    def __init__(self, job: JobConfig, *, quarantine: str | Path | None = None) -> None:
        check_columns(job)
        self.job = job
        self._quarantine_path = quarantine
        self._reports: dict[str, Quarantine] = {}
        self._splits: dict[str, EncodedSplit] = {}
        self._stats: DenseStats | None = None

    def _report(self, split: Split) -> Quarantine:
        return self._reports.setdefault(split, Quarantine(split, self._quarantine_path))

    @property
    def dense_stats(self) -> DenseStats:
        """The normalization statistics in use, `{column: {"mean", "std"} | {"min", "max"}}`, of
        `standard` and `minmax` columns (given in the job, or computed on the train split)."""
        if self._stats is None:
            passes = bool(stats_from_data(self.job))  # a pass over the train split reports its rows
            self._stats = dense_stats(self.job, quarantine=self._report("train") if passes else None)
            if passes:
                self._reports["train"].finish()
        return self._stats

    @property
    def has_test(self) -> bool:
        return open_source(self.job.data).has("test")

    @property
    def malformed(self) -> dict[str, int]:
        """Malformed rows skipped so far, by reason, over the splits read."""
        total: Counter[str] = Counter()
        for report in self._reports.values():
            total.update(report.counts)
        return dict(total)

    def split(self, name: Split) -> EncodedSplit:
        if name not in self._splits:
            stats = self.dense_stats
            report = None if name in self._reports else self._report(name)  # report a split once
            encoder = Encoder(self.job, stats)
            blocks = _encoded(self.job, name, encoder, part=0, parts=1, skip_rows=0, quarantine=report)
            empty = EncodedBlock.empty(len(self.job.slots), len(self.job.dense))
            self._splits[name] = EncodedSplit(name, tuple(blocks) or (empty,))
            if report is not None:
                report.finish()
        return self._splits[name]

    def num_batches(self, split: Split = "train") -> int:
        return -(-self.split(split).rows // _batch_size(self.job, split))

    def batches(self, split: Split = "train", epoch: int = 0) -> Iterator[Batch]:
        """The batches `epoch_batches` streams for one loader (part 0 of 1)."""
        blocks = self.split(split).blocks

        def read(skip_rows: int) -> Iterable[EncodedBlock]:
            assert skip_rows == 0
            return blocks

        return _epoch(self.job, split, epoch, 0, 0, read)
