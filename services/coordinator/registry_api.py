"""The coordinator's routes for its workers under /v1/workers: registration and heartbeats (the
services' token, trillium.scopes), and the list and removal of workers (an operator's too)."""

from __future__ import annotations

import hashlib
import json
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request, status
from fastapi.responses import Response
from pydantic import AfterValidator, BaseModel, Field

from trillium.job.record import JobRecord

from .bodies import bounded, errors
from .parts import CoordinatorParts as Coordinator
from .registry import ElsewhereRegistered, Replaced, Worker, WorkerRegistration, check_caller


class HeartbeatRequest(BaseModel):
    health: Annotated[dict[str, Any], AfterValidator(bounded)] = {}
    job_digest: str | None = Field(
        None, max_length=64, description="the job_digest of the last answer whose job the worker holds"
    )


class HeartbeatResponse(BaseModel):
    worker: Worker
    job: JobRecord | None = Field(
        description="the current job, how the coordinator hands out work; null when there is "
        "none, and when it is the record the heartbeat's job_digest names (unchanged)"
    )
    job_digest: str | None = Field(description="names the current job's record as it stands; null: no job")


def record_digest(record: str) -> str:
    """Names a job record's JSON: a worker that holds this record is not sent it again (every
    worker would otherwise parse the record it holds, 18 KB for a 26-table job, at every
    heartbeat, and the coordinator serialize it)."""
    return hashlib.blake2b(record.encode(), digest_size=16).hexdigest()


def add_registry_routes(app: FastAPI, coord: Coordinator) -> None:
    services = APIRouter(prefix="/v1", dependencies=[Depends(coord.requires("services"))], responses=errors(401, 413))
    either = APIRouter(
        prefix="/v1", dependencies=[Depends(coord.requires("services", "operate"))], responses=errors(401, 413)
    )

    @services.post("/workers", response_model=Worker, tags=["workers"], responses=errors(403, 409))
    async def register_worker(reg: WorkerRegistration, request: Request) -> Worker:
        """Register a service instance (services do this themselves at start). 403: the registration
        names a host the call did not come from. 409: the name is held by a process on another host
        that is still heard from (this one was replaced: it exits)."""
        try:
            await check_caller(reg, request.client.host if request.client is not None else None)
            return await coord.registry.register(reg)
        except ElsewhereRegistered as err:
            raise HTTPException(status.HTTP_403_FORBIDDEN, str(err)) from None
        except Replaced as err:
            raise HTTPException(status.HTTP_409_CONFLICT, str(err)) from None

    @services.post(
        "/workers/{name}/heartbeat", response_model=HeartbeatResponse, tags=["workers"], responses=errors(404)
    )
    async def heartbeat(name: str, body: HeartbeatRequest) -> Response:
        """A worker's heartbeat with its health; the answer carries the current job."""
        worker = await coord.registry.heartbeat(name, body.health)
        if worker is None:
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"worker {name!r} is not registered by this process")
        # Built from the record as stored, neither parsed nor validated on the way out: every
        # worker, every second.
        record = await coord.jobs.current_json()
        digest = record_digest(record) if record is not None else None
        job = record if record is not None and digest != body.job_digest else "null"
        answer = f'{{"worker":{worker.model_dump_json()},"job":{job},"job_digest":{json.dumps(digest)}}}'
        return Response(answer, media_type="application/json")

    @either.get("/workers", response_model=list[Worker], tags=["workers"])
    async def list_workers() -> list[Worker]:
        """Every registered instance: role, index (NN rank or PS shard), addresses, last
        heartbeat, health, and status (`lost` after 5 missed heartbeats: 10 s by default)."""
        return await coord.registry.workers()

    @either.delete("/workers/{name}", status_code=status.HTTP_204_NO_CONTENT, tags=["workers"], responses=errors(404))
    async def deregister(name: str) -> None:
        """Forget a worker (it registers again with its next heartbeat if it still runs)."""
        if not await coord.registry.deregister(name):
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"worker {name!r} is not registered")

    app.include_router(services)
    app.include_router(either)
