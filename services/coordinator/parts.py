"""What the REST API needs of the coordinator, as a Protocol: api.py types against it, so it
never imports server.py (which wires the API in)."""

from __future__ import annotations

from typing import Protocol

from fastapi.security import HTTPAuthorizationCredentials

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

    async def require_token(self, creds: HTTPAuthorizationCredentials | None) -> None: ...
