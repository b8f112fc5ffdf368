"""What the REST API needs of the coordinator, as a Protocol, and the dependency that hands it to
a route: the routes type against it, so they never import server.py (which wires the API in)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated, Protocol

from fastapi import Depends, Request

from trillium.config import ServiceSettings
from trillium.scopes import Scope
from trillium.wire.state import aioredis

from .checkpoints import Checkpointer
from .forget import Forgetter
from .jobs import JobStore
from .observe import Observer
from .publish import Publisher
from .registry import WorkerRegistry


class CoordinatorParts(Protocol):
    settings: ServiceSettings
    redis: aioredis.Redis
    registry: WorkerRegistry
    jobs: JobStore
    observer: Observer
    checkpointer: Checkpointer
    publisher: Publisher
    forgetter: Forgetter

    def requires(self, *scopes: Scope) -> Callable[..., Awaitable[None]]: ...


async def get_coordinator(request: Request) -> CoordinatorParts:
    """The coordinator that serves this app (`app.state.coordinator`, set by api.py). A coroutine:
    FastAPI runs a plain function dependency on a worker thread, a hand-off on every heartbeat."""
    return request.app.state.coordinator


Coord = Annotated[CoordinatorParts, Depends(get_coordinator)]
