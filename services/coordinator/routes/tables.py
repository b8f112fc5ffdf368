"""A job's embedding tables, as its PS shards hold them now."""

from __future__ import annotations

from fastapi import APIRouter

from ..observe import job_tables
from ..parts import Coord
from ..views import TablesView, errors

router = APIRouter(tags=["tables"])


@router.get("/jobs/{job_id}/tables", response_model=TablesView, responses=errors(404, 409, 503))
async def get_tables(coord: Coord, job_id: str) -> TablesView:
    """Per embedding table: rows, memory, admitted/evicted/expired rows, summed over the
    PS shards (and per shard), asked of each shard now. Only the current job's tables are held."""
    return await job_tables(
        coord.registry, await coord.jobs.require(job_id), await coord.jobs.current(), coord.settings.grpc
    )
