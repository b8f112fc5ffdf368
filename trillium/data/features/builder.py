"""A job's batches from splits held in memory (`BatchBuilder`): for the reference trainer, tests and
benchmarks; a data loader streams (`epoch_batches`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

from trillium.data.sources import Split, check_columns, open_source
from trillium.job import JobConfig
from trillium.wire.batch import Batch

from .encode import DenseStats, EncodedBlock, Encoder
from .epochs import _batch_size, _encoded, _epoch
from .quarantine import Quarantine
from .stats import dense_stats, stats_from_data


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
            empty = EncodedBlock.empty(self.job)
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
