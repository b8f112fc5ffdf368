"""The serving service: a replica that answers predictions from the models the stack's jobs publish,
and follows each to its newest version within seconds of its commit.

Models are found in the stack's model registry (Redis, written by the coordinator when it commits
a version: `trillium.runtime.model_registry`); a replica started for one model (`trillium serve MODEL`,
`TRILLIUM_SERVING_MODEL`) serves that one only, pinned to `TRILLIUM_SERVING_VERSION` if set. Each
model has a follower (follower.py) that keeps a `ServedModel` (served.py) at its newest version.
Requests come over REST (api.py) and gRPC (`Predict`, proto/serving.proto), both behind the
stack's token; both run the same `predict`. With `TRILLIUM_SERVING_SHARDS` the replica is a frontend
of sharded serving: it holds the models' networks only, and asks serving shards (shard.py) for the
rows (sharded.py).

The replica is ready (`/readyz`, a Kubernetes readiness probe) once every model the registry
names has tried its first load, however long a large model takes: a replica never takes traffic
it would answer with 503s.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import torch
from fastapi import Depends, FastAPI, HTTPException, status
from prometheus_client import Counter, Gauge, Histogram

from trillium.data.instances import BadInstance
from trillium.data.requests import TooManyInstances, decode_instances
from trillium.runtime.limits import BodyLimit
from trillium.runtime.model_registry import BadRegistryEntry, ModelRegistry, RegisteredModel
from trillium.runtime.model_store import ModelStore, VersionManifest
from trillium.runtime.process import run_service
from trillium.runtime.service import Service
from trillium.wire import rpc, state
from trillium.wire.pb import serving_pb2 as pb
from trillium.wire.pb import serving_pb2_grpc as pb_grpc

from .api import PredictResponse, bad_instance, control, router
from .follower import ModelFollower
from .served import WHOLE, Prediction, ServedModel, Slice, VersionChurn
from .sharded import FrontendModel, ShardClients, ShardUnavailable

logger = logging.getLogger("trillium.serving")

PREDICT_ENVELOPE_BYTES = 64 << 10  # a gRPC PredictRequest's model name and format beside its instances
INLINE_INSTANCES = 8  # requests up to this many instances are answered on the event loop
DISCOVER_S = 1.0  # how often the model registry is read for models new to the replica
SHARDS_WATCH_S = 1.0  # how often a frontend asks its serving shards their versions (its readiness)
SHARDS_BEHIND_S = 3.0  # ... and how long one may lag the frontend's version before it is not ready
LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

REQUESTS = Counter("trillium_serving_requests_total", "prediction requests", ["model", "protocol", "code"])
LATENCY = Histogram(
    "trillium_serving_request_seconds", "prediction latency", ["model", "protocol"], buckets=LATENCY_BUCKETS
)
INSTANCES = Counter("trillium_serving_instances_total", "instances predicted", ["model"])
UNSEEN = Counter(
    "trillium_serving_unseen_ids_total", "IDs the model has never trained (read as zeros)", ["model", "table"]
)
VERSION = Gauge("trillium_serving_model_version", "the version served", ["model"])
FRESHNESS = Gauge("trillium_serving_freshness_lag_seconds", "now less the newest event time trained", ["model"])
LOW_WATERMARK_LAG = Gauge(
    "trillium_serving_low_watermark_lag_seconds", "now less the time before which every event is trained", ["model"]
)
REFUSED = Counter("trillium_serving_versions_refused_total", "versions refused (checksum, consistency)", ["model"])
APPLY = Histogram("trillium_serving_version_apply_seconds", "time to apply a version", ["model"])


class _Servicer(pb_grpc.ServingServicer):
    def __init__(self, replica: ServingReplica) -> None:
        self.replica = replica

    async def Predict(self, request: pb.PredictRequest, context: grpc.aio.ServicerContext) -> pb.PredictResponse:
        try:
            instances = decode_instances(request.instances, request.format, self.replica.max_batch)
        except TooManyInstances as err:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(err))
        except ValueError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        try:
            answer = await self.replica.predict_async(request.model, instances, "grpc")
        except HTTPException as err:
            await context.abort(_GRPC_CODES.get(err.status_code, grpc.StatusCode.INTERNAL), _detail(err.detail))
        predictions, tasks = answer.predictions, answer.tasks or []
        if tasks:  # a multi-task model's: each instance's values in task order, in turn
            predictions = [row[task] for row in predictions for task in tasks]  # type: ignore[index]
        return pb.PredictResponse(predictions=predictions, model=answer.model, version=answer.version, tasks=tasks)


_GRPC_CODES = {
    404: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    422: grpc.StatusCode.INVALID_ARGUMENT,
    503: grpc.StatusCode.UNAVAILABLE,
}


def _detail(detail: Any) -> str:
    if isinstance(detail, list):
        return "; ".join(str(d.get("msg", d)) if isinstance(d, dict) else str(d) for d in detail)
    return str(detail)


class ServingReplica(Service):
    role = "serving"
    registers = False  # a replica takes part in no job; clients and `trillium status` find it

    def __init__(self, settings) -> None:
        super().__init__(settings)
        # A replica answers small batches on few cores: torch's pool would only spin.
        torch.set_num_threads(self.settings.threads or 1)
        self.followers: dict[str, ModelFollower] = {}
        self.max_batch = self.settings.serving_max_batch
        self._first_load = asyncio.Event()
        # A frontend of sharded serving: the rows are its serving shards' (sharded.py).
        self.clients: ShardClients | None = None
        self.shards_behind: list[str] = []  # the shards not at the version served, while any is not
        self._shards_watch: asyncio.Task[None] | None = None

    def add_routes(self, app: FastAPI) -> None:
        app.description = (
            "Predictions from the models a Trillium stack trains. Every /v1 route needs "
            "`Authorization: Bearer <token>`: a prediction client's or an operator's, and an operator's "
            "to roll back or unpin; /healthz and /readyz (up, ready: nothing more) need none."
        )
        app.add_middleware(BodyLimit, limit=self.settings.serving_max_body_bytes)
        app.state.replica = self
        app.include_router(router, dependencies=[Depends(self.requires("predict"))])
        app.include_router(control, dependencies=[Depends(self.requires("operate"))])

    async def start(self) -> None:
        self.redis = state.connect(self.settings.redis_url)
        if self.settings.serving_shard_addresses:
            self.clients = ShardClients(self.settings.serving_shard_addresses, self.settings.grpc)
        self.grpc_server = await rpc.serve(
            self.settings.host,
            self.settings.grpc_port,
            self.settings.grpc,
            self.register,
            self.settings.keys,
            # A prediction's message is its body: what REST takes, and room for the envelope.
            max_receive_bytes=self.settings.serving_max_body_bytes + PREDICT_ENVELOPE_BYTES,
        )
        self._discovery = asyncio.create_task(self._discover(), name="model discovery")
        if self.clients is not None:
            self._shards_watch = asyncio.create_task(self._watch_shards(self.clients), name="serving shards")

    def accepts_traffic(self) -> bool:
        """Ready once every model known at the start has tried its first load (`_discover`); a
        frontend, once every serving shard serves the version it runs, of every model."""
        return self._first_load.is_set() and not self.shards_behind

    async def _watch_shards(self, clients: ShardClients) -> None:
        """Whether every serving shard is at the version this frontend runs (`shards_behind`, for
        readiness), every SHARDS_WATCH_S. A shard counts as behind once it has been for
        SHARDS_BEHIND_S: while a version is applied, the frontend and the shards reach it a moment
        apart, and a request meanwhile waits for them rather than fails."""
        since: dict[tuple[str, int], float] = {}  # (model, shard) -> when it was first seen behind
        loop = asyncio.get_running_loop()
        while True:
            behind, now = [], loop.time()
            seen = set()
            for name, follower in list(self.followers.items()):
                if follower.served is None:
                    continue
                for shard, why in (await clients.behind(name, follower.served.version)).items():
                    seen.add((name, shard))
                    if now - since.setdefault((name, shard), now) >= SHARDS_BEHIND_S:
                        behind.append(f"{name}: {why}")
            for caught_up in set(since) - seen:
                del since[caught_up]
            if behind != self.shards_behind:
                logger.info("serving shards", extra={"behind": behind} if behind else {"behind": "none"})
            self.shards_behind = behind
            await asyncio.sleep(SHARDS_WATCH_S)

    async def stop(self) -> None:
        for task in (self._discovery, self._shards_watch):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        for follower in self.followers.values():
            await follower.stop()
        await self.grpc_server.stop(grace=2)
        if self.clients is not None:
            await self.clients.close()
        await self.redis.aclose()

    def register(self, server: grpc.aio.Server) -> None:
        """The gRPC services this process answers."""
        pb_grpc.add_ServingServicer_to_server(_Servicer(self), server)

    def health(self) -> dict[str, Any]:
        models = {name: f.served.version if f.served else None for name, f in self.followers.items()}
        return {"models": models} | ({"shards_behind": self.shards_behind} if self.clients is not None else {})

    # ---- models ------------------------------------------------------------------------------
    async def _discover(self) -> None:
        only = self.settings.serving_model
        while True:
            try:
                registry = await ModelRegistry(self.redis).models()
                for name, entry in registry.items():
                    if name in self.followers or (only is not None and name != only):
                        continue
                    if isinstance(entry, BadRegistryEntry):
                        logger.warning("model registry entry skipped", extra={"model": name, "error": str(entry)})
                    else:
                        await self._follow(entry)
                loading = [f.loaded.wait() for f in self.followers.values()]
                if only is not None and only not in registry:
                    logger.warning("model not published yet", extra={"model": only})
                await asyncio.gather(*loading)
                if not self._first_load.is_set():
                    # What start-up made (torch, the models) lives on: out of the collector's sight,
                    # so a full collection does not walk it in the middle of a request.
                    gc.freeze()
                    self._first_load.set()
            except Exception as err:  # noqa: BLE001 (Redis away: the models served go on)
                logger.warning("model registry unavailable", extra={"error": str(err)})
            await asyncio.sleep(DISCOVER_S)

    def holding(self, store: ModelStore) -> tuple[Callable[[VersionManifest], Any], Slice | None]:
        """How this process holds a model: what makes one from a chain's first version, and the rows
        of its tables it holds (a replica, all; a frontend, none)."""
        if self.clients is not None:
            clients = self.clients
            return lambda first: FrontendModel(store, first, clients), None
        return lambda first: ServedModel(store, first, self.settings.threads), WHOLE

    async def _follow(self, entry: RegisteredModel) -> None:
        name = entry.model
        cap = self.settings.serving_memory_gb
        store = ModelStore(entry.dir, name)
        make, rows = self.holding(store)
        follower = ModelFollower(
            store,
            entry.topic,
            self.settings.kafka,
            make,
            rows=rows,
            memory_cap=None if cap is None else int(cap * 1e9),
        )
        self.followers[name] = follower
        follower.start(self._changed)
        if self.settings.serving_version is not None and name == self.settings.serving_model:
            await follower.loaded.wait()
            await follower.pin(self.settings.serving_version)
        logger.info("following model", extra={"model": name, "dir": entry.dir})

    def _changed(self, follower: ModelFollower, manifest: VersionManifest | None, seconds: float) -> None:
        if manifest is None:
            REFUSED.labels(follower.name).inc()
            return
        VERSION.labels(follower.name).set(manifest.version)
        APPLY.labels(follower.name).observe(seconds)
        if manifest.event_time is not None:
            FRESHNESS.labels(follower.name).set_function(lambda at=manifest.event_time: time.time() - at)
        if manifest.low_watermark is not None:
            LOW_WATERMARK_LAG.labels(follower.name).set_function(lambda at=manifest.low_watermark: time.time() - at)

    # ---- predictions -------------------------------------------------------------------------
    async def predict_async(self, model: str, instances: list[Any], protocol: str) -> PredictResponse:
        """A few instances are answered on the event loop (a hop to a thread would cost about what
        they do: 0.1-0.5 ms); more, on a thread, so that one large request does not hold the loop
        up for the requests behind it. A frontend awaits its shards' rows on the loop, and runs its
        network on a thread for more."""
        inline = len(instances) <= INLINE_INSTANCES
        if self.clients is None:
            if inline:
                return self.predict(model, instances, protocol)
            return await asyncio.to_thread(self.predict, model, instances, protocol)
        with self._answering(model, protocol):
            frontend = self._served(model, instances)
            return self._response(model, await frontend.predict(instances, inline=inline), len(instances))

    def predict(self, model: str, instances: list[Any], protocol: str) -> PredictResponse:
        """One request's predictions (on a worker thread); HTTPException says why not."""
        with self._answering(model, protocol):
            return self._response(model, self._served(model, instances).predict(instances), len(instances))

    @contextlib.contextmanager
    def _answering(self, model: str, protocol: str) -> Iterator[None]:
        """A request's metrics, and its errors as HTTP answers."""
        started = time.perf_counter()
        code = "200"
        label = model if model in self.followers else "_unknown"  # a client's names are no metric labels
        try:
            try:
                yield
            except BadInstance as err:
                raise bad_instance(err) from None
            except (VersionChurn, ShardUnavailable) as err:  # the caller's retry lands on a settled version
                raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, str(err)) from None
        except HTTPException as err:
            code = str(err.status_code)
            raise
        finally:
            REQUESTS.labels(label, protocol, code).inc()
            LATENCY.labels(label, protocol).observe(time.perf_counter() - started)

    def _served(self, model: str, instances: list[Any]) -> Any:
        """The model that answers a request (a ServedModel, a frontend's FrontendModel)."""
        follower = self.followers.get(model)
        if follower is None:
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"no model {model!r}; models: {sorted(self.followers)}")
        served = follower.served
        if served is None:
            raise HTTPException(
                status.HTTP_503_SERVICE_UNAVAILABLE, f"model {model!r} has no version loaded: {follower.state.error}"
            )
        if len(instances) > self.max_batch:
            raise HTTPException(
                status.HTTP_413_REQUEST_ENTITY_TOO_LARGE,
                f"{len(instances)} instances; at most {self.max_batch} a request",
            )
        return served

    def _response(self, model: str, prediction: Prediction, instances: int) -> PredictResponse:
        INSTANCES.labels(model).inc(instances)
        for table, misses in prediction.misses.items():
            if misses:
                UNSEEN.labels(model, table).inc(misses)
        answers, tasks = prediction.probabilities.tolist(), prediction.tasks
        if tasks is not None:
            answers = [dict(zip(tasks, row, strict=True)) for row in answers]
        return PredictResponse(predictions=answers, model=model, version=prediction.version, tasks=tasks)


def main() -> None:
    run_service(ServingReplica)
