"""Data sources and batch building.

Readers turn a source into ``Row``s (cells in the source's column order, with file and line
number). ``BatchBuilder`` encodes a split once into columns (IDs hashed per slot with
``trillium_native.hash_ids``, dense values normalized, labels 0/1) and cuts it into ``Batch``es.

Malformed rows (wrong field count, a non-numeric dense value, an unknown label) are counted,
skipped, logged on the ``trillium.data`` logger with file and line (the first 100 of a split one
by one, then a total), and appended to the quarantine JSONL file when one is given; the job goes
on.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import numpy as np
import trillium_native

from trillium.batch import Batch, KeyedIds
from trillium.datagen import PlantedModel, Split
from trillium.job import (
    SOURCE_COLUMNS,
    AdultData,
    CriteoData,
    DataConfig,
    JobConfig,
    SyntheticData,
)

__all__ = ["BatchBuilder", "EncodedSplit", "Row", "Split", "read_adult", "read_criteo", "read_rows"]

logger = logging.getLogger("trillium.data")

# Reasons a row is malformed: the keys of the counts BatchBuilder exposes.
FIELD_COUNT, DENSE_VALUE, LABEL = "field_count", "dense_value", "label"
_LOGGED_PER_SPLIT = 100  # log this many malformed rows individually, then only the totals
_CHUNK_ROWS = 1 << 14  # rows parsed together (held as Python objects until then)


@dataclass(frozen=True, slots=True)
class Row:
    file: str
    line: int  # 1-based
    fields: list[str]
    raw: str  # the line as read, without its line ending


def read_adult(path: str | Path) -> Iterator[Row]:
    """UCI Adult CSV: ", "-separated cells, spaces stripped; skips blank lines and adult.test's
    "|1x3 Cross validator" first line, and drops the trailing "." of adult.test's labels. A "?"
    (unknown) is kept as a value of its own."""
    with open(path, encoding="utf-8", errors="replace", newline="") as f:
        for number, line in enumerate(f, 1):
            raw = line.rstrip("\r\n")
            if not raw.strip() or raw.startswith("|"):
                continue
            fields = [cell.strip() for cell in raw.split(",")]
            if fields[-1].endswith("."):
                fields[-1] = fields[-1][:-1]
            yield Row(str(path), number, fields, raw)


def read_criteo(path: str | Path) -> Iterator[Row]:
    """Criteo-format TSV (label, I1..I13, C1..C26); an empty cell is a missing value."""
    with open(path, encoding="utf-8", errors="replace", newline="") as f:
        yield from _tsv_rows(str(path), f)


def _tsv_rows(name: str, lines: Iterator[str] | IO[str]) -> Iterator[Row]:
    for number, line in enumerate(lines, 1):
        raw = line.rstrip("\r\n")
        if raw:
            yield Row(name, number, raw.split("\t"), raw)


def read_rows(data: DataConfig, split: Split) -> Iterator[Row]:
    """The rows of one split of a source (nothing for a test split the job does not have)."""
    if isinstance(data, (AdultData, CriteoData)):
        path = data.train if split == "train" else data.test
        if path is None:
            return
        yield from (read_adult if isinstance(data, AdultData) else read_criteo)(path)
        return
    rows = data.rows if split == "train" else data.test_rows
    model = PlantedModel.create(data.seed, vocab_sizes=data.vocab_sizes)
    lines = (
        line
        for block in model.sample(rows, split)
        for line in block.to_tsv().decode("ascii").splitlines()
    )
    yield from _tsv_rows(f"<synthetic {split}>", lines)


@dataclass(frozen=True, eq=False)
class EncodedSplit:
    """One split of a job's data, encoded: slot ``k``'s IDs for row ``i`` are
    ``slot_values[k][slot_offsets[k][i]:slot_offsets[k][i + 1]]``."""

    name: Split
    slot_values: tuple[np.ndarray, ...]  # uint64[total IDs of the slot]
    slot_offsets: tuple[np.ndarray, ...]  # int64[rows + 1]
    dense: np.ndarray  # float32[rows, num_dense], normalized, missing = 0
    labels: np.ndarray  # float32[rows]
    malformed: Mapping[str, int]  # reason -> rows skipped

    @property
    def rows(self) -> int:
        return len(self.labels)


@dataclass(frozen=True)
class _Problem:
    """Why a row is malformed."""

    kind: str  # FIELD_COUNT, DENSE_VALUE or LABEL
    reason: str


@dataclass(frozen=True)
class _Parsed:
    """The well-formed rows of a chunk, parsed."""

    slots: list[tuple[np.ndarray, np.ndarray]]  # per slot: IDs (uint64), lengths (int64)
    dense: np.ndarray  # float64[rows, num_dense], raw; NaN where missing
    labels: np.ndarray  # float32[rows]


def _chunks(rows: Iterator[Row], size: int) -> Iterator[list[Row]]:
    while chunk := list(itertools.islice(rows, size)):
        yield chunk


def _concat(parts: list[np.ndarray], dtype: type) -> np.ndarray:
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.empty(0, dtype)


class BatchBuilder:
    """Builds a job's batches. Each split is read and encoded once, on first use; the train split
    is always read first since the dense normalization statistics come from it.

    Batches of an epoch come in ``batch_id`` order 0, 1, ...; batch ``b`` is destined for NN rank
    ``b % topology.nn_ranks``. Train rows keep file order, or are shuffled per epoch by
    ``(training.seed, epoch)`` when ``training.shuffle``; the last batch may be smaller.
    """

    def __init__(self, job: JobConfig, *, quarantine: str | Path | None = None) -> None:
        self.job = job
        self.quarantine = Path(quarantine) if quarantine is not None else None
        self._splits: dict[str, EncodedSplit] = {}
        self._dense_stats: dict[str, dict[str, float]] | None = None

    def split(self, name: Split) -> EncodedSplit:
        if name not in self._splits:
            if name == "test" and "train" not in self._splits:
                self.split("train")
            self._splits[name] = self._encode(name)
        return self._splits[name]

    @property
    def has_test(self) -> bool:
        data = self.job.data
        return data.test_rows > 0 if isinstance(data, SyntheticData) else data.test is not None

    @property
    def dense_stats(self) -> dict[str, dict[str, float]]:
        """The normalization statistics in use, ``{column: {"mean", "std"} | {"min", "max"}}``, of
        ``standard`` and ``minmax`` columns (given in the job, or computed on the train split)."""
        self.split("train")
        assert self._dense_stats is not None
        return self._dense_stats

    @property
    def malformed(self) -> dict[str, int]:
        """Malformed rows skipped so far, by reason, over the splits read."""
        total: Counter[str] = Counter()
        for encoded in self._splits.values():
            total.update(encoded.malformed)
        return dict(total)

    def num_batches(self, split: Split = "train") -> int:
        return -(-self.split(split).rows // self._batch_size(split))

    def batches(self, split: Split = "train", epoch: int = 0) -> Iterator[Batch]:
        data = self.split(split)
        size = self._batch_size(split)
        training = self.job.training
        if split == "train" and training.shuffle:
            order = np.random.default_rng((training.seed, epoch)).permutation(data.rows)
        else:
            order = np.arange(data.rows)
        for batch_id, start in enumerate(range(0, data.rows, size)):
            rows = order[start : start + size]
            slots = {
                slot.name: _gather(values, offsets, rows)
                for slot, values, offsets in zip(
                    self.job.slots, data.slot_values, data.slot_offsets, strict=True
                )
            }
            yield Batch(
                batch_id=batch_id,
                epoch=epoch,
                rank=batch_id % self.job.topology.nn_ranks,
                ids=KeyedIds.from_slots(slots),
                dense=data.dense[rows],
                labels=data.labels[rows],
            )

    def _batch_size(self, split: Split) -> int:
        training = self.job.training
        return training.batch_size if split == "train" else training.eval_batch_size

    def _encode(self, split: Split) -> EncodedSplit:
        job = self.job
        slot_values: list[list[np.ndarray]] = [[] for _ in job.slots]
        slot_lengths: list[list[np.ndarray]] = [[] for _ in job.slots]
        dense_parts: list[np.ndarray] = []
        label_parts: list[np.ndarray] = []
        malformed: Counter[str] = Counter()
        quarantine: IO[str] | None = None
        try:
            for chunk in _chunks(read_rows(job.data, split), _CHUNK_ROWS):
                parsed, bad = self._parse_chunk(chunk)
                for k, (values, lengths) in enumerate(parsed.slots):
                    slot_values[k].append(values)
                    slot_lengths[k].append(lengths)
                dense_parts.append(parsed.dense)
                label_parts.append(parsed.labels)
                for row, problem in bad:
                    malformed[problem.kind] += 1
                    if sum(malformed.values()) <= _LOGGED_PER_SPLIT:
                        logger.warning(
                            "%s:%d: skipped malformed row: %s", row.file, row.line, problem.reason
                        )
                    if self.quarantine is not None:
                        if quarantine is None:
                            self.quarantine.parent.mkdir(parents=True, exist_ok=True)
                            quarantine = self.quarantine.open("a", encoding="utf-8")
                        record = {"file": row.file, "line": row.line, "reason": problem.reason}
                        quarantine.write(json.dumps({**record, "raw": row.raw}) + "\n")
        finally:
            if quarantine is not None:
                quarantine.close()
        if malformed:
            total = sum(malformed.values())
            logger.warning("%s split: skipped %d malformed rows %s", split, total, dict(malformed))

        raw_dense = np.concatenate(dense_parts) if dense_parts else np.empty((0, len(job.dense)))
        if split == "train":
            self._dense_stats = self._compute_stats(raw_dense)
        return EncodedSplit(
            name=split,
            slot_values=tuple(_concat(parts, np.uint64) for parts in slot_values),
            slot_offsets=tuple(
                np.concatenate([[0], np.cumsum(_concat(parts, np.int64))]) for parts in slot_lengths
            ),
            dense=self._normalize(raw_dense),
            labels=_concat(label_parts, np.float32),
            malformed=dict(malformed),
        )

    def _parse_chunk(self, rows: list[Row]) -> tuple[_Parsed, list[tuple[Row, _Problem]]]:
        """Parse rows column by column; also return the malformed ones (in line order) with the
        first problem of each (checks in order: field count, dense columns, label)."""
        job = self.job
        columns_of_source = SOURCE_COLUMNS[job.data.source]
        index = {c: i for i, c in enumerate(columns_of_source)}
        n_fields = len(columns_of_source)
        bad = [
            (r, _Problem(FIELD_COUNT, f"expected {n_fields} fields, got {len(r.fields)}"))
            for r in rows
            if len(r.fields) != n_fields
        ]
        if bad:
            rows = [r for r in rows if len(r.fields) == n_fields]
        n = len(rows)
        columns = list(zip(*(r.fields for r in rows), strict=True)) or [()] * n_fields
        problems: dict[int, _Problem] = {}  # row index -> its first problem

        dense = np.empty((n, len(job.dense)))
        for j, d in enumerate(job.dense):
            cells = columns[index[d.column]]
            try:
                values = np.array([float(c) if c else math.nan for c in cells], np.float64)
            except ValueError:  # rare: find the culprits cell by cell
                values = np.full(n, math.nan)
                for i, cell in enumerate(cells):
                    try:
                        values[i] = float(cell) if cell else math.nan
                    except ValueError:
                        problems.setdefault(
                            i, _Problem(DENSE_VALUE, f"{d.column}: non-numeric value {cell!r}")
                        )
            present = np.fromiter(map(bool, cells), bool, n)
            for i in np.flatnonzero(present & ~np.isfinite(values)):
                problems.setdefault(
                    i, _Problem(DENSE_VALUE, f"{d.column}: non-finite value {cells[i]!r}")
                )
            dense[:, j] = values

        label = job.label
        cells = columns[index[label.column]]
        positive = np.fromiter(map(frozenset(label.positive).__contains__, cells), bool, n)
        if label.negative is None:
            negative = np.fromiter(map(bool, cells), bool, n) & ~positive
        else:
            negative = np.fromiter(map(frozenset(label.negative).__contains__, cells), bool, n)
        for i in np.flatnonzero(~positive & ~negative):
            problems.setdefault(
                i, _Problem(LABEL, f"{label.column}: unknown label {cells[i]!r}")
            )

        keep = np.ones(n, bool)
        keep[list(problems)] = False
        slots = []
        for slot in job.slots:
            cells = columns[index[slot.column]]
            if problems:
                cells = tuple(itertools.compress(cells, keep))
            if slot.separator is None:  # one ID per non-empty cell (max_len >= 1 keeps it)
                values, lengths = list(filter(None, cells)), np.fromiter(map(bool, cells), np.int64)
            else:
                split_cells = [
                    [v for v in c.split(slot.separator) if v][: slot.max_len] for c in cells
                ]
                values = list(itertools.chain.from_iterable(split_cells))
                lengths = np.array([len(v) for v in split_cells], np.int64)
            slots.append((trillium_native.hash_ids(slot.name, values), lengths))

        bad += [(rows[i], problem) for i, problem in problems.items()]
        bad.sort(key=lambda entry: entry[0].line)
        parsed = _Parsed(slots, dense[keep], positive[keep].astype(np.float32))
        return parsed, bad

    def _compute_stats(self, raw: np.ndarray) -> dict[str, dict[str, float]]:
        stats = {}
        for j, d in enumerate(self.job.dense):
            values = raw[:, j][~np.isnan(raw[:, j])]
            if d.normalization == "standard":
                if d.mean is not None and d.std is not None:
                    stats[d.column] = {"mean": d.mean, "std": d.std}
                else:
                    std = float(values.std()) if len(values) else 0.0
                    # A constant (or empty) column: nothing to scale, keep it finite.
                    mean = float(values.mean()) if len(values) else 0.0
                    stats[d.column] = {"mean": mean, "std": std if std > 0 else 1.0}
            elif d.normalization == "minmax":
                if d.min is not None and d.max is not None:
                    stats[d.column] = {"min": d.min, "max": d.max}
                else:
                    lo = float(values.min()) if len(values) else 0.0
                    hi = float(values.max()) if len(values) else 1.0
                    stats[d.column] = {"min": lo, "max": hi if hi > lo else lo + 1.0}
        return stats

    def _normalize(self, raw: np.ndarray) -> np.ndarray:
        assert self._dense_stats is not None
        out = np.empty(raw.shape, np.float32)
        for j, d in enumerate(self.job.dense):
            x, s = raw[:, j], self._dense_stats.get(d.column, {})
            if d.normalization == "standard":
                x = (x - s["mean"]) / s["std"]
            elif d.normalization == "minmax":
                x = (x - s["min"]) / (s["max"] - s["min"])
            elif d.normalization == "log1p":
                x = np.sign(x) * np.log1p(np.abs(x))
            out[:, j] = np.nan_to_num(x, nan=0.0)
        return out


def _gather(
    values: np.ndarray, offsets: np.ndarray, rows: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(values, lengths) of ``rows`` of a jagged column, in the order of ``rows``."""
    starts = offsets[rows]
    lengths = offsets[rows + 1] - starts
    # Output j comes from starts[row of j] + (j - the first output position of that row).
    shift = np.repeat(starts - (np.cumsum(lengths) - lengths), lengths)
    return values[shift + np.arange(len(shift))], lengths.astype(np.int32)
