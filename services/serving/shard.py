"""A serving shard (`python -m trillium.services.serving.shard`, `TRILLIUM_SERVING_SHARD=INDEX/COUNT`):
one slice of every table of the stack's models, values only (the rows whose ID's hash places them
on shard INDEX of COUNT, `served.Slice`), answering the lookups of sharded serving's frontends
(sharded.py) at the version each names (gRPC `ServingShard/Lookup`).

It finds and follows the models as a replica does (server.py: the registry, the model topic, the
store; a shard that restarts loads the newest version and goes on from there), reading only the
values files of the training shards that can hold its rows, and no network. A lookup for a version it has not applied yet
waits for it, up to the call's `wait_ms`; the answer says the version read, whichever it is.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np
from fastapi import HTTPException, status

from trillium.runtime.model_store import ModelStore, VersionManifest
from trillium.runtime.process import run_service
from trillium.wire import codec
from trillium.wire.pb import serving_pb2 as pb
from trillium.wire.pb import serving_pb2_grpc as pb_grpc

from .api import PredictResponse
from .follower import ModelFollower
from .served import ServedModel, Slice
from .server import ServingReplica


class _Servicer(pb_grpc.ServingShardServicer):
    def __init__(self, shard: ServingShard) -> None:
        self.shard = shard

    async def Lookup(self, request: pb.ServingRowsRequest, context: grpc.aio.ServicerContext) -> pb.ServingRowsResponse:
        if request.slice != self.shard.slice.name:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this serving shard holds slice {self.shard.slice.name}, asked for {request.slice or 'none'}: "
                "the frontend's TRILLIUM_SERVING_SHARDS and the shards' TRILLIUM_SERVING_SHARD disagree",
            )
        follower = self.shard.followers.get(request.model)
        if follower is None:  # not found in the registry yet (a frontend asks for the models it found there)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"model {request.model!r} not loaded on this shard yet")
        served = await self.shard.at_least(follower, request.version, request.wait_ms / 1000)
        if served is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"no version loaded: {follower.state.error}")
        try:
            asked = [(t.table, _ids(t.table, t.ids)) for t in request.tables]
            rows, read_at, misses = served.tables.lookup(asked)
        except (ValueError, KeyError, codec.CodecError) as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        return pb.ServingRowsResponse(
            version=read_at,
            tables=[pb.ServingTableRows(rows=codec.pack_array(r), misses=m) for r, m in zip(rows, misses, strict=True)],
        )


def _ids(table: str, data: bytes) -> np.ndarray:
    ids = codec.unpack_array(data)
    if ids.dtype != np.uint64 or ids.ndim != 1:
        raise ValueError(f"ids of {table}: expected uint64[n], got {ids.dtype}{list(ids.shape)}")
    return ids


class ServingShard(ServingReplica):
    role = "serving_shard"

    def __init__(self, settings) -> None:
        super().__init__(settings)
        index, count = (int(x) for x in settings.serving_shard.split("/"))  # validated: a shard has its place
        self.slice = Slice(index, count)
        self._applied: dict[str, asyncio.Event] = {}  # per model, set (and replaced) when a version serves

    def register(self, server: grpc.aio.Server) -> None:
        pb_grpc.add_ServingShardServicer_to_server(_Servicer(self), server)

    def holding(self, store: ModelStore) -> tuple[Callable[[VersionManifest], Any], Slice | None]:
        threads = self.settings.threads
        return lambda first: ServedModel(store, first, threads, rows=self.slice, dense=False), self.slice

    def _changed(self, follower: ModelFollower, manifest: VersionManifest | None, seconds: float) -> None:
        super()._changed(follower, manifest, seconds)
        if manifest is not None and (applied := self._applied.pop(follower.name, None)) is not None:
            applied.set()

    async def at_least(self, follower: ModelFollower, version: int, wait_s: float) -> ServedModel | None:
        """The model served once it is at `version` or a newer one, or after `wait_s` whatever it
        is at (None: none loaded)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while (served := follower.served) is None or served.version < version:
            applied = self._applied.setdefault(follower.name, asyncio.Event())
            try:
                await asyncio.wait_for(applied.wait(), deadline - loop.time())
            except TimeoutError:
                break
        return follower.served

    async def predict_async(self, model: str, instances: list[Any], protocol: str) -> PredictResponse:
        raise HTTPException(
            status.HTTP_404_NOT_FOUND,
            "a serving shard answers its frontends' lookups (gRPC ServingShard/Lookup); ask a frontend for predictions",
        )


def main() -> None:
    run_service(ServingShard)


if __name__ == "__main__":
    main()
