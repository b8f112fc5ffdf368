"""Every service's admin HTTP routes: health and readiness (open: up, ready, nothing more), and
behind an observer's token (trillium.scopes) its status, Prometheus metrics, the OpenAPI spec with
an interactive docs page, and behind the services' token the calls the coordinator makes at
checkpoint and publish cuts."""

from __future__ import annotations

import html
import json
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import prometheus_client
from fastapi import Depends, FastAPI, Response
from fastapi.responses import HTMLResponse, JSONResponse

from trillium.runtime.checkpoint import CaptureRequest, CaptureResult, ReleaseRequest
from trillium.runtime.forget import ShardForgetRequest, ShardForgetResult
from trillium.runtime.model_store import ExportRequest
from trillium.scopes import Scope


class Administered(Protocol):
    """What the routes read of a service (`trillium.runtime.service.Service`)."""

    app: FastAPI
    ready: bool

    def accepts_traffic(self) -> bool: ...
    def health_report(self) -> dict[str, Any]: ...
    def requires(self, *scopes: Scope) -> Callable[..., Awaitable[None]]: ...
    def require_attempt(self, job_id: str, attempt: int) -> None: ...
    def require_location(self, location: str | None) -> None: ...
    async def capture(self, request: CaptureRequest) -> CaptureResult: ...
    async def export(self, request: ExportRequest) -> None: ...
    async def release(self, request: ReleaseRequest) -> None: ...
    async def forget(self, request: ShardForgetRequest) -> ShardForgetResult: ...


_SWAGGER_PAGE = """<!doctype html><html><head><title>{title}</title>
<link rel="stylesheet" href="https://cdn.jsdelivr.net/npm/swagger-ui-dist@5/swagger-ui.css"></head>
<body><div id="swagger-ui"></div>
<script src="https://cdn.jsdelivr.net/npm/swagger-ui-dist@5/swagger-ui-bundle.js"></script>
<script>SwaggerUIBundle({{dom_id: "#swagger-ui", spec: {spec}}});</script></body></html>"""


def add_admin_routes(service: Administered) -> None:
    """Health and readiness (open); status, metrics, the OpenAPI spec and its docs page (an
    observer's or operator's token), and the coordinator's checkpoint, publishing and forget calls
    (the services' token: nobody else may make a worker write or drop its state)."""
    app = service.app
    observer = [Depends(service.requires("observe"))]
    authorized = [Depends(service.requires("services"))]

    @app.get("/healthz", tags=["health"])
    async def healthz() -> dict[str, str]:
        """Up (`ok`) or still starting; nothing more without the token (`/status`)."""
        return {"status": service.health_report()["status"]}

    @app.get("/status", tags=["health"], dependencies=observer)
    async def status_report() -> dict[str, Any]:
        """What this process is and does: its job, attempt, parts written, tables."""
        return service.health_report()

    @app.get("/readyz", tags=["health"])
    async def readyz(response: Response) -> dict[str, Any]:
        ready = service.ready and service.accepts_traffic()
        if not ready:
            response.status_code = 503
        return {"ready": ready}

    @app.get("/metrics", tags=["health"], dependencies=observer)
    async def metrics() -> Response:
        """Prometheus metrics (scrape with the token: `authorization: {credentials_file: ...}`)."""
        return Response(prometheus_client.generate_latest(), media_type=prometheus_client.CONTENT_TYPE_LATEST)

    @app.post("/job/capture", tags=["checkpoints"], dependencies=authorized)
    async def capture(request: CaptureRequest) -> CaptureResult:
        """Capture this worker's state at a checkpoint cut; the part is written in the background."""
        service.require_location(request.location)
        service.require_attempt(request.job_id, request.attempt)
        return await service.capture(request)

    @app.post("/job/export", tags=["publishing"], dependencies=authorized)
    async def export(request: ExportRequest) -> dict[str, bool]:
        """Export this PS shard's rows at a job's last step, as part of a model version."""
        service.require_attempt(request.job_id, request.attempt)
        await service.export(request)
        return {"exported": True}

    @app.post("/job/release", tags=["checkpoints"], dependencies=authorized)
    async def release(request: ReleaseRequest) -> dict[str, bool]:
        """Release this NN rank from a checkpoint cut."""
        service.require_location(request.location)
        service.require_attempt(request.job_id, request.attempt)
        await service.release(request)
        return {"released": True}

    @app.post("/job/forget", tags=["forget"], dependencies=authorized)
    async def forget(request: ShardForgetRequest) -> ShardForgetResult:
        """Remove rows of a job's table from this PS shard's live store (a forget)."""
        return await service.forget(request)

    @app.get("/openapi.json", include_in_schema=False, dependencies=observer)
    async def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False, dependencies=observer)
    async def docs() -> HTMLResponse:
        # The spec is inlined: the page's own fetch of /openapi.json would carry no token.
        return HTMLResponse(
            _SWAGGER_PAGE.format(title=html.escape(app.title), spec=json.dumps(app.openapi()).replace("</", "<\\/"))
        )
