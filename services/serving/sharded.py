"""A frontend of sharded serving: the transform and the dense network of a model whose tables
live on N serving shards (shard.py), asked for a request's rows in one call per shard.

**Placement.** Serving shard s of N holds every table's rows whose ID's hash places them there,
`shard_of(id, N) == s`, as the PS shards place rows (`served.Slice`): N is free of the job's
`ps_shards`. A request's IDs, grouped by serving shard (`pooling.plan` over N), go one group a shard;
each call names the slice it takes the shard for, and a shard holding another refuses it.

**Versions: versioned reads.** A call names the version the frontend runs, and the answer says
the version the shard read. A shard behind the one named waits up to `WAIT_MS` to apply it; a
frontend behind a shard waits for its own follower to load the newer version (its network: a
small file) and asks again at that one. A request is answered only when every shard it asked
read the version whose network runs it: never rows of two versions. A shard that stays behind
(its copy of the version refused, its store away) answers 503 naming it, as does a shard none of
whose replicas answers: never a hang, never a prediction from part of the rows.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np

from trillium import pooling
from trillium.config import GrpcCredentials
from trillium.runtime.model_store import ModelStore, VersionManifest
from trillium.wire import codec, rpc
from trillium.wire.pb import serving_pb2 as pb
from trillium.wire.pb import serving_pb2_grpc as pb_grpc

from .served import RETRIES, HeldVersion, Prediction, VersionChurn, load_dense

WAIT_MS = 2000  # how long a shard behind the version asked may take to apply it (a version's apply)
CALL_TIMEOUT_S = WAIT_MS / 1000 + 1.0  # a shard that answers nothing within it is away (cut off)
# A shard killed and restarted is called again within a second of its return, not after gRPC's
# default backoff (up to 2 minutes).
RECONNECT = [("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 1000)]


class ShardUnavailable(RuntimeError):
    """A serving shard none of whose replicas answers, or that stays behind the version asked: the
    request cannot be answered whole (503, naming it)."""


class ShardClients:
    """Channels to every replica of every serving shard. A call goes to a shard's replicas in turn
    (starting one further for each call, to share the load) until one answers."""

    def __init__(self, shards: list[list[str]], creds: GrpcCredentials) -> None:
        self.addresses = shards
        self._channels = [[rpc.channel(a, creds, extra_options=RECONNECT) for a in replicas] for replicas in shards]
        self._stubs = [[pb_grpc.ServingShardStub(c) for c in channels] for channels in self._channels]
        self._turn = [0] * len(shards)

    @property
    def count(self) -> int:
        return len(self._stubs)

    def slice_name(self, shard: int) -> str:
        """The slice serving shard `shard` holds (`served.Slice.name`)."""
        return f"{shard}/{self.count}"

    async def lookup(self, shard: int, request: pb.ServingRowsRequest) -> pb.ServingRowsResponse:
        stubs = self._stubs[shard]
        first = self._turn[shard] = (self._turn[shard] + 1) % len(stubs)
        failures = []
        for i in range(len(stubs)):
            replica = (first + i) % len(stubs)
            try:
                return await stubs[replica].Lookup(request, timeout=CALL_TIMEOUT_S)
            except grpc.aio.AioRpcError as err:
                if err.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise ShardUnavailable(f"serving shard {shard}: {err.code().name}: {err.details()}") from None
                failures.append(f"{self.addresses[shard][replica]}: {err.code().name}: {err.details()}")
        raise ShardUnavailable(f"serving shard {shard} does not answer ({'; '.join(failures)})")

    async def behind(self, model: str, version: int) -> dict[int, str]:
        """The shards not serving `model` at `version` (whose replica asked does not), and why;
        empty when every shard is at it."""

        async def at(shard: int) -> str | None:
            request = pb.ServingRowsRequest(model=model, version=version, wait_ms=0, slice=self.slice_name(shard))
            try:
                answered = (await self.lookup(shard, request)).version
            except ShardUnavailable as err:
                return str(err)
            return None if answered == version else f"serving shard {shard} serves version {answered}"

        whys = await asyncio.gather(*(at(shard) for shard in range(self.count)))
        return {shard: why for shard, why in enumerate(whys) if why is not None}

    async def close(self) -> None:
        for channels in self._channels:
            for channel in channels:
                await channel.close()


@dataclass(frozen=True)
class _Asked:
    """What one serving shard is asked for: per table, its range of the plan's IDs."""

    shard: int
    ranges: dict[str, slice]


