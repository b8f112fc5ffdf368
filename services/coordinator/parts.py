"""What the REST API needs of the coordinator, as a Protocol: api.py types against it, so it
never imports server.py (which wires the API in)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

from trillium.scopes import Scope
from trillium.wire.state import aioredis

from .checkpoints import Checkpointer
from .forget import Forgetter
from .jobs import JobStore
from .observe import Observer
from .publish import Publisher
from .registry import WorkerRegistry


class CoordinatorParts(Protocol):
    redis: aioredis.Redis
    registry: WorkerRegistry
    jobs: JobStore
    observer: Observer
    checkpointer: Checkpointer
    publisher: Publisher
    forgetter: Forgetter

    def requires(self, *scopes: Scope) -> Callable[..., Awaitable[None]]: ...
