"""A worker's registration and heartbeats with the coordinator: register, then heartbeat every
`heartbeat_s` (at once when a report is waiting, or when the coordinator announces a changed job
record on Redis); re-register when the coordinator forgot the worker (it restarted) and keep
trying while it does not answer; the job record in each answer goes to `Service.on_job`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, Protocol

import httpx
from fastapi import status
from redis.exceptions import RedisError

from trillium.config import ServiceSettings
from trillium.job.record import JobRecord
from trillium.wire import state


class Heartbeating(Protocol):
    """What the heartbeats read and call of a service (`trillium.runtime.service.Service`)."""

    settings: ServiceSettings
    name: str
    coordinator: httpx.AsyncClient
    stopping: asyncio.Event  # set: the process is stopping
    heartbeat_now: asyncio.Event  # set: a report is waiting, heartbeat at once

    def registration(self) -> dict[str, Any]: ...
    def health_report(self) -> dict[str, Any]: ...
    async def on_job(self, job: JobRecord | None) -> None: ...
    def exit_replaced(self, why: str | None) -> None: ...


logger = logging.getLogger("trillium.runtime.service")


async def heartbeat_on_job_changes(service: Heartbeating) -> None:
    """Heartbeat at once whenever the coordinator announces a changed job record (Redis
    pub/sub), so that a job's start, pause or stop reaches this worker in milliseconds
    while the periodic heartbeats stay seconds apart. Through Redis restarts: a lost
    announcement is made up for by the next periodic heartbeat."""
    redis = state.connect(service.settings.redis_url)
    try:
        while True:
            pubsub = redis.pubsub()
            try:
                await pubsub.subscribe(state.JOB_CHANGED)
                service.heartbeat_now.set()  # whatever changed while we were not subscribed
                while True:
                    if await pubsub.get_message(ignore_subscribe_messages=True, timeout=30.0):
                        service.heartbeat_now.set()
            except (RedisError, OSError) as err:
                logger.warning("job announcements: Redis unavailable", extra={"error": str(err)})
                await asyncio.sleep(service.settings.heartbeat_s)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()
    finally:
        await redis.aclose()


async def heartbeat_loop(service: Heartbeating) -> None:
    """Register, then heartbeat; re-register whenever the coordinator forgot us
    (e.g. it restarted), and keep retrying while it is unreachable."""
    announcements = asyncio.create_task(heartbeat_on_job_changes(service), name="job-announcements")
    try:
        await _heartbeats(service)
    finally:
        announcements.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await announcements


async def _heartbeats(service: Heartbeating) -> None:
    base, client = service.settings.coordinator_url, service.coordinator
    registered = False
    job_digest: str | None = None  # names the record `on_job` last took: not sent again
    while not service.stopping.is_set():
        try:
            if not registered:
                r = await client.post(f"{base}/v1/workers", json=service.registration())
                if r.status_code == status.HTTP_409_CONFLICT:
                    service.exit_replaced(r.json().get("detail"))
                r.raise_for_status()
                registered = True
                logger.info("registered with coordinator", extra={"coordinator": base})
            service.heartbeat_now.clear()
            r = await client.post(
                f"{base}/v1/workers/{service.name}/heartbeat",
                json={"health": service.health_report(), "job_digest": job_digest},
            )
            if r.status_code == 404:
                registered = False
                continue
            r.raise_for_status()
            answer = r.json()
            job = answer["job"]
            if job is not None or answer.get("job_digest") is None:  # else: the record we hold
                await service.on_job(JobRecord.model_validate(job) if job else None)
                job_digest = answer.get("job_digest")
        except httpx.HTTPError as exc:
            registered = False  # re-register once it answers again
            logger.warning("coordinator unreachable", extra={"error": str(exc)})
        wake = asyncio.create_task(service.heartbeat_now.wait())
        stop = asyncio.create_task(service.stopping.wait())
        await asyncio.wait({wake, stop}, timeout=service.settings.heartbeat_s, return_when=asyncio.FIRST_COMPLETED)
        wake.cancel()
        stop.cancel()
