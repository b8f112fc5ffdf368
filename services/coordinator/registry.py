"""The worker registry: every registered service instance, kept in Redis so a
coordinator restart forgets nobody."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field

from trillium import state
from trillium.config import Role

# A worker is lost after this many heartbeat intervals without one.
LOST_AFTER_MISSED = 10


class WorkerRegistration(BaseModel):
    name: str = Field(pattern=r"^[a-z_]+-\d+$", max_length=64)
    role: Role
    index: int = Field(ge=0)
    http_url: str = Field(max_length=256)
    grpc_address: str | None = Field(None, max_length=256)
    pid: int = Field(ge=0)


class Worker(WorkerRegistration):
    registered_at: float
    last_heartbeat: float
    health: dict[str, Any] = {}
    status: Literal["healthy", "starting", "lost"] = "starting"


class WorkerRegistry:
    def __init__(self, redis: state.aioredis.Redis, heartbeat_s: float) -> None:
        self.redis = redis
        self.lost_after_s = heartbeat_s * LOST_AFTER_MISSED
        self._key = state.key("workers")

    async def register(self, reg: WorkerRegistration) -> Worker:
        now = time.time()
        worker = Worker(**reg.model_dump(), registered_at=now, last_heartbeat=now)
        await self.redis.hset(self._key, reg.name, worker.model_dump_json())
        return worker

    async def heartbeat(self, name: str, health: dict[str, Any]) -> Worker | None:
        raw = await self.redis.hget(self._key, name)
        if raw is None:
            return None
        worker = Worker.model_validate_json(raw)
        worker.last_heartbeat = time.time()
        worker.health = health
        await self.redis.hset(self._key, name, worker.model_dump_json())
        return worker

    async def deregister(self, name: str) -> bool:
        return bool(await self.redis.hdel(self._key, name))

    async def workers(self) -> list[Worker]:
        raw = await self.redis.hgetall(self._key)
        now = time.time()
        workers = []
        for value in raw.values():
            worker = Worker.model_validate_json(value)
            if now - worker.last_heartbeat > self.lost_after_s:
                worker.status = "lost"
            else:
                worker.status = "healthy" if worker.health.get("status") == "ok" else "starting"
            workers.append(worker)
        return sorted(workers, key=lambda w: (w.role, w.index))
