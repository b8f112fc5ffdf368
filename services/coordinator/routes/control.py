"""A job's control: pause, resume, stop, and live resharding (reshard.py)."""

from __future__ import annotations

from fastapi import APIRouter, status

from trillium.job.record import IllegalTransition, JobRecord

from ..bodies import ReshardRequest, ResumeRequest, StopRequest
from ..parts import Coord
from ..reshard import request_reshard
from ..views import errors

router = APIRouter(tags=["job control"])


@router.post("/jobs/{job_id}/pause", response_model=JobRecord, responses=errors(404, 409))
async def pause_job(coord: Coord, job_id: str) -> JobRecord:
    """Pause a running job: the NN ranks stop before their next step (within a heartbeat)."""
    return await coord.jobs.transition(job_id, "paused", expect=frozenset({"running"}))


@router.post("/jobs/{job_id}/resume", response_model=JobRecord, responses=errors(404, 409))
async def resume_job(coord: Coord, job_id: str, body: ResumeRequest | None = None) -> JobRecord:
    """Resume a paused job; or a stopped or failed one from a checkpoint (the newest, or the
    one at `checkpoint`): a new attempt restores it and goes on (`recovering`, then `running`)."""
    job = await coord.jobs.require(job_id)
    if job.state in ("stopped", "failed"):
        return await coord.jobs.resume(job_id, body.checkpoint if body else None)
    if body is not None and body.checkpoint is not None:
        raise IllegalTransition(f"job {job_id} is {job.state}: only a stopped or failed job resumes from a checkpoint")
    return await coord.jobs.transition(job_id, "running", expect=frozenset({"paused"}))


@router.post(
    "/jobs/{job_id}/stop", response_model=JobRecord, status_code=status.HTTP_202_ACCEPTED, responses=errors(404, 409)
)
async def stop_job(coord: Coord, job_id: str, body: StopRequest | None = None) -> JobRecord:
    """Stop an active job: it is `stopping` until every worker has ended its part, then `stopped`.
    By default (`{"checkpoint": true}`) a running or paused job that takes checkpoints first takes
    a final one at the step it stops at, and goes `stopping` once it is written: `resume` goes on
    from there with nothing retrained. `{"checkpoint": false}` stops at once."""
    return await coord.jobs.request_stop(job_id, checkpoint=(body or StopRequest()).checkpoint)


@router.post(
    "/jobs/{job_id}/reshard",
    response_model=JobRecord,
    status_code=status.HTTP_202_ACCEPTED,
    responses=errors(404, 409),
)
async def reshard_job(coord: Coord, job_id: str, body: ReshardRequest) -> JobRecord:
    """Move a running job onto `ps_shards` PS shards, live: the ranks stop at a cut, a checkpoint is
    taken there, and a new attempt restores it resharded onto the new shards (`recovering`, then
    `running`), nothing trained twice or lost. The job's `reshards` says how it went. 409 when the
    job is not running, takes no checkpoints, is stopping or already resharding, already has that
    many shards, or the stack does not run embedding_ps-0..N-1."""
    return await request_reshard(coord.jobs, coord.registry, job_id, body.ps_shards)
