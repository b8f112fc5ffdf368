"""Synthetic Criteo-format data drawn from a planted logistic model.

A row is `label, I1..I13, C1..C26` tab-separated, as in Criteo's display-advertising logs:
categorical cells are 8 hex digits (empty when missing) whose per-slot popularity follows a power
law (Zipf), dense cells non-negative integer counts (empty when missing). The label is drawn from

    P(y = 1) = sigmoid(bias + sum_slots w_slot[id] + sum_j v_j * (log1p(count_j) - mu_j) / s_j)

with per-ID weights `w` and dense weights `v` fixed by the seed, and `bias` set so that about
`positive_rate` of the rows are positive. Knowing the true probabilities gives the Bayes-optimal
AUC: the ceiling any model trained on the data can reach.

Everything is vectorised numpy. The same (seed, split, rows) always give the same rows, so the
in-process `synthetic` source and a file written by `generate_criteo` hold identical data.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trillium.data.sources.rows import Split

__all__ = [
    "DEFAULT_VOCAB_SIZES",
    "SAMPLE_ROWS",
    "DatagenReport",
    "PlantedModel",
    "SyntheticRows",
    "generate_criteo",
]

NUM_CATEGORICAL = 26
NUM_DENSE = 13
# Log-spaced from 10^3 to 10^6, like Criteo's mix of small and huge vocabularies.
DEFAULT_VOCAB_SIZES: tuple[int, ...] = tuple(int(v) for v in np.round(np.logspace(3, 6, NUM_CATEGORICAL)))
_SPLIT_STREAM = {"train": 1, "test": 2}  # stream 0 draws the model itself
SAMPLE_ROWS = 1 << 17  # rows per block of PlantedModel.sample (the RNG draws them block by block)
_POW10 = 10 ** np.arange(19, dtype=np.int64)


def _rng(seed: int, stream: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(stream,)))


@dataclass(frozen=True, eq=False)
class SyntheticRows:
    """A block of generated rows; -1 marks a missing cell."""

    categorical: np.ndarray  # int64[n, 26]: index of the ID within its slot's vocabulary
    dense: np.ndarray  # int64[n, 13]: counts
    probs: np.ndarray  # float64[n]: the planted model's P(y = 1)
    labels: np.ndarray  # uint8[n]

    def to_tsv(self) -> bytes:
        """The rows as Criteo-format TSV lines, built without a per-row Python loop: each cell gets
        a fixed-width field of a byte matrix, padded with NUL bytes that are dropped at the end."""
        n = len(self.labels)
        dense_width = [int(np.searchsorted(_POW10[1:], col.max(initial=0), side="right")) + 1 for col in self.dense.T]
        widths = [1, *dense_width, *[8] * NUM_CATEGORICAL]
        starts = np.concatenate([[0], np.cumsum(np.add(widths, 1))])
        out = np.zeros((n, int(starts[-1])), np.uint8)
        out[:, starts[1:] - 1] = ord("\t")
        out[:, -1] = ord("\n")
        out[:, 0] = ord("0") + self.labels
        for j, width in enumerate(dense_width):
            col = self.dense[:, j : j + 1]
            powers = _POW10[width - 1 :: -1] if width > 1 else _POW10[:1]
            chars = (np.maximum(col, 0) // powers % 10 + ord("0")).astype(np.uint8)
            # Blank leading zeros (all but the last digit) and missing cells.
            chars[(col < powers) & (powers > 1) | (col < 0)] = 0
            out[:, starts[1 + j] : starts[1 + j] + width] = chars
        # Scramble (slot, index) into 32 bits so IDs look like Criteo's hashed values; an odd
        # multiplier mod 2^32 is a bijection, so distinct indices stay distinct within a slot.
        salt = np.arange(NUM_CATEGORICAL, dtype=np.uint32) * np.uint32(0x85EBCA77)
        hashed = self.categorical.astype(np.uint32) * np.uint32(0x9E3779B1) + salt
        octets = hashed.astype(">u4").view(np.uint8).reshape(n, NUM_CATEGORICAL, 4)
        nibbles = np.stack([octets >> 4, octets & 15], axis=-1).reshape(n, NUM_CATEGORICAL, 8)
        chars = nibbles + np.uint8(ord("0"))
        chars += (nibbles > 9) * np.uint8(ord("a") - ord("0") - 10)
        chars[self.categorical < 0] = 0
        first = starts[1 + NUM_DENSE]
        cat_block = out[:, first : first + 9 * NUM_CATEGORICAL].reshape(n, NUM_CATEGORICAL, 9)
        cat_block[:, :, :8] = chars
        flat = out.reshape(-1)
        return flat[flat != 0].tobytes()


@dataclass(frozen=True, eq=False)
class PlantedModel:
    """The logistic model labels are drawn from; `create` makes one from a seed."""

    seed: int
    vocab_sizes: tuple[int, ...]
    zipf_exponent: float
    cat_missing: np.ndarray  # float64[26]: P(cell empty) per slot
    cat_weights: tuple[np.ndarray, ...]  # float32[vocab] per slot
    dense_log_mean: np.ndarray  # float64[13]: counts are floor(lognormal(mean, sigma))
    dense_log_sigma: np.ndarray
    dense_missing: np.ndarray
    dense_weights: np.ndarray
    bias: float
    # A missing count acts as a zero count, not as one at its mean: what a model reading the file
    # (an empty dense cell is 0) can tell apart, so the planted AUC is a ceiling it can reach.
    missing_count_is_zero: bool = False

    @classmethod
    def create(
        cls,
        seed: int = 0,
        *,
        vocab_sizes: Sequence[int] | None = None,
        zipf_exponent: float = 1.1,
        positive_rate: float = 0.25,
        missing_count_is_zero: bool = False,
    ) -> PlantedModel:
        sizes = tuple(int(v) for v in (vocab_sizes or DEFAULT_VOCAB_SIZES))
        if len(sizes) != NUM_CATEGORICAL or min(sizes) < 1:
            raise ValueError(f"vocab_sizes must be {NUM_CATEGORICAL} positive ints, got {sizes}")
        if zipf_exponent < 0.0 or zipf_exponent == 1.0:
            raise ValueError(f"zipf_exponent must be >= 0 and not 1 (0: uniform), got {zipf_exponent}")
        if not 0.0 < positive_rate < 1.0:
            raise ValueError(f"positive_rate must be in (0, 1), got {positive_rate}")
        rng = _rng(seed, 0)
        # Slots differ in how much they say about the label; a few are often empty, as in Criteo.
        scales = rng.uniform(0.05, 0.6, NUM_CATEGORICAL)
        model = cls(
            seed=seed,
            vocab_sizes=sizes,
            zipf_exponent=zipf_exponent,
            cat_missing=rng.choice([0.0, 0.0, 0.0, 0.05, 0.2, 0.4], NUM_CATEGORICAL),
            cat_weights=tuple(
                rng.normal(0.0, scale, size).astype(np.float32) for scale, size in zip(scales, sizes, strict=True)
            ),
            dense_log_mean=rng.uniform(0.0, 3.0, NUM_DENSE),
            dense_log_sigma=rng.uniform(0.5, 1.5, NUM_DENSE),
            dense_missing=rng.choice([0.0, 0.0, 0.05, 0.2, 0.45], NUM_DENSE),
            dense_weights=rng.normal(0.0, 0.3, NUM_DENSE),
            bias=0.0,
            missing_count_is_zero=missing_count_is_zero,
        )
        # Bias: solve mean(sigmoid(bias + logit)) = positive_rate on a calibration sample
        # (monotone in bias, so bisection).
        logits = model._logits(*model._draw(20_000, rng))
        lo, hi = -30.0, 30.0
        for _ in range(60):
            mid = (lo + hi) / 2
            if np.mean(1.0 / (1.0 + np.exp(-(mid + logits)))) < positive_rate:
                lo = mid
            else:
                hi = mid
        object.__setattr__(model, "bias", (lo + hi) / 2)
        return model

    def _draw(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        categorical = np.empty((n, NUM_CATEGORICAL), np.int64)
        exponent = 1.0 - self.zipf_exponent
        for s, size in enumerate(self.vocab_sizes):
            # Power-law ranks by the inverse CDF of density x^-a on [1, size + 1).
            u = rng.random(n)
            x = ((np.float64(size + 1) ** exponent - 1.0) * u + 1.0) ** (1.0 / exponent)
            categorical[:, s] = np.minimum(x.astype(np.int64), size) - 1
            categorical[rng.random(n) < self.cat_missing[s], s] = -1
        counts = np.floor(rng.lognormal(self.dense_log_mean, self.dense_log_sigma, (n, NUM_DENSE)))
        dense = counts.astype(np.int64)
        dense[rng.random((n, NUM_DENSE)) < self.dense_missing] = -1
        return categorical, dense

    def _logits(self, categorical: np.ndarray, dense: np.ndarray) -> np.ndarray:
        logits = np.full(len(categorical), self.bias)
        for s, weights in enumerate(self.cat_weights):
            ids = categorical[:, s]
            logits += np.where(ids >= 0, weights[np.maximum(ids, 0)], 0.0)
        z = (np.log1p(np.maximum(dense, 0)) - self.dense_log_mean) / self.dense_log_sigma
        logits += (z if self.missing_count_is_zero else np.where(dense >= 0, z, 0.0)) @ self.dense_weights
        return logits

    def sample(self, rows: int, split: Split = "train") -> Iterator[SyntheticRows]:
        """`rows` rows of `split` (an independent stream per split), in blocks."""
        rng = _rng(self.seed, _SPLIT_STREAM[split])
        for start in range(0, rows, SAMPLE_ROWS):
            categorical, dense = self._draw(min(SAMPLE_ROWS, rows - start), rng)
            probs = 1.0 / (1.0 + np.exp(-self._logits(categorical, dense)))
            labels = (rng.random(len(probs)) < probs).astype(np.uint8)
            yield SyntheticRows(categorical, dense, probs, labels)


@dataclass(frozen=True)
class DatagenReport:
    path: Path
    rows: int
    positive_rate: float
    auc: float  # the planted model's own AUC on the generated labels: the Bayes-optimal ceiling


def generate_criteo(
    path: str | Path,
    rows: int,
    seed: int = 0,
    *,
    split: Split = "train",
    vocab_sizes: Sequence[int] | None = None,
    zipf_exponent: float = 1.1,
    positive_rate: float = 0.25,
    missing_count_is_zero: bool = False,
) -> DatagenReport:
    """Write `rows` Criteo-format TSV rows drawn from the planted model of `seed`.

    Args:
        path: the TSV file to write (parent directories are created).
        rows: how many rows.
        seed: fixes the planted model and the rows; the same seed always gives the same file.
        split: `"train"` or `"test"`: independent rows from the same planted model, so a
            train and a test file made with one seed form a proper train/test pair.
        vocab_sizes: the vocabulary size of each of the 26 categorical slots (default
            `DEFAULT_VOCAB_SIZES`, 10^3..10^6).
        zipf_exponent: power-law exponent of ID popularity within a slot (>= 0 and not 1; 0 draws
            IDs uniformly, below 1 reaches the tail of a large vocabulary in few rows).
        positive_rate: the target fraction of positive labels.
        missing_count_is_zero: a missing dense cell adds what a zero count does (default: nothing,
            which no model reading the file can tell from a zero count: its AUC ceiling is lower).

    Returns:
        A `DatagenReport` with the rows' positive rate and the Bayes-optimal AUC.
    """
    if rows < 1:
        raise ValueError(f"rows must be >= 1, got {rows}")
    model = PlantedModel.create(
        seed,
        vocab_sizes=vocab_sizes,
        zipf_exponent=zipf_exponent,
        positive_rate=positive_rate,
        missing_count_is_zero=missing_count_is_zero,
    )
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    probs, labels = [], []
    with path.open("wb") as f:
        for block in model.sample(rows, split):
            f.write(block.to_tsv())
            probs.append(block.probs)
            labels.append(block.labels)
    all_labels = np.concatenate(labels)
    # Here, not at the top: the data loader reads synthetic sources through this module, and its
    # image carries no scikit-learn (the `train` extra).
    from trillium.metrics import auc

    return DatagenReport(
        path=path,
        rows=rows,
        positive_rate=float(all_labels.mean()),
        auc=auc(all_labels, np.concatenate(probs)),
    )
