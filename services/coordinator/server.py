"""The coordinator service: job control, the worker registry, staleness tracking and
checkpoints, behind a token-protected REST API under /v1 (see api.py). Its state lives in
Redis (and checkpoints in their storage), so a restarted coordinator carries on where the
last one stopped."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

import httpx
from fastapi import FastAPI

from trillium.runtime.limits import BodyLimit
from trillium.runtime.process import run_service
from trillium.runtime.service import Service
from trillium.wire import state

from .api import add_api
from .bound import choose_live_bound
from .checkpoints import Checkpointer
from .forget import Forgetter
from .jobs import JobStore
from .lifecycle import advance
from .observe import Observer
from .publish import Publisher
from .registry import WorkerRegistry
from .retention import TopicRetention

logger = logging.getLogger("trillium.coordinator")

JOB_TICK_S = 0.2
OBSERVE_TICK_S = 1.0


class Coordinator(Service):
    role = "coordinator"
    lean_malloc = True  # its large buffers (states, checkpoint files) come and go: give them back

    def add_routes(self, app: FastAPI) -> None:
        app.description = (
            "Job control, live state and metrics of a Trillium stack. Every /v1 route needs "
            "`Authorization: Bearer <token>`; /healthz and /readyz (up, ready: nothing more) do not."
        )
        app.add_middleware(BodyLimit)
        add_api(app, self)

    async def _every(self, period_s: float, what: str, tick: Callable[[], Awaitable[None]]) -> None:
        while True:
            try:
                await tick()
            except Exception:
                logger.exception(f"{what} tick failed")
            await asyncio.sleep(period_s)

    async def start(self) -> None:
        await state.wait_for_redis(self.settings.redis_url)
        self.redis = state.connect(self.settings.redis_url)
        self.registry = WorkerRegistry(self.redis, self.settings.heartbeat_s)
        self.jobs = JobStore(self.redis, self.settings.shared_root, self.settings.kafka)
        self.retention = TopicRetention(self.settings.kafka)
        calls = self.settings.http_client
        self.checkpointer = Checkpointer(
            self.redis, self.registry, self.jobs, self.retention, calls(httpx.Timeout(300.0, connect=5.0))
        )
        self.publisher = Publisher(
            self.jobs,
            self.registry,
            self.settings.kafka,
            self.settings.shared_root,
            calls(httpx.Timeout(60.0, connect=5.0)),
        )
        self.forgetter = Forgetter(
            self.jobs,
            self.registry,
            self.settings.kafka,
            self.settings.shared_root,
            calls(httpx.Timeout(300.0, connect=5.0)),
        )
        self.observer = Observer(self.redis, self.registry, self.settings.kafka, self.settings.grpc, OBSERVE_TICK_S)
        self._loops = [
            asyncio.create_task(self.registry.listen(), name="registry listening"),
            asyncio.create_task(self._every(JOB_TICK_S, "job state machine", self._advance)),
            asyncio.create_task(self._every(OBSERVE_TICK_S, "observer", self._observe)),
            asyncio.create_task(self.forgetter.resume_interrupted(), name="forgets left undone"),
        ]

    async def _advance(self) -> None:
        job = await self.jobs.current()
        await self.publisher.tick(job)  # before the state machine: a cut reported with the results is seen
        await advance(self.jobs, self.registry, self._writing)
        # One read for both: the checkpointer acts on a running or paused job, retention on a
        # finished one, so neither's change can alter what the other does with it.
        job = await self.jobs.current()
        await choose_live_bound(self.redis, job)
        await self.checkpointer.tick(job)
        await self.retention.tick(self.jobs, self.registry, job)

    def _writing(self, job, results: dict[int, dict]) -> bool:
        """A job finishes once its last checkpoint and its last model version are written."""
        return self.checkpointer.busy(job.id) or not self.publisher.final_done(job, results)

    async def _observe(self) -> None:
        await self.observer.tick(await self.jobs.current())

    async def stop(self) -> None:
        for task in getattr(self, "_loops", []):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if hasattr(self, "observer"):
            await self.observer.close()
            await self.checkpointer.close()
            await self.publisher.close()
            await self.forgetter.close()
            await self.retention.close()
        if hasattr(self, "redis"):
            await self.redis.aclose()


def main() -> None:
    run_service(Coordinator)
