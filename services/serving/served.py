"""One model as a replica serves it: its embedding tables (values only, `trillium_native.ServingTables`),
the dense network of each version they may be read at, and its job's transform. A serving shard
holds a slice of the tables' rows and no dense network (`Slice`; the frontend that runs the
network over the shards is sharded.py).

A request reads the tables' version first and encodes its instances with that version's dense
statistics, then looks up every table under one read lock; the lookup says the version it read,
and the request runs that version's dense network. A version applied in between (the lookup then
says another) makes the request encode again: a prediction is always one version's, never half
of two. Versions are applied in a worker thread: the files are read and checked, the dense network
built, and only then are the tables swapped or upserted under their write lock, briefly.

Shapes: B instances, F slots; `pooled` [B, sum of the pooled slots' dims]; the model's inputs
as the NN ranks give them (`trillium.models`): dense [B, num_dense], one tensor per slot.
"""

from __future__ import annotations

import contextlib
import io
import math
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

import trillium_native
from trillium import pooling
from trillium.data.instances import InstanceEncoder
from trillium.models import Objective, load_model, logits
from trillium.runtime.model_store import DENSE, CorruptVersion, ModelStore, VersionFile, VersionManifest
from trillium.runtime.storage import StorageDir

RETRIES = 3  # versions applied under one request before it gives up (a version takes seconds to come)


class OverMemoryCap(ValueError):
    """A version whose tables would take more memory than the replica's cap (`serving_memory_gb`)."""


def check_memory(manifest: VersionManifest, needed: int, cap: int | None) -> None:
    """OverMemoryCap when `needed` bytes of tables exceed `cap` (None: no cap)."""
    if cap is not None and needed > cap:
        raise OverMemoryCap(
            f"version {manifest.version} of {manifest.model}: {needed / 1e9:.4g} GB of tables, over this "
            f"replica's cap of {cap / 1e9:.4g} GB (TRILLIUM_SERVING_MEMORY_GB)"
        )


@dataclass(frozen=True)
class Slice:
    """Serving shard `index` of `count`: every table's rows whose ID's hash places them there,
    `shard_of(id, count) == index`, as the PS shards place rows: any count, whatever the job's
    `ps_shards` (S), and even slices. A training shard t holds IDs whose hash is t mod S, so it
    can hold this slice's only where t and `index` agree mod gcd(S, count): those files are read,
    and of each the share gcd / count of its rows kept (all of it where `count` divides S)."""

    index: int = 0
    count: int = 1

    @property
    def name(self) -> str:
        """`INDEX/COUNT`, as `TRILLIUM_SERVING_SHARD` and a frontend's lookups name it."""
        return f"{self.index}/{self.count}"

    def reads(self, training_shard: int, training_shards: int) -> bool:
        common = math.gcd(training_shards, self.count)
        return training_shard % common == self.index % common

    def values(self, manifest: VersionManifest) -> list[VersionFile]:
        """The values files of `manifest` this slice reads."""
        shards = manifest.config.topology.ps_shards
        return [f for f in manifest.values if f.shard is not None and self.reads(f.shard, shards)]

    def values_bytes(self, manifests: Sequence[VersionManifest]) -> int:
        """About the bytes of these versions' rows this slice keeps, in memory: the files it reads,
        each times the share of its rows kept (an ID's 8 bytes and its values; the tables keep about
        6 bytes of index a row instead of the ID, and a delta's rows that replace rows already held
        take nothing more)."""
        total = 0
        for m in manifests:
            kept = math.gcd(m.config.topology.ps_shards, self.count) / self.count
            total += sum(round(f.bytes * kept) for f in self.values(m))
        return total


WHOLE = Slice()


class VersionChurn(RuntimeError):
    """Versions were applied under every try of one request: the replica is busy (503), not broken."""


@dataclass(frozen=True)
class HeldVersion:
    manifest: VersionManifest
    module: torch.nn.Module | None  # None on a serving shard: it runs no network
    encoder: InstanceEncoder | None
    objective: Objective = field(init=False)  # what the network's outputs mean: its job's tasks

    def __post_init__(self) -> None:
        object.__setattr__(self, "objective", Objective.of(self.manifest.config))

    @property
    def tasks(self) -> list[str] | None:
        """A multi-task model's task names, in the order of its answers' columns."""
        return self.objective.names if self.objective.multitask else None

    def answers(self, dense: np.ndarray, slots: list[np.ndarray], bf16: bool) -> np.ndarray:
        """The network's answers for a batch's inputs: a probability per instance (B,), or a
        multi-task job's (B, T), each task's probability or value in its label's units."""
        assert self.module is not None
        objective = self.objective
        with torch.inference_mode():
            out = logits(self.module, torch.from_numpy(dense), [torch.from_numpy(v) for v in slots], bf16)
            scores = objective.scores(objective.outputs(out)).numpy()
        return objective.answers(scores)


@dataclass(frozen=True)
class Prediction:
    probabilities: np.ndarray  # float32[B]; a multi-task model's [B, T], in `tasks` order
    version: int
    misses: dict[str, int]  # table -> IDs of the request the model has never trained
    tasks: list[str] | None = None  # a multi-task model's task names


