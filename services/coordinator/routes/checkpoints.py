"""A job's checkpoints: listed, asked for, deleted (checkpoints.py takes them)."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, status

from ..checkpoints import CheckpointInfo
from ..jobs import CheckpointRequested
from ..parts import Coord
from ..views import errors

router = APIRouter(tags=["checkpoints"])


@router.get("/jobs/{job_id}/checkpoints", response_model=list[CheckpointInfo], responses=errors(404))
async def list_checkpoints(coord: Coord, job_id: str) -> list[CheckpointInfo]:
    """A job's complete checkpoints, oldest first: step, epoch, size, seconds to write, how
    long training held for the cut, the Kafka positions, and test metrics when taken."""
    return await coord.checkpointer.list(await coord.jobs.require(job_id))


@router.post(
    "/jobs/{job_id}/checkpoints",
    response_model=CheckpointRequested,
    status_code=status.HTTP_202_ACCEPTED,
    responses=errors(404, 409),
)
async def request_checkpoint(coord: Coord, job_id: str) -> CheckpointRequested:
    """Ask for a checkpoint of a running or paused job: the NN ranks cut after the step on
    which they agree on it (within about a heartbeat); it is listed once its manifest is written."""
    return await coord.jobs.request_checkpoint(job_id)


@router.delete("/jobs/{job_id}/checkpoints/{step}", status_code=status.HTTP_204_NO_CONTENT, responses=errors(404, 409))
async def delete_checkpoint(coord: Coord, job_id: str, step: int) -> None:
    """Delete one checkpoint of a job (complete or not); 409 while another checkpoint's delta
    is loaded on top of it."""
    if not await coord.checkpointer.delete(await coord.jobs.require(job_id), step):
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"job {job_id} has no checkpoint at step {step}")
