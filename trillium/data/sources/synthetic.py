"""The `synthetic` source: Criteo-format rows drawn in process from trillium.data.sources.datagen's planted
model, read as the `criteo` preset reads a file (the same parser, the same line numbers), so that a
job on them and one on the file `trillium datagen` writes see the same batches.

Loaders share the rows by the model's sample blocks (`datagen.SAMPLE_ROWS` rows each); since the
model draws its blocks in sequence, a loader draws the blocks before its share too, and drops them.
"""

from __future__ import annotations

import io
from collections.abc import Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from trillium.data.sources.datagen import SAMPLE_ROWS, PlantedModel
from trillium.data.sources.delimited import Spec, block_task
from trillium.data.sources.files import LineChain, LineCounter, Unit, cut, share
from trillium.data.sources.presets import CRITEO
from trillium.data.sources.rows import BlockTask, Split
from trillium.job.data import CRITEO_COLUMNS

if TYPE_CHECKING:
    from trillium.job import JobConfig, SyntheticData

__all__ = ["SyntheticSource"]


class SyntheticSource:
    def __init__(self, data: SyntheticData) -> None:
        self._data = data

    def has(self, split: Split) -> bool:
        return split == "train" or self._data.test_rows > 0

    def check(self, job: JobConfig, *, missing_files_ok: bool = False) -> None:
        """Nothing to read: the job schema has checked the columns against Criteo's."""

    def blocks(self, split: Split, columns: Sequence[str], *, part: int = 0, parts: int = 1) -> Iterator[BlockTask]:
        rows = self._data.rows if split == "train" else self._data.test_rows
        name = f"<synthetic {split}>"
        units = [
            Unit(0, Path(name), b, b + 1, min(SAMPLE_ROWS, rows - start))
            for b, start in enumerate(range(0, rows, SAMPLE_ROWS))
        ]
        mine = share(units, part, parts)
        if not mine:
            return
        first, last = mine[0].first, mine[-1].last
        spec = Spec(name, CRITEO_COLUMNS, tuple(columns), CRITEO, None, split, 0)
        model = PlantedModel.create(
            self._data.seed, vocab_sizes=self._data.vocab_sizes, zipf_exponent=self._data.zipf_exponent
        )
        skipped = 0  # rows (lines) of the blocks before the share
        lines: LineChain | None = None
        i = 0
        for b, sample in enumerate(model.sample(rows, split)):
            if b >= last:
                return
            if b < first:
                skipped += len(sample.labels)
                continue
            lines = lines or LineChain(LineCounter(Path(name), 0, 1 + skipped))
            for _, _, data in cut(io.BytesIO(sample.to_tsv()), 0, 1 << 62, None):
                yield partial(block_task, spec, 0, i, partial(bytes, data), lines)
                i += 1
