"""A serving replica's REST API: predictions, the models it serves, rollback and unpin.

    POST /v1/models/{model}:predict    {"instances": [event, ...]} -> {"predictions", "model", "version"}
    GET  /v1/models                    every model the replica serves, as `ModelView`s
    GET  /v1/models/{model}            one model: its version, step, freshness, tables
    POST /v1/models/{model}/rollback   {"version": N}: serve version N, restored from the model store
    POST /v1/models/{model}/unpin      follow the newest version again

Predictions and the models' views need a prediction client's token (or an operator's), rollback
and unpin an operator's (trillium.scopes; the app adds the dependencies to `router` and `control`). An instance that cannot be a
sample answers 422 in FastAPI's own error shape, its `loc` naming the instance and the field:
`["body", "instances", 3, "age"]`; more instances than `max_batch` answer 413.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Protocol

from fastapi import APIRouter, Depends, HTTPException, Request, status
from pydantic import BaseModel, Field

from trillium.data.instances import BadInstance
from trillium.runtime.model_store import CorruptVersion
from trillium.runtime.storage import unreachable

from .follower import ModelFollower


class PredictRequest(BaseModel):
    """Events (a Kafka job's) or rows (a file job's) with the job's own field names."""

    instances: list[Any] = Field(description="JSON objects: a missing field is a missing value")


class PredictResponse(BaseModel):
    predictions: list[float] | list[dict[str, float]] = Field(
        description="per instance, the probability of a positive label; a multi-task model's: each "
        "task's probability (binary) or value in its label's units (regression), by task name"
    )
    model: str
    version: int
    tasks: list[str] | None = Field(None, description="a multi-task model's tasks, in its job's order")


class TableView(BaseModel):
    rows: int
    memory_bytes: int
    lookups: int = Field(description="IDs looked up since the replica started")
    misses: int = Field(description="of those, IDs the model has never trained (they read as zeros)")


class RefusalView(BaseModel):
    version: int
    at: float
    reason: str


class ModelView(BaseModel):
    model: str
    version: int | None = Field(description="the version served (null: none loads yet)")
    step: int | None = None
    job_id: str | None = None
    attempt: int | None = None
    kind: str | None = None
    created_at: float | None = Field(None, description="when the version was published")
    event_time: float | None = Field(None, description="the newest event time of a sample trained into it")
    freshness_lag_seconds: float | None = Field(None, description="now less event_time (stream jobs)")
    low_watermark: float | None = Field(
        None,
        description="every impression of an earlier event time is trained into it, those still in a join "
        "window included (stream jobs)",
    )
    low_watermark_lag_seconds: float | None = Field(
        None, description="now less low_watermark: how far back the version holds every event"
    )
    version_age_seconds: float | None = Field(None, description="now less created_at")
    dtype: str | None = None
    pinned: int | None = Field(None, description="the version a rollback pinned (null: following the newest)")
    forgets: int = Field(0, description="the forgets of the model (`POST /v1/jobs/{id}/forget`) its tables reflect")
    tables: dict[str, TableView] = Field(default_factory=dict)
    bytes: int = Field(0, description="the tables' memory")
    refused: list[RefusalView] = Field(default_factory=list, description="versions refused, the latest")
    error: str | None = None
    store_unreachable_since: float | None = Field(
        None, description="while the model store does not answer: since when (the version served goes on)"
    )
    store_error: str | None = Field(None, description="what the last failed read of the store said")


class RollbackRequest(BaseModel):
    version: int = Field(ge=1)


class ServingParts(Protocol):
    """What the API needs of the replica (it never imports server.py)."""

    followers: dict[str, ModelFollower]
    max_batch: int

    async def predict_async(self, model: str, instances: list[Any], protocol: str) -> PredictResponse: ...


