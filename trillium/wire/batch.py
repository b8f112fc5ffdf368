"""The data structures every Trillium component exchanges.

- `KeyedIds`: the IDs of one batch, jagged per feature slot (after TorchRec's KeyedJaggedTensor).
- `Batch`: one training/eval batch as produced by the data loader.
- `EmbeddingRef`: the handle an embedding worker returns with a batch's embeddings, so the NN
  worker can route the gradients back to it.
- `GradientUpdate`: the embedding gradients of one step's batches of one or more NN ranks, destined
  for one PS shard.

They are frozen and validated on construction (a `ValueError` naming the problem), so a value that
exists is well formed. Arrays are referenced, not copied: they may be read-only views into a decoded
message (see `trillium.wire.codec`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np

__all__ = ["Batch", "EmbeddingRef", "GradientUpdate", "KeyedIds"]


def _require_array(name: str, value: object, dtype: type, ndim: int) -> np.ndarray:
    if not isinstance(value, np.ndarray):
        raise ValueError(f"{name} must be a numpy array, got {type(value).__name__}")
    if value.dtype != dtype:
        raise ValueError(f"{name} must have dtype {np.dtype(dtype)}, got {value.dtype}")
    if value.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {value.shape}")
    return value


def _require_index(name: str, value: object) -> None:
    # bool is an int subclass; a True batch_id is always a bug.
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")


@dataclass(frozen=True, eq=False)
class KeyedIds:
    """The IDs of a batch, grouped by feature slot.

    `values` holds every ID, key-major: all of slot `keys[0]`'s IDs (sample 0's, then sample
    1's, ...), then slot `keys[1]`'s, and so on. `lengths[k * batch_size + i]` is how many IDs
    sample `i` has in slot `keys[k]` (0 for a missing value).
    """

    keys: tuple[str, ...]
    values: np.ndarray  # uint64[sum(lengths)]
    lengths: np.ndarray  # int32[len(keys) * batch_size]

    def __post_init__(self) -> None:
        if not isinstance(self.keys, tuple) or not all(isinstance(k, str) and k for k in self.keys):
            raise ValueError(f"keys must be a tuple of non-empty strings, got {self.keys!r}")
        if not self.keys:
            raise ValueError("keys must name at least one feature slot")
        if len(set(self.keys)) != len(self.keys):
            raise ValueError(f"keys must be unique, got {self.keys!r}")
        _require_array("values", self.values, np.uint64, 1)
        lengths = _require_array("lengths", self.lengths, np.int32, 1)
        if len(lengths) % len(self.keys):
            raise ValueError(f"len(lengths)={len(lengths)} is not a multiple of the {len(self.keys)} keys")
        if len(lengths) and lengths.min() < 0:
            raise ValueError("lengths must be non-negative")
        total = int(lengths.sum(dtype=np.int64))
        if total != len(self.values):
            raise ValueError(f"lengths sum to {total} but there are {len(self.values)} values")

    @classmethod
    def from_slots(cls, slots: Mapping[str, tuple[np.ndarray, np.ndarray]]) -> KeyedIds:
        """From `{key: (values, lengths)}`, in key order; all slots have the same batch size."""
        if not slots:
            raise ValueError("keys must name at least one feature slot")
        sizes = {key: len(lengths) for key, (_, lengths) in slots.items()}
        if len(set(sizes.values())) > 1:
            raise ValueError(f"slots disagree on the batch size: {sizes}")
        return cls(
            keys=tuple(slots),
            values=np.concatenate([values for values, _ in slots.values()]),
            lengths=np.concatenate([lengths for _, lengths in slots.values()]),
        )

    @property
    def batch_size(self) -> int:
        return len(self.lengths) // len(self.keys)

    def offsets(self) -> np.ndarray:
        """int64[len(lengths) + 1]: `values[offsets[j]:offsets[j + 1]]` are entry `j`'s IDs."""
        out = np.zeros(len(self.lengths) + 1, np.int64)
        np.cumsum(self.lengths, out=out[1:])
        return out

    def slot(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        """(values, lengths) of one slot: views, lengths of shape (batch_size,)."""
        try:
            k = self.keys.index(key)
        except ValueError:
            raise KeyError(f"no slot {key!r}; keys are {list(self.keys)}") from None
        b = self.batch_size
        lengths = self.lengths[k * b : (k + 1) * b]
        start = int(self.lengths[: k * b].sum(dtype=np.int64))
        return self.values[start : start + int(lengths.sum(dtype=np.int64))], lengths

    def first(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        """(uint64[batch_size], bool[batch_size]): each sample's first ID in slot `key`, and
        whether it has one (a sample with none reads 0 there)."""
        values, lengths = self.slot(key)
        has = lengths > 0
        starts = np.cumsum(lengths, dtype=np.int64) - lengths
        out = np.zeros(len(lengths), np.uint64)
        out[has] = values[starts[has]]
        return out, has

    def unique(self) -> tuple[np.ndarray, np.ndarray]:
        """(unique IDs sorted, inverse) with `unique_ids[inverse] == values`."""
        ids, inverse = np.unique(self.values, return_inverse=True)
        return ids, inverse.reshape(-1)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, KeyedIds):
            return NotImplemented
        return (
            self.keys == other.keys
            and np.array_equal(self.lengths, other.lengths)
            and np.array_equal(self.values, other.values)
        )

    __hash__ = None  # type: ignore[assignment]  # holds mutable arrays


@dataclass(frozen=True, eq=False)
class Batch:
    """One batch: `batch_id` is `step * nn_ranks + rank` (see the data loader), `rank` the NN
    rank it is destined for.

    A batch of a stream also says which event each sample is (`sample_ids`: a stable hash of the
    event's key, the sample ledger of a job) and when it became a sample (`event_times`: the
    event time of the click that made it positive, else of the impression), so training can report
    how long after the event a sample was trained, and how far its input is complete
    (`complete_through`), so a model version can say which events it holds all of.
    """

    batch_id: int
    epoch: int
    rank: int
    ids: KeyedIds
    dense: np.ndarray  # float32[batch_size, num_dense]
    labels: np.ndarray  # float32[batch_size]; a multi-task job's [batch_size, tasks], NaN: no label
    sample_ids: np.ndarray | None = None  # uint64[batch_size]
    event_times: np.ndarray | None = None  # float64[batch_size], seconds since the UNIX epoch
    # A stream's low watermark when its loader cut this batch: every impression of an earlier
    # event time is in this batch or one before it on the same partition (see the data loader).
    complete_through: float | None = None

    def __post_init__(self) -> None:
        for name in ("batch_id", "epoch", "rank"):
            _require_index(name, getattr(self, name))
        if not isinstance(self.ids, KeyedIds):
            raise ValueError(f"ids must be KeyedIds, got {type(self.ids).__name__}")
        b = self.ids.batch_size
        if _require_array("dense", self.dense, np.float32, 2).shape[0] != b:
            raise ValueError(f"dense has {self.dense.shape[0]} rows but the batch has {b} samples")
        labels = self.labels
        if not isinstance(labels, np.ndarray) or labels.ndim != 2:
            _require_array("labels", labels, np.float32, 1)
        elif _require_array("labels", labels, np.float32, 2).shape[1] < 1:
            raise ValueError(f"labels of shape {labels.shape} name no task")
        if labels.shape[0] != b:
            raise ValueError(f"labels has {labels.shape[0]} entries but the batch has {b}")
        for name, dtype in (("sample_ids", np.uint64), ("event_times", np.float64)):
            value = getattr(self, name)
            if value is not None and _require_array(name, value, dtype, 1).shape[0] != b:
                raise ValueError(f"{name} has {value.shape[0]} entries but the batch has {b}")

    @property
    def batch_size(self) -> int:
        return self.ids.batch_size

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Batch):
            return NotImplemented
        return (
            (self.batch_id, self.epoch, self.rank) == (other.batch_id, other.epoch, other.rank)
            and self.ids == other.ids
            and np.array_equal(self.dense, other.dense)
            and np.array_equal(self.labels, other.labels)
            and _same(self.sample_ids, other.sample_ids)
            and _same(self.event_times, other.event_times)
            and self.complete_through == other.complete_through
        )

    __hash__ = None  # type: ignore[assignment]


