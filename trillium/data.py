"""Data sources and batch building.

Readers turn a source into ``Row``s (cells in the source's column order, with file and line
number). ``BatchBuilder`` encodes a split once into columns (IDs hashed per slot with
``trillium_native.hash_ids``, dense values normalized, labels 0/1) and cuts it into ``Batch``es.

Malformed rows (wrong field count, a non-numeric dense value, an unknown label) are counted,
skipped, logged on the ``trillium.data`` logger with file and line, and appended to the quarantine
JSONL file when one is given; the job goes on.
"""

from __future__ import annotations

import json
import logging
import math
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Literal

import numpy as np
import trillium_native

from trillium.batch import Batch, KeyedIds
from trillium.datagen import PlantedModel
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

Split = Literal["train", "test"]
# Reasons a row is malformed: the keys of the counts BatchBuilder exposes.
FIELD_COUNT, DENSE_VALUE, LABEL = "field_count", "dense_value", "label"
_LOGGED_PER_SPLIT = 100  # log this many malformed rows individually, then only the totals
_CHUNK_ROWS = 1 << 16  # rows whose strings are held before hashing them


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
    with open(path, encoding="utf-8", newline="") as f:
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
    with open(path, encoding="utf-8", newline="") as f:
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


class _Malformed(Exception):
    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind


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
        """The normalization statistics in use, ``{column: {"mean", "std"} | {"min", "max"}}``,
        for ``standard`` and ``minmax`` columns (given in the job, or computed on the train split)."""
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
        n_fields = len(SOURCE_COLUMNS[job.data.source])
        index = {c: i for i, c in enumerate(SOURCE_COLUMNS[job.data.source])}
        slot_cells = [(index[s.column], s.separator, s.max_len) for s in job.slots]
        dense_cells = [(index[d.column], d.column) for d in job.dense]
        label_cell = index[job.label.column]
        positive = frozenset(job.label.positive)
        negative = frozenset(job.label.negative) if job.label.negative is not None else None

        def parse(fields: list[str]) -> tuple[list[list[str]], list[float], float]:
            if len(fields) != n_fields:
                raise _Malformed(FIELD_COUNT, f"expected {n_fields} fields, got {len(fields)}")
            dense = []
            for i, column in dense_cells:
                cell = fields[i]
                try:
                    value = float(cell) if cell else math.nan
                except ValueError:
                    raise _Malformed(DENSE_VALUE, f"{column}: non-numeric value {cell!r}") from None
                if cell and not math.isfinite(value):
                    raise _Malformed(DENSE_VALUE, f"{column}: non-finite value {cell!r}")
                dense.append(value)
            label = fields[label_cell]
            if label in positive:
                y = 1.0
            elif (label in negative) if negative is not None else bool(label):
                y = 0.0
            else:
                raise _Malformed(LABEL, f"{job.label.column}: unknown label {label!r}")
            ids = []
            for i, separator, max_len in slot_cells:
                cell = fields[i]
                if separator:
                    values = [v for v in cell.split(separator) if v]
                else:
                    values = [cell] if cell else []
                ids.append(values[:max_len])
            return ids, dense, y

        slot_strings: list[list[str]] = [[] for _ in job.slots]
        slot_lengths: list[list[int]] = [[] for _ in job.slots]
        slot_hashed: list[list[np.ndarray]] = [[] for _ in job.slots]
        dense_rows: list[list[float]] = []
        labels: list[float] = []
        malformed: Counter[str] = Counter()

        def hash_pending() -> None:
            for k, slot in enumerate(job.slots):
                if slot_strings[k]:
                    slot_hashed[k].append(trillium_native.hash_ids(slot.name, slot_strings[k]))
                    slot_strings[k] = []

        quarantine: IO[str] | None = None
        try:
            for row in read_rows(job.data, split):
                try:
                    ids, dense, y = parse(row.fields)
                except _Malformed as bad:
                    malformed[bad.kind] += 1
                    if sum(malformed.values()) <= _LOGGED_PER_SPLIT:
                        logger.warning("%s:%d: skipped malformed row: %s", row.file, row.line, bad)
                    if self.quarantine is not None:
                        if quarantine is None:
                            self.quarantine.parent.mkdir(parents=True, exist_ok=True)
                            quarantine = self.quarantine.open("a", encoding="utf-8")
                        record = {"file": row.file, "line": row.line, "reason": str(bad), "raw": row.raw}
                        quarantine.write(json.dumps(record) + "\n")
                    continue
                for k, values in enumerate(ids):
                    slot_strings[k].extend(values)
                    slot_lengths[k].append(len(values))
                dense_rows.append(dense)
                labels.append(y)
                if len(labels) % _CHUNK_ROWS == 0:
                    hash_pending()
            hash_pending()
        finally:
            if quarantine is not None:
                quarantine.close()
        if malformed:
            logger.warning(
                "%s split: skipped %d malformed rows %s",
                split,
                sum(malformed.values()),
                dict(malformed),
            )

        rows = len(labels)
        raw_dense = np.array(dense_rows, np.float64).reshape(rows, len(job.dense))
        if split == "train":
            self._dense_stats = self._compute_stats(raw_dense)
        offsets = []
        for lengths in slot_lengths:
            out = np.zeros(rows + 1, np.int64)
            np.cumsum(lengths, out=out[1:])
            offsets.append(out)
        return EncodedSplit(
            name=split,
            slot_values=tuple(
                np.concatenate(parts) if parts else np.empty(0, np.uint64) for parts in slot_hashed
            ),
            slot_offsets=tuple(offsets),
            dense=self._normalize(raw_dense),
            labels=np.array(labels, np.float32),
            malformed=dict(malformed),
        )

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


def _gather(values: np.ndarray, offsets: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(values, lengths) of ``rows`` of a jagged column, in the order of ``rows``."""
    starts = offsets[rows]
    lengths = offsets[rows + 1] - starts
    # Position j of the output comes from starts[row of j] + (j - first output position of that row).
    shift = np.repeat(starts - (np.cumsum(lengths) - lengths), lengths)
    return values[shift + np.arange(len(shift))], lengths.astype(np.int32)
