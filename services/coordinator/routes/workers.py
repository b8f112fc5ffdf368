"""The workers' routes: registration and heartbeats (`router`, the services' token), and the list
and removal of workers (`either`: the services' token or an operator's; trillium.scopes)."""

from __future__ import annotations

import hashlib
import json

from fastapi import APIRouter, HTTPException, Request, status
from fastapi.responses import Response

from ..bodies import HeartbeatRequest
from ..parts import Coord
from ..registry import ElsewhereRegistered, Replaced, Worker, WorkerRegistration, check_caller
from ..views import HeartbeatResponse, errors

router = APIRouter(tags=["workers"])
either = APIRouter(tags=["workers"])


def record_digest(record: str) -> str:
    """Names a job record's JSON: a worker that holds this record is not sent it again (every
    worker would otherwise parse the record it holds, 18 KB for a 26-table job, at every
    heartbeat, and the coordinator serialize it)."""
    return hashlib.blake2b(record.encode(), digest_size=16).hexdigest()


@router.post("/workers", response_model=Worker, responses=errors(403, 409))
async def register_worker(coord: Coord, reg: WorkerRegistration, request: Request) -> Worker:
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


@router.post("/workers/{name}/heartbeat", response_model=HeartbeatResponse, responses=errors(404))
async def heartbeat(coord: Coord, name: str, body: HeartbeatRequest) -> Response:
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


@either.get("/workers", response_model=list[Worker])
async def list_workers(coord: Coord) -> list[Worker]:
    """Every registered instance: role, index (NN rank or PS shard), addresses, last
    heartbeat, health, and status (`lost` after 5 missed heartbeats: 10 s by default)."""
    return await coord.registry.workers()


@either.delete("/workers/{name}", status_code=status.HTTP_204_NO_CONTENT, responses=errors(404))
async def deregister(coord: Coord, name: str) -> None:
    """Forget a worker (it registers again with its next heartbeat if it still runs)."""
    if not await coord.registry.deregister(name):
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"worker {name!r} is not registered")