def _same(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    return a is None and b is None or a is not None and b is not None and np.array_equal(a, b)


@dataclass(frozen=True)
class EmbeddingRef:
    """Which embedding worker looked up batch `(epoch, batch_id)` for NN rank `rank`, in which
    attempt of the job (see `trillium.job.record`)."""

    worker: str
    rank: int
    batch_id: int
    epoch: int
    attempt: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.worker, str) or not self.worker:
            raise ValueError(f"worker must be a non-empty string, got {self.worker!r}")
        for name in ("rank", "batch_id", "epoch", "attempt"):
            _require_index(name, getattr(self, name))


@dataclass(frozen=True, eq=False)
class GradientUpdate:
    """The embedding gradients of one step's batches of `ranks` (the NN ranks an embedding worker
    serves, in order) for one PS shard: one message per shard and step, however many ranks.

    `tables[name] = (ids, grads)`: `ids` uint64[n], `grads` float32[n, dim]: each rank's rows in
    turn, in the order of `ranks`. The embedding worker sends each of a rank's IDs once (it sums a
    batch's gradients per ID), so an ID repeats only across ranks; nothing is checked here (a sort
    per table per message, twice on the hot path) because the PS sums the rows of one ID in a step,
    in this order, before its optimizer sees them: one update, as one process training the ranks'
    batches together would make.
    """

    ranks: tuple[int, ...]
    step: int
    epoch: int
    shard: int
    tables: Mapping[str, tuple[np.ndarray, np.ndarray]]

    def __post_init__(self) -> None:
        ranks = tuple(self.ranks) if isinstance(self.ranks, (tuple, list)) else None
        if not ranks or list(ranks) != sorted(set(ranks)):
            raise ValueError(f"ranks must be distinct NN ranks in increasing order, got {self.ranks!r}")
        for rank in ranks:
            _require_index("rank", rank)
        object.__setattr__(self, "ranks", ranks)
        for name in ("step", "epoch", "shard"):
            _require_index(name, getattr(self, name))
        if not isinstance(self.tables, Mapping):
            raise ValueError(f"tables must be a mapping, got {type(self.tables).__name__}")
        for table, entry in self.tables.items():
            if not isinstance(table, str) or not table:
                raise ValueError(f"table names must be non-empty strings, got {table!r}")
            if not isinstance(entry, tuple) or len(entry) != 2:
                raise ValueError(f"tables[{table!r}] must be an (ids, grads) tuple")
            ids = _require_array(f"tables[{table!r}] ids", entry[0], np.uint64, 1)
            grads = _require_array(f"tables[{table!r}] grads", entry[1], np.float32, 2)
            if grads.shape[0] != len(ids):
                raise ValueError(f"tables[{table!r}]: {len(ids)} ids but {grads.shape[0]} gradient rows")
        # A private read-only copy: the mapping cannot change under a frozen value.
        object.__setattr__(self, "tables", MappingProxyType(dict(self.tables)))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, GradientUpdate):
            return NotImplemented
        return (
            (self.ranks, self.step, self.epoch, self.shard) == (other.ranks, other.step, other.epoch, other.shard)
            and self.tables.keys() == other.tables.keys()
            and all(
                np.array_equal(self.tables[t][0], other.tables[t][0])
                and np.array_equal(self.tables[t][1], other.tables[t][1])
                for t in self.tables
            )
        )

    __hash__ = None  # type: ignore[assignment]
