"""The coordinator service: job control, the worker registry and (later) staleness
tracking and checkpoints, behind a token-protected REST API under /v1."""

from __future__ import annotations

import secrets
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, HTTPException, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel

from trillium import state
from trillium.service import Service, run_service

from .registry import Worker, WorkerRegistration, WorkerRegistry

_bearer = HTTPBearer(auto_error=False)


class HeartbeatRequest(BaseModel):
    health: dict[str, Any] = {}


class Coordinator(Service):
    role = "coordinator"

    def add_routes(self, app: FastAPI) -> None:
        token = self.settings.token

        def require_token(creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> None:
            # Constant-time comparison: response timing must not leak the token.
            if creds is None or not secrets.compare_digest(creds.credentials.encode(), token.encode()):
                raise HTTPException(status.HTTP_401_UNAUTHORIZED, "missing or invalid bearer token",
                                    headers={"WWW-Authenticate": "Bearer"})

        v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_token)])

        @v1.post("/workers", response_model=Worker, tags=["workers"])
        async def register_worker(reg: WorkerRegistration) -> Worker:
            return await self.registry.register(reg)

        @v1.post("/workers/{name}/heartbeat", response_model=Worker, tags=["workers"])
        async def heartbeat(name: str, body: HeartbeatRequest) -> Worker:
            worker = await self.registry.heartbeat(name, body.health)
            if worker is None:
                raise HTTPException(status.HTTP_404_NOT_FOUND, f"worker {name!r} is not registered")
            return worker

        @v1.get("/workers", response_model=list[Worker], tags=["workers"])
        async def list_workers() -> list[Worker]:
            return await self.registry.workers()

        @v1.delete("/workers/{name}", status_code=status.HTTP_204_NO_CONTENT, tags=["workers"])
        async def deregister(name: str) -> None:
            if not await self.registry.deregister(name):
                raise HTTPException(status.HTTP_404_NOT_FOUND, f"worker {name!r} is not registered")

        app.include_router(v1)

    async def start(self) -> None:
        await state.wait_for_redis(self.settings.redis_url)
        self.redis = state.connect(self.settings.redis_url)
        self.registry = WorkerRegistry(self.redis, self.settings.heartbeat_s)

    async def stop(self) -> None:
        if hasattr(self, "redis"):
            await self.redis.aclose()


def main() -> None:
    run_service(Coordinator)
