"""How a service's job task follows the coordinator's heartbeat answers."""

from __future__ import annotations

import asyncio

from tiny_record import tiny_record
from unconnected import unconnected_settings

from trillium.job.record import JobRecord
from trillium.runtime.service import Service


class Shard(Service):
    """A PS shard whose part in a job runs until it is cancelled, as a real shard's does."""

    role = "embedding_ps"

    def __init__(self) -> None:
        super().__init__(unconnected_settings("embedding_ps"))
        self.running = asyncio.Event()

    async def run_job(self, job: JobRecord) -> None:
        self.running.set()
        await asyncio.Event().wait()


async def test_a_job_deleted_before_its_end_was_heard_stops_the_task() -> None:
    # The warm-up job of `trillium up` is deleted the moment it finishes: the next heartbeat's
    # answer has no job at all, and the shard's consumer of its deleted topic must not live on.
    shard = Shard()
    await shard.on_job(tiny_record())
    await asyncio.wait_for(shard.running.wait(), 5)
    task = shard._job_task
    assert task is not None and not task.done()
    await shard.on_job(None)
    assert task.cancelled() and shard._job_task is None
    assert shard.health_report()["job"]["phase"] == "stopped"


async def test_no_job_heard_while_idle_changes_nothing() -> None:
    shard = Shard()
    await shard.on_job(None)
    assert shard._job_task is None and shard.health_report()["job"] is None


class StuckShard(Shard):
    """A shard whose part in a job swallows its cancel, as a call stuck where no cancel reaches does."""

    def __init__(self) -> None:
        super().__init__()
        self.restarted = asyncio.Event()

    async def run_job(self, job: JobRecord) -> None:
        self.running.set()
        while not self.restarted.is_set():  # the process's exit ends it, here the test's restart
            try:
                await self.restarted.wait()
            except asyncio.CancelledError:
                continue

    async def restart_process(self) -> None:
        self.restarted.set()
        raise asyncio.CancelledError  # a real restart exits the process here


async def test_a_job_task_that_does_not_end_when_cancelled_restarts_the_process(monkeypatch) -> None:
    monkeypatch.setattr("trillium.runtime.service.JOB_CANCEL_S", 0.2)
    shard = StuckShard()
    await shard.on_job(tiny_record())
    await asyncio.wait_for(shard.running.wait(), 5)
    try:
        await asyncio.wait_for(shard.on_job(None), 5)
    except asyncio.CancelledError:
        pass
    assert shard.restarted.is_set()
