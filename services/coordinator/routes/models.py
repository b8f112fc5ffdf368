"""GET /v1/models: the models the stack's jobs have published."""

from __future__ import annotations

from fastapi import APIRouter

from trillium.runtime.model_registry import RegisteredModel

from ..parts import Coord

router = APIRouter(tags=["models"])


@router.get("/models", response_model=list[RegisteredModel])
async def list_models(coord: Coord) -> list[RegisteredModel]:
    """Every model the stack's jobs have published: where its versions are, the newest, its job.
    Predictions come from the serving replicas (`trillium status` lists them)."""
    return await coord.publisher.models()
