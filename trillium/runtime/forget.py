"""The messages of a forget (`POST /v1/jobs/{id}/forget`, services/coordinator/forget.py) between
the coordinator and the workers and replicas that hold rows, and its receipt."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from trillium.config import MAX_FORGET_VALUES

__all__ = [
    "MAX_FORGET_VALUES",
    "ForgetIntent",
    "ForgetReceipt",
    "Place",
    "PlaceKind",
    "ShardForgetRequest",
    "ShardForgetResult",
]


class ShardForgetRequest(BaseModel):
    """Coordinator -> PS shard: remove these rows of the job's table from the live store."""

    job_id: str
    table: str
    ids: list[int]


class ShardForgetResult(BaseModel):
    held: bool = Field(description="whether the shard holds the job's rows (another job may have replaced them)")
    removed: int = 0


PlaceKind = Literal["ps_shard", "checkpoint", "model_version", "serving", "topic"]


class Place(BaseModel):
    """One place a forget checked: what it is, how many rows it removed there, and what it says."""

    kind: PlaceKind
    name: str
    rows_removed: int = 0
    note: str | None = None


class ForgetReceipt(BaseModel):
    """What a forget did, kept as an audit record: it names the IDs only by a digest."""

    id: str
    job_id: str
    table: str
    values: int = Field(description="the values asked for")
    ids: int = Field(description="the IDs they hash to, over the slots that use the table")
    ids_sha256: str = Field(description="sha256 of the sorted IDs (u64 little-endian): which IDs, without them")
    started_at: float
    finished_at: float
    through_batch: int | None = Field(
        None, description="the newest batch the job had written: its later attempts mask the IDs up to it"
    )
    rows_removed: int = Field(description="rows removed from the live PS shards")
    complete: bool = Field(description="every place that holds the job's rows answered")
    places: list[Place]
    runs: int = Field(
        1, description="how often it ran: more than once after a coordinator restart or a place unreached"
    )
    linked: list[str] = Field(
        default_factory=list,
        description="the receipts of the forgets this one ran on the jobs linked to its job (GET /v1/forgets)",
    )
    linked_from: str | None = Field(
        None, description="the receipt of the forget asked for, when this job was reached as linked to that one's"
    )
    reason: str | None = Field(None, description="why a linked job was reached: warm-started from it, or its model")


class ForgetIntent(BaseModel):
    """A forget asked for and not yet done, kept in Redis (`state.FORGET_INTENTS`) from before it
    touches anything until its receipt is written: a coordinator that starts runs it again (each
    step of a forget is idempotent). It holds the IDs, as the job's `ForgetMask` does, not the values."""

    receipt: str = Field(description="the id its receipt will have")
    job_id: str
    table: str
    values: int
    ids: list[int]
    started_at: float
    runs: int = Field(0, description="the runs started so far")
    linked: list[str] = Field(default_factory=list, description="the receipts of the linked jobs' forgets")
    linked_from: str | None = Field(None, description="the receipt of the forget that reached this job")
    reason: str | None = None
