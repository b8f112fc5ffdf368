"""A resume from an older checkpoint starts a timeline of its own: the checkpoints it rolled back
from are never restored by a later recovery, and retention counts only the live timeline's (it
deleted each new checkpoint as it was written, with `keep_last: 1`, while the abandoned ones
were newer)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from written_checkpoints import write_checkpoint

from trillium.data import load_job
from trillium.job.record import CheckpointRef, IllegalTransition, JobRecord
from trillium.services.coordinator.checkpoints import Checkpointer
from trillium.services.coordinator.jobs import JobStore
from trillium.services.coordinator.registry import WorkerRegistry
from trillium.services.coordinator.retention import TopicRetention
from trillium.wire import state

TINY_JOB = Path(__file__).resolve().parents[1] / "data" / "tiny_job.yaml"


async def test_recovery_and_retention_follow_the_timeline_a_resume_started(infra, tmp_path) -> None:
    redis = state.connect(infra.redis_database(14))
    await redis.flushdb()
    try:
        jobs = JobStore(redis, tmp_path, infra.kafka)
        raw = load_job(TINY_JOB).model_dump(mode="json")
        raw["checkpoint"] = (raw.get("checkpoint") or {}) | {"dir": str(tmp_path / "checkpoints"), "keep_last": 1}
        job = await jobs.create(type(load_job(TINY_JOB)).model_validate(raw))
        for step, parent in ((100, None), (200, 100), (300, 200)):
            write_checkpoint(jobs, job, step, {}, parent)
        assert (await jobs.pick_checkpoint(job)).manifest.step == 300

        # `trillium resume --checkpoint 100`: attempt 1 starts there; it crashes before its first checkpoint.
        def resumed(record: JobRecord) -> None:
            record.attempt = 1
            record.restore = CheckpointRef(location=jobs.checkpoints(record).location(100), step=100)

        job = await jobs.update(job.id, resumed)
        assert (await jobs.pick_checkpoint(job)).manifest.step == 100, "recovered onto the timeline rolled back from"
        assert (await jobs.pick_checkpoint(job, step=300)).manifest.step == 300  # an operator may still name it

        write_checkpoint(jobs, job, 200, {}, 100)  # the resumed timeline's own step 200
        store = jobs.checkpoints(job)
        assert [(m.step, m.attempt) for m in store.live(job)] == [(100, 0), (200, 1)]
        picked = await jobs.pick_checkpoint(job)
        assert (picked.manifest.step, picked.manifest.attempt) == (200, 1)
        assert store.retain(1, job) == [100, 300]
        assert [(m.step, m.attempt) for m in store.complete()] == [(200, 1)]
    finally:
        await redis.flushdb()
        await redis.aclose()


async def test_a_checkpoint_an_attempt_restores_is_not_deleted_under_it(infra, tmp_path) -> None:
    """The operator's delete of a checkpoint while an attempt restores it is refused (409), and
    an attempt whose checkpoint was deleted first does not start from it; a checkpoint nothing
    uses is deleted."""
    redis = state.connect(infra.redis_database(14))
    await redis.flushdb()
    http = httpx.AsyncClient()
    retention = TopicRetention(infra.kafka)
    try:
        jobs = JobStore(redis, tmp_path, infra.kafka)
        checkpointer = Checkpointer(redis, WorkerRegistry(redis, 1.0), jobs, retention, http)
        raw = load_job(TINY_JOB).model_dump(mode="json")
        raw["checkpoint"] = (raw.get("checkpoint") or {}) | {"dir": str(tmp_path / "checkpoints"), "keep_last": 5}
        job = await jobs.create(type(load_job(TINY_JOB)).model_validate(raw))
        for step, parent in ((100, None), (200, 100), (300, 200)):
            write_checkpoint(jobs, job, step, {}, parent)
        await jobs.transition(job.id, "failed", error="a test's failure")

        picked = await jobs.pick_checkpoint(job, step=200)
        job = await jobs.start_attempt(
            await jobs.require(job.id), picked, "a test's resume", expect=frozenset({"failed"})
        )
        assert job.state == "recovering" and job.restore.step == 200
        with pytest.raises(IllegalTransition, match="checkpoint 200 of job .* is being restored by attempt 1"):
            await checkpointer.delete(job, 200)
        assert await checkpointer.delete(job, 100)  # no delta of it: nothing restores it
        assert [m.step for m in jobs.checkpoints(job).complete()] == [200, 300]

        await jobs.transition(job.id, "failed", error="failed again")
        picked = await jobs.pick_checkpoint(await jobs.require(job.id), step=300)
        assert await checkpointer.delete(await jobs.require(job.id), 300)  # before the attempt starts
        with pytest.raises(IllegalTransition, match="checkpoint 300 was deleted before it was restored"):
            await jobs.start_attempt(await jobs.require(job.id), picked, "too late", expect=frozenset({"failed"}))
        assert (await jobs.require(job.id)).state == "failed"
    finally:
        await http.aclose()
        await retention.close()
        await redis.flushdb()
        await redis.aclose()
