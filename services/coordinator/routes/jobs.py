"""Jobs: submitted (as JSON or YAML), listed, viewed with their series, deleted."""

from __future__ import annotations

from fastapi import APIRouter, Depends, status
from fastapi.exceptions import RequestValidationError

from trillium.job import JobConfig
from trillium.job.record import JobRecord
from trillium.job.trust import PathRoots, check_model_module

from ..bodies import JobConfigBody, job_media_type
from ..job_view import job_series, job_view
from ..parts import Coord
from ..views import JobView, SeriesPoint, errors

router = APIRouter(tags=["jobs"])


@router.post(
    "/jobs",
    response_model=JobRecord,
    status_code=status.HTTP_201_CREATED,
    dependencies=[Depends(job_media_type)],
    responses=errors(409, 415),
)
async def submit_job(coord: Coord, config: JobConfigBody) -> JobRecord:
    """Submit a job: the job file's schema, as JSON or YAML (`Content-Type:
    application/yaml`). Data paths must be absolute. 409 while another job is active."""
    _absolute_data_paths(config)
    _trusted(config, coord.roots)
    return await coord.jobs.create(config)


@router.get("/jobs", response_model=list[JobRecord])
async def list_jobs(coord: Coord) -> list[JobRecord]:
    """Every job not deleted, oldest first."""
    return await coord.jobs.all()


@router.get("/jobs/{job_id}", response_model=JobView, responses=errors(404))
async def get_job(coord: Coord, job_id: str) -> JobView:
    """A job's state and progress: samples, steps, epoch, samples/s, loss, staleness per
    rank, per-rank results and evaluation metrics once done, lost workers."""
    return await job_view(coord, await coord.jobs.require(job_id))


@router.delete("/jobs/{job_id}", status_code=status.HTTP_204_NO_CONTENT, responses=errors(404, 409))
async def delete_job(coord: Coord, job_id: str) -> None:
    """Forget a finished, failed or stopped job and all its state in Redis."""
    await coord.jobs.delete(job_id)


@router.get("/jobs/{job_id}/series", response_model=list[SeriesPoint], responses=errors(404))
async def get_series(coord: Coord, job_id: str) -> list[SeriesPoint]:
    """The job's series for plots: samples, rolling AUC, loss; a point a second while it trains,
    the older ones thinned to span the whole job in a bounded number of points."""
    return await job_series(coord, await coord.jobs.require(job_id))


def _absolute_data_paths(config: JobConfig) -> None:
    # Files are opened by the data loader, wherever it runs: a path relative to the
    # client's directory would mean nothing there.
    for field in ("train", "test"):
        paths = getattr(config.data, field, None)
        for i, path in enumerate(paths if isinstance(paths, list) else [paths] if paths is not None else []):
            if not path.is_absolute():
                where = ("body", "data", field, i) if isinstance(paths, list) else ("body", "data", field)
                raise RequestValidationError(
                    [
                        {
                            "type": "value_error",
                            "loc": where,
                            "input": str(path),
                            "msg": "data paths sent to the API must be absolute",
                        }
                    ]
                )


def _trusted(config: JobConfig, roots: PathRoots) -> None:
    """422 for model code or a location the operator does not allow (trillium.job.trust)."""
    refusals = [
        {"type": "value_error", "loc": ("body", *where), "input": location, "msg": why}
        for where, location, why in roots.refusals(config)
    ]
    try:
        check_model_module(config.model.cls)
    except ValueError as err:
        refusals.append(
            {"type": "value_error", "loc": ("body", "model", "cls"), "input": config.model.cls, "msg": str(err)}
        )
    if refusals:
        raise RequestValidationError(refusals)
