"""Dense normalization statistics, their one home: those a job gives (`given_stats`), those of a
file job's train split from one streaming pass over it (`dense_stats`, exact and the same for
every loader), and those of a stream, kept online (`OnlineStats`). Either is a small dict,
`{column: {"mean", "std"} | {"min", "max"}}`, that a checkpoint keeps."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from trillium.data.sources import open_source
from trillium.job import JobConfig

from .encode import DenseStats, Encoder, in_order
from .quarantine import Quarantine

_STATS_CHUNK = 1 << 17  # values of a column folded into its statistics at a time


def stats_from_data(job: JobConfig) -> list[str]:
    """The dense columns whose statistics come from the train split (a pass over it is needed)."""
    return [
        d.column
        for d in job.dense
        if (d.normalization == "standard" and d.mean is None) or (d.normalization == "minmax" and d.min is None)
    ]


@dataclass
class Moments:
    """Count, mean, sum of squared deviations, min and max of a column's values; `fold` adds a
    batch of values with Chan, Golub and LeVeque's pairwise update. A stream's statistics are one
    of these per column (`OnlineStats`), a file's are folded in fixed chunks (`_Moments`)."""

    n: float = 0.0
    mean: float = 0.0
    m2: float = 0.0
    lo: float = math.inf
    hi: float = -math.inf

    def fold(self, x: np.ndarray) -> None:
        k, kmean = len(x), float(x.mean())
        m2 = float(((x - kmean) ** 2).sum())
        total = self.n + k
        delta = kmean - self.mean
        self.mean += delta * k / total
        self.m2 += m2 + delta * delta * self.n * k / total
        self.n = total
        self.lo, self.hi = min(self.lo, float(x.min())), max(self.hi, float(x.max()))

    def stats(self, normalization: str) -> dict[str, float]:
        if not self.n:  # nothing seen: scale nothing
            return _normalizer(normalization, 0.0, 0.0, 0.0, 1.0)
        return _normalizer(normalization, self.mean, math.sqrt(self.m2 / self.n), self.lo, self.hi)


def _normalizer(normalization: str, mean: float, std: float, lo: float, hi: float) -> dict[str, float]:
    """A column's statistics as the encoder uses them; a constant (or empty) column scales nothing."""
    if normalization == "standard":
        return {"mean": mean, "std": std if std > 0 else 1.0}
    return {"min": lo, "max": hi if hi > lo else lo + 1.0}


class _Moments:
    """A file column's `Moments`, folded in chunks of exactly `_STATS_CHUNK` values, so memory
    stays bounded and the result does not depend on how the input was cut into blocks. A column of
    fewer than two chunks' values gets numpy's own mean and std of them, as the replaced reader did."""

    def __init__(self) -> None:
        self.pending: list[np.ndarray] = []
        self.moments = Moments()

    def add(self, values: np.ndarray) -> None:
        self.pending.append(values)
        if sum(len(p) for p in self.pending) >= 2 * _STATS_CHUNK:
            values = np.concatenate(self.pending)
            whole = len(values) // _STATS_CHUNK * _STATS_CHUNK
            for start in range(0, whole - _STATS_CHUNK, _STATS_CHUNK):  # keep a chunk pending
                self.moments.fold(values[start : start + _STATS_CHUNK])
            self.pending = [values[whole - _STATS_CHUNK :]]

    def stats(self, normalization: str) -> dict[str, float]:
        rest = np.concatenate(self.pending) if self.pending else np.empty(0)
        if self.moments.n == 0:  # one chunk or less: numpy's statistics of the values
            if not len(rest):
                return _normalizer(normalization, 0.0, 0.0, 0.0, 1.0)
            return _normalizer(
                normalization, float(rest.mean()), float(rest.std()), float(rest.min()), float(rest.max())
            )
        for start in range(0, len(rest), _STATS_CHUNK):
            self.moments.fold(rest[start : start + _STATS_CHUNK])
        return self.moments.stats(normalization)


class OnlineStats:
    """Normalization statistics of a stream, from the values seen so far: a `Moments` per
    `standard` or `minmax` column without statistics in the job. Its state is a plain value
    (checkpoints): column -> [n, mean, m2, min, max]."""

    def __init__(self, job: JobConfig, state: dict[str, list[float]] | None = None) -> None:
        self.given = given_stats(job)
        self.columns = [(j, d) for j, d in enumerate(job.dense) if d.column in stats_from_data(job)]
        self.moments = {d.column: Moments(*state[d.column]) if state else Moments() for _, d in self.columns}

    def update(self, raw: np.ndarray) -> None:
        """Fold in a block's raw dense values (float64[rows, num_dense], NaN where missing)."""
        for j, d in self.columns:
            x = raw[:, j][~np.isnan(raw[:, j])]
            if len(x):
                self.moments[d.column].fold(x)

    def stats(self) -> DenseStats:
        return self.given | {d.column: self.moments[d.column].stats(d.normalization) for _, d in self.columns}

    def state(self) -> dict[str, list[float]]:
        return {column: [m.n, m.mean, m.m2, m.lo, m.hi] for column, m in self.moments.items()}


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
    for checked in in_order(tasks, encoder.check):
        if quarantine is not None:
            quarantine.add(checked.bad)
        for column, m in moments.items():
            x = checked.dense[checked.keep, index[column]]
            m.add(x[~np.isnan(x)])
    normalization = {d.column: d.normalization for d in job.dense}
    return stats | {column: m.stats(normalization[column]) for column, m in moments.items()}