class FrontendModel:
    """The networks of a model's newest two versions, run over rows from the serving shards."""

    def __init__(self, store: ModelStore, first: VersionManifest, clients: ShardClients) -> None:
        config = first.config
        self.store = store
        self.name = first.model
        self.config = config
        self.clients = clients
        self.layout = pooling.Layout(config.slots, config.tables, clients.count)  # IDs grouped by serving shard
        self.dims = {name: t.dim for name, t in config.tables.items()}
        self.bf16 = config.training.precision == "bf16"
        self._versions: dict[int, HeldVersion] = {}
        self._version = 0
        self._lock = threading.Lock()  # one applier at a time
        self._loop = asyncio.get_running_loop()  # made on the follower's loop; applied on a thread
        self._applied = asyncio.Event()  # set (and replaced) when a version is applied

    @property
    def version(self) -> int:
        return self._version

    @property
    def manifest(self) -> VersionManifest | None:
        held = self._versions.get(self._version)
        return held.manifest if held is not None else None

    def memory_bytes(self) -> int:
        return 0  # the rows are the shards'

    def table_stats(self) -> dict[str, dict[str, int]]:
        return {}  # each shard's model view has its own

    def fits(self, manifest: VersionManifest) -> bool:
        """Any version of the same tables: a frontend holds no rows to build on, and groups IDs by
        serving shard, whatever the training shards."""
        return manifest.config.tables == self.config.tables

    def apply(self, manifest: VersionManifest) -> float:
        """Load a version's network (blocking: a worker thread's); returns the seconds it took."""
        started = time.monotonic()
        with self._lock:
            module, encoder = load_dense(self.store.parts(manifest.parts), manifest)
            self._versions[manifest.version] = HeldVersion(manifest, module, encoder)
            self._version = manifest.version
            for old in sorted(self._versions)[:-2]:
                del self._versions[old]
        self._loop.call_soon_threadsafe(self._announce)
        return time.monotonic() - started

    def _announce(self) -> None:
        applied, self._applied = self._applied, asyncio.Event()
        applied.set()

    async def _reach(self, version: int) -> HeldVersion | None:
        """This frontend's network of `version` once loaded (within WAIT_MS), or None."""
        deadline = self._loop.time() + WAIT_MS / 1000
        while (held := self._versions.get(version)) is None and self._version < version:
            try:
                await asyncio.wait_for(self._applied.wait(), max(deadline - self._loop.time(), 0))
            except TimeoutError:
                return None
        return held

    async def predict(self, instances: Sequence[Any], *, inline: bool) -> Prediction:
        """Probabilities of the instances at one version, from every shard's rows of it."""
        version = self._versions.get(self._version)
        for _ in range(RETRIES):
            if version is None:
                break
            at = version.manifest.version
            batch = version.encoder.batch(instances)
            plan = pooling.plan(self.layout, batch.ids)
            asked = self._asks(plan)
            answers = await asyncio.gather(*(self._lookup(a, plan, at) for a in asked))
            read = {answer.version for answer in answers}
            if read <= {at}:
                break
            newest = max(read)
            if newest < at:
                behind = [a.shard for a, answer in zip(asked, answers, strict=True) if answer.version < at]
                raise ShardUnavailable(
                    f"serving shard {behind[0]} serves version {newest} of {self.name}, behind {at}: its copy "
                    "of the version is late or refused (its model view says which)"
                )
            version = await self._reach(newest)
        else:
            raise VersionChurn(f"{self.name}: versions changed under {RETRIES} tries of one request")
        if version is None:
            raise VersionChurn(f"{self.name}: a serving shard is at a version this frontend has not loaded yet")
        rows, misses = self._rows(plan, asked, answers)
        pooled = pooling.pool(plan, rows)
        dense = np.array(batch.dense, dtype=np.float32)
        forward = (dense, [values for values, _ in pooled.slots()], self.bf16)
        answers = version.answers(*forward) if inline else await asyncio.to_thread(version.answers, *forward)
        return Prediction(answers, at, misses, version.tasks)

    def _asks(self, plan: pooling.BatchPlan) -> list[_Asked]:
        """The serving shards holding some of the plan's IDs, and which of them each holds."""
        asked = []
        for shard in range(self.clients.count):
            ranges = {table: p.shard_rows[shard] for table, p in plan.tables.items()}
            ranges = {table: r for table, r in ranges.items() if r.stop > r.start}
            if ranges:
                asked.append(_Asked(shard, ranges))
        return asked

    async def _lookup(self, asked: _Asked, plan: pooling.BatchPlan, version: int) -> pb.ServingRowsResponse:
        tables = [
            pb.ServingTableIds(table=table, ids=codec.pack_array(plan.tables[table].ids[r]))
            for table, r in asked.ranges.items()
        ]
        request = pb.ServingRowsRequest(
            model=self.name,
            version=version,
            wait_ms=WAIT_MS,
            tables=tables,
            slice=self.clients.slice_name(asked.shard),
        )
        return await self.clients.lookup(asked.shard, request)

    def _rows(
        self, plan: pooling.BatchPlan, asked: list[_Asked], answers: Sequence[pb.ServingRowsResponse]
    ) -> tuple[dict[str, np.ndarray], dict[str, int]]:
        """Each table's rows in the plan's order, put together from the shards' answers."""
        rows = {t: np.zeros((len(p.ids), self.dims[t]), np.float32) for t, p in plan.tables.items()}
        misses = dict.fromkeys(plan.tables, 0)
        for a, answer in zip(asked, answers, strict=True):
            if len(answer.tables) != len(a.ranges):
                raise ShardUnavailable(
                    f"serving shard {a.shard} answered {len(answer.tables)} of {len(a.ranges)} tables"
                )
            for (table, r), got in zip(a.ranges.items(), answer.tables, strict=True):
                values = codec.unpack_array(got.rows)
                wanted = (r.stop - r.start, self.dims[table])
                if values.shape != wanted or values.dtype != np.float32:
                    raise ShardUnavailable(
                        f"serving shard {a.shard} answered {table} as {values.dtype}{list(values.shape)}, "
                        f"not float32{list(wanted)}"
                    )
                rows[table][r] = values
                misses[table] += got.misses
        return rows, misses
