"""A worker hears of a changed job record the moment the coordinator announces it on Redis,
not at its next periodic heartbeat."""

from __future__ import annotations

import asyncio
import contextlib

from unconnected import unconnected_settings

from trillium.runtime.heartbeats import heartbeat_on_job_changes
from trillium.runtime.service import Service
from trillium.wire import state


class Worker(Service):
    role = "embedding_ps"


async def test_an_announced_job_change_sends_a_heartbeat_at_once(infra) -> None:
    url = infra.redis_database(8)
    worker = Worker(unconnected_settings("embedding_ps").model_copy(update={"redis_url": url, "heartbeat_s": 60.0}))
    listening = asyncio.create_task(heartbeat_on_job_changes(worker))
    redis = state.connect(url)
    try:
        # Subscribed: it asks at once for whatever changed while it was not.
        await asyncio.wait_for(worker.heartbeat_now.wait(), 10)
        worker.heartbeat_now.clear()
        assert await redis.publish(state.JOB_CHANGED, "some-job") >= 1
        await asyncio.wait_for(worker.heartbeat_now.wait(), 5)
    finally:
        listening.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await listening
        await redis.aclose()