def model_view(follower: ModelFollower) -> ModelView:
    state, served = follower.state, follower.served
    refused = [RefusalView(version=r.version, at=r.at, reason=r.reason) for r in state.refused]
    manifest = served.manifest if served is not None else None
    if manifest is None:
        return ModelView(
            model=follower.name,
            version=None,
            refused=refused,
            error=state.error,
            store_unreachable_since=state.store_unreachable_since,
            store_error=state.store_error,
        )
    now = time.time()
    tables = {
        name: TableView(**{k: stats[k] for k in TableView.model_fields}) for name, stats in served.table_stats().items()
    }
    return ModelView(
        model=follower.name,
        version=manifest.version,
        step=manifest.step,
        job_id=manifest.job_id,
        attempt=manifest.attempt,
        kind=manifest.kind,
        created_at=manifest.created_at,
        event_time=manifest.event_time,
        freshness_lag_seconds=now - manifest.event_time if manifest.event_time is not None else None,
        low_watermark=manifest.low_watermark,
        low_watermark_lag_seconds=now - manifest.low_watermark if manifest.low_watermark is not None else None,
        version_age_seconds=now - manifest.created_at,
        dtype=manifest.dtype,
        pinned=state.pinned,
        forgets=state.forgets,
        tables=tables,
        bytes=served.memory_bytes(),
        refused=refused,
        error=state.error,
        store_unreachable_since=state.store_unreachable_since,
        store_error=state.store_error,
    )


def bad_instance(err: BadInstance) -> HTTPException:
    loc: list[Any] = ["body", "instances", err.index] + ([err.field] if err.field else [])
    return HTTPException(status.HTTP_422_UNPROCESSABLE_ENTITY, [{"loc": loc, "msg": str(err), "type": "value_error"}])


def get_parts(request: Request) -> ServingParts:
    """The replica that serves this app (`app.state.replica`, set by server.py)."""
    return request.app.state.replica


Parts = Annotated[ServingParts, Depends(get_parts)]


def get_follower(model: str, parts: Parts) -> ModelFollower:
    found = parts.followers.get(model)
    if found is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no model {model!r} here; models: {sorted(parts.followers)}")
    return found


Follower = Annotated[ModelFollower, Depends(get_follower)]
router = APIRouter(prefix="/v1", tags=["serving"])
control = APIRouter(prefix="/v1", tags=["serving"])


@router.post("/models/{model}:predict", response_model=PredictResponse)
async def predict(model: str, body: PredictRequest, parts: Parts) -> PredictResponse:
    """The model's predictions for the instances, all from one version."""
    return await parts.predict_async(model, body.instances, "rest")


@router.get("/models", response_model=list[ModelView])
async def list_models(parts: Parts) -> list[ModelView]:
    return [model_view(f) for _, f in sorted(parts.followers.items())]


@router.get("/models/{model}", response_model=ModelView)
async def get_model(found: Follower) -> ModelView:
    return model_view(found)


@control.post("/models/{model}/rollback", response_model=ModelView)
async def rollback(found: Follower, body: RollbackRequest) -> ModelView:
    """Serve version N (restored from the model store) until unpinned; 404 no such version, 409 it
    does not load, 503 the store does not answer (the version served stays)."""
    try:
        await found.pin(body.version)
    except LookupError as err:
        raise HTTPException(status.HTTP_404_NOT_FOUND, str(err)) from None
    except Exception as err:
        if unreachable(err):
            raise HTTPException(
                status.HTTP_503_SERVICE_UNAVAILABLE, f"the model store does not answer: {err}"
            ) from None
        if isinstance(err, (CorruptVersion, OSError, ValueError)):
            raise HTTPException(status.HTTP_409_CONFLICT, f"version {body.version} does not load: {err}") from None
        raise
    return model_view(found)


@control.post("/models/{model}/unpin", response_model=ModelView)
async def unpin(found: Follower) -> ModelView:
    """Follow the newest version again (it loads within seconds)."""
    await found.unpin()
    return model_view(found)