class ServedModel:
    """The tables of a model at one version (and, while a newer one is applied, the one before)."""

    def __init__(
        self,
        store: ModelStore,
        first: VersionManifest,
        threads: int | None = None,
        *,
        rows: Slice = WHOLE,
        dense: bool = True,
    ) -> None:
        config = first.config
        self.store = store
        self.name = first.model
        self.config = config  # its tables and shards; a version of other ones is served by a new ServedModel
        self.shards = config.topology.ps_shards
        self.rows = rows  # the rows it holds (a serving shard: a slice; IDs of others miss)
        self.dense = dense  # whether it runs the network (a replica) or only answers lookups (a serving shard)
        self.tables = trillium_native.ServingTables(
            {name: t.dim for name, t in config.tables.items()},
            self.shards,
            first.dtype,
            threads,
            slice=(rows.index, rows.count),
        )
        self.layout = pooling.Layout(config.slots, config.tables, 1)
        self.bf16 = config.training.precision == "bf16"
        self._versions: dict[int, HeldVersion] = {}
        self._lock = threading.Lock()  # one applier at a time

    @property
    def version(self) -> int:
        return self.tables.version

    def memory_bytes(self) -> int:
        return self.tables.memory_bytes()

    def table_stats(self) -> dict[str, dict[str, int]]:
        return self.tables.stats()

    @property
    def manifest(self) -> VersionManifest | None:
        held = self._versions.get(self.tables.version)
        return held.manifest if held is not None else None

    def fits(self, manifest: VersionManifest) -> bool:
        """Whether `manifest` can be applied on top of what these tables hold: a full version (of
        the same tables), or a delta whose base this one has reached in the same attempt."""
        if manifest.config.tables != self.config.tables or manifest.config.topology.ps_shards != self.shards:
            return False
        if manifest.kind == "full":
            return True
        held = self.manifest
        return (
            held is not None
            and (held.job_id, held.attempt) == (manifest.job_id, manifest.attempt)
            and held.version >= (manifest.base or 0)
        )

    def apply(self, manifest: VersionManifest) -> float:
        """Read, check and apply one version (blocking: a worker thread's); returns the seconds it
        took. `CorruptVersion` (a file missing or altered, a row on the wrong shard) leaves the
        tables as they were."""
        started = time.monotonic()
        with self._lock:
            values = self.rows.values(manifest)
            self.store.verify(manifest, values + ([manifest.file(DENSE)] if self.dense else []))
            parts = self.store.parts(manifest.parts)
            module, encoder = load_dense(parts, manifest) if self.dense else (None, None)
            self._versions[manifest.version] = HeldVersion(manifest, module, encoder)
            try:
                with _local_paths(parts, values) as paths:
                    self.tables.apply(paths, manifest.version)
            except ValueError as err:
                del self._versions[manifest.version]
                raise CorruptVersion(f"version {manifest.version} of {self.name}: {err}") from None
            except BaseException:  # the store gone mid-read: the tables are as they were, and so is this
                del self._versions[manifest.version]
                raise
            # Keep the version the tables are at and the one before: a request that read it a moment ago.
            for old in sorted(self._versions)[:-2]:
                del self._versions[old]
        return time.monotonic() - started

    def predict(self, instances: Sequence[Any]) -> Prediction:
        """Probabilities of the instances at one version (BadInstance for one that cannot be a sample)."""
        for _ in range(RETRIES):
            version = self._versions.get(self.tables.version)
            if version is None:
                continue
            batch = version.encoder.batch(instances)
            plan = pooling.plan(self.layout, batch.ids)
            names = list(plan.tables)
            rows, read_at, misses = self.tables.lookup([(t, plan.tables[t].ids) for t in names])
            if read_at == version.manifest.version:
                break
        else:
            raise VersionChurn(f"{self.name}: versions changed under {RETRIES} tries of one request")
        pooled = pooling.pool(plan, dict(zip(names, rows, strict=True)))
        dense = np.array(batch.dense, dtype=np.float32)
        answers = version.answers(dense, [values for values, _ in pooled.slots()], self.bf16)
        return Prediction(answers, read_at, dict(zip(names, misses, strict=True)), version.tasks)


def load_dense(parts: StorageDir, manifest: VersionManifest) -> tuple[torch.nn.Module, InstanceEncoder]:
    """A version's dense network, in evaluation mode, and its transform (with its dense statistics)."""
    dense = parts.read_checked(DENSE, manifest.file(DENSE).bytes, manifest.file(DENSE).sha256, CorruptVersion)
    module = load_model(manifest.config.model)
    module.load_state_dict(torch.load(io.BytesIO(dense), map_location="cpu", weights_only=True)["model"])
    module.eval()
    return module, InstanceEncoder(manifest.config, manifest.dense_stats)


@contextlib.contextmanager
def _local_paths(parts: StorageDir, values: list[VersionFile]) -> Iterator[list[tuple[int, str]]]:
    """(training shard, a local path) of each values file (downloaded when remote)."""
    with contextlib.ExitStack() as stack:
        yield [(f.shard, str(stack.enter_context(parts.reading(f.name)))) for f in values]
