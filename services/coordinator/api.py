"""The coordinator's REST API under /v1: the routers of routes/, each behind its token's scope
(trillium.scopes), the domain's errors as HTTP answers, and the YAML a job may be sent as."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request, status
from fastapi.responses import JSONResponse

from trillium.job.record import IllegalTransition
from trillium.scopes import Scope

from .bodies import YAML_TYPES
from .jobs import JobNotFound
from .observe import TablesUnavailable
from .parts import CoordinatorParts
from .routes import checkpoints, control, forget, jobs, models, staleness, tables, workers
from .views import errors

# Each router with the scopes of the tokens it takes, in the order the OpenAPI lists their tags.
ROUTERS: tuple[tuple[APIRouter, tuple[Scope, ...]], ...] = (
    (models.router, ("operate",)),
    (jobs.router, ("operate",)),
    (control.router, ("operate",)),
    (forget.router, ("operate",)),
    (staleness.router, ("operate",)),
    (tables.router, ("operate",)),
    (checkpoints.router, ("operate",)),
    (workers.router, ("services",)),
    (workers.either, ("services", "operate")),
)


def add_api(app: FastAPI, coord: CoordinatorParts) -> None:
    app.state.coordinator = coord  # what parts.Coord hands the routes
    for router, scopes in ROUTERS:
        app.include_router(
            router, prefix="/v1", dependencies=[Depends(coord.requires(*scopes))], responses=errors(401, 413)
        )
    _error_handlers(app)
    _yaml_in_openapi(app)


def _error_handlers(app: FastAPI) -> None:
    """The domain's errors as HTTP answers, with their message as the detail."""

    async def answer(request: Request, exc: Exception) -> JSONResponse:
        if isinstance(exc, JobNotFound):
            code = status.HTTP_404_NOT_FOUND
        elif isinstance(exc, TablesUnavailable) and not exc.conflict:
            code = status.HTTP_503_SERVICE_UNAVAILABLE
        else:  # IllegalTransition, or tables that are not the job's
            code = status.HTTP_409_CONFLICT
        return JSONResponse({"detail": str(exc)}, status_code=code)

    for error in (JobNotFound, IllegalTransition, TablesUnavailable):
        app.add_exception_handler(error, answer)


def _yaml_in_openapi(app: FastAPI) -> None:
    """Document that POST /v1/jobs takes YAML too, with the same schema as its JSON."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        fresh = app.openapi_schema is None
        schema = generate()
        if fresh:
            content = schema["paths"]["/v1/jobs"]["post"]["requestBody"]["content"]
            for media in YAML_TYPES:
                content[media] = content["application/json"]
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
