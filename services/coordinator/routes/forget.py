"""Forgetting IDs (forget.py does it) and its audit records."""

from __future__ import annotations

from fastapi import APIRouter

from trillium.runtime.forget import ForgetReceipt

from ..forget import ForgetRequest
from ..parts import Coord
from ..views import errors

router = APIRouter(tags=["forget"])


@router.post("/jobs/{job_id}/forget", response_model=ForgetReceipt, responses=errors(404, 409, 422))
async def forget(coord: Coord, job_id: str, body: ForgetRequest) -> ForgetReceipt:
    """Remove IDs (a user's, under the GDPR's Art. 17) from everything of the job that holds them:
    the live PS shards, every checkpoint, every version of its model and the replicas serving it,
    and, masked, the batches its later attempts replay; and from every job linked to it (warm-started
    from it, or publishing its model), each a forget of its own whose receipt this one names in
    `linked`. Returns the receipt (every place checked, the rows removed there), also kept as an
    audit record. 409 unless the job and those linked are stopped, failed or finished; 422 for a
    table the job lacks."""
    return await coord.forgetter.forget(job_id, body)


@router.get("/forgets", response_model=list[ForgetReceipt])
async def forget_receipts(coord: Coord, job_id: str | None = None) -> list[ForgetReceipt]:
    """The receipts of every forget (or of one job's: `?job_id=`), oldest first: audit records,
    kept after their job is deleted."""
    return await coord.forgetter.receipts(job_id)
