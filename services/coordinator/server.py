"""The coordinator service: job control, the worker registry and staleness tracking,
behind a token-protected REST API under /v1."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, HTTPException, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel

from trillium import state
from trillium.job import JobConfig
from trillium.progress import JobProgress
from trillium.service import Service, run_service

from trillium.job import IllegalTransition, JobRecord

from .jobs import JobStore, advance
from .registry import Worker, WorkerRegistration, WorkerRegistry

logger = logging.getLogger("trillium.coordinator")
_bearer = HTTPBearer(auto_error=False)


class HeartbeatRequest(BaseModel):
    health: dict[str, Any] = {}


class HeartbeatResponse(BaseModel):
    worker: Worker
    job: JobRecord | None  # the current job: how the coordinator hands out work


class JobProgressView(BaseModel):
    samples: int
    steps: int
    epoch: int
    samples_per_sec: float
    mean_loss: float | None
    last_loss: float | None


class StalenessView(BaseModel):
    bound: int | None
    max: int
    mean: float
    count: int
    histogram: list[int]


class JobView(BaseModel):
    job: JobRecord
    progress: JobProgressView
    staleness: dict[int, StalenessView]
    results: dict[int, dict[str, Any]]  # per NN rank, once it is done: samples, steps, loss curve, eval


class Coordinator(Service):
    role = "coordinator"

    def add_routes(self, app: FastAPI) -> None:
        token = self.settings.token

        def require_token(creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> None:
            # Constant-time comparison: response timing must not leak the token.
            if creds is None or not secrets.compare_digest(creds.credentials.encode(), token.encode()):
                raise HTTPException(status.HTTP_401_UNAUTHORIZED, "missing or invalid bearer token",
                                    headers={"WWW-Authenticate": "Bearer"})

        v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_token)])

        @v1.post("/workers", response_model=Worker, tags=["workers"])
        async def register_worker(reg: WorkerRegistration) -> Worker:
            return await self.registry.register(reg)

        @v1.post("/workers/{name}/heartbeat", response_model=HeartbeatResponse, tags=["workers"])
        async def heartbeat(name: str, body: HeartbeatRequest) -> HeartbeatResponse:
            worker = await self.registry.heartbeat(name, body.health)
            if worker is None:
                raise HTTPException(status.HTTP_404_NOT_FOUND, f"worker {name!r} is not registered")
            return HeartbeatResponse(worker=worker, job=await self.jobs.current())

        @v1.get("/workers", response_model=list[Worker], tags=["workers"])
        async def list_workers() -> list[Worker]:
            return await self.registry.workers()

        @v1.delete("/workers/{name}", status_code=status.HTTP_204_NO_CONTENT, tags=["workers"])
        async def deregister(name: str) -> None:
            if not await self.registry.deregister(name):
                raise HTTPException(status.HTTP_404_NOT_FOUND, f"worker {name!r} is not registered")

        @v1.post("/jobs", response_model=JobRecord, status_code=status.HTTP_201_CREATED, tags=["jobs"])
        async def submit_job(config: JobConfig) -> JobRecord:
            try:
                return await self.jobs.create(config)
            except IllegalTransition as err:
                raise HTTPException(status.HTTP_409_CONFLICT, str(err)) from None

        @v1.get("/jobs", response_model=list[JobRecord], tags=["jobs"])
        async def list_jobs() -> list[JobRecord]:
            return await self.jobs.all()

        @v1.get("/jobs/{job_id}", response_model=JobView, tags=["jobs"])
        async def get_job(job_id: str) -> JobView:
            job = await self.jobs.get(job_id)
            if job is None:
                raise HTTPException(status.HTTP_404_NOT_FOUND, f"no job {job_id!r}")
            return await self.job_view(job)

        app.include_router(v1)

    async def job_view(self, job: JobRecord) -> JobView:
        progress = JobProgress(self.redis, job.id)
        ranks = job.config.topology.nn_ranks
        training = await progress.training(ranks)
        end = job.finished_at or time.time()
        elapsed = end - job.started_at if job.started_at else 0.0
        nan_to_none = lambda x: None if x != x else x  # noqa: E731 (JSON has no NaN)
        return JobView(
            job=job,
            progress=JobProgressView(samples=training["samples"], steps=training["steps"], epoch=training["epoch"],
                                     samples_per_sec=training["samples"] / elapsed if elapsed > 0 else 0.0,
                                     mean_loss=nan_to_none(training["mean_loss"]),
                                     last_loss=nan_to_none(training["last_loss"])),
            staleness={r: StalenessView(**s.as_dict()) for r, s in (await progress.staleness(ranks)).items()},
            results=await progress.rank_results())

    async def _job_loop(self) -> None:
        while True:
            try:
                await advance(self.jobs, self.registry, self.settings.kafka_bootstrap)
            except Exception:
                logger.exception("job state machine tick failed")
            await asyncio.sleep(0.2)

    async def start(self) -> None:
        await state.wait_for_redis(self.settings.redis_url)
        self.redis = state.connect(self.settings.redis_url)
        self.registry = WorkerRegistry(self.redis, self.settings.heartbeat_s)
        self.jobs = JobStore(self.redis)
        self._loop_task = asyncio.create_task(self._job_loop())

    async def stop(self) -> None:
        if hasattr(self, "_loop_task"):
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        if hasattr(self, "redis"):
            await self.redis.aclose()


def main() -> None:
    run_service(Coordinator)
