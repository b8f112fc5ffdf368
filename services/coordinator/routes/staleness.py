"""A job's staleness: the live bound and what each NN rank observed."""

from __future__ import annotations

from fastapi import APIRouter

from ..bodies import StalenessUpdate
from ..job_view import staleness_report
from ..parts import Coord
from ..views import StalenessReport, errors

router = APIRouter(tags=["staleness"])


@router.get("/jobs/{job_id}/staleness", response_model=StalenessReport, responses=errors(404))
async def get_staleness(coord: Coord, job_id: str) -> StalenessReport:
    """The live staleness bound and the staleness observed per NN rank (max, mean, histogram)."""
    return await staleness_report(coord, await coord.jobs.require(job_id))


@router.put("/jobs/{job_id}/staleness", response_model=StalenessReport, responses=errors(404, 409))
@router.patch("/jobs/{job_id}/staleness", response_model=StalenessReport, responses=errors(404, 409))
async def set_staleness(coord: Coord, job_id: str, update: StalenessUpdate) -> StalenessReport:
    """Change the bound of an active job, live: the embedding workers apply it to their next lookup."""
    return await staleness_report(coord, await coord.jobs.set_bound(job_id, update.bound))
