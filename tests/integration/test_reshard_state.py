"""The coordinator's side of a live reshard, against the real Redis and Kafka without a stack:
what a request is refused for, how a stop cancels it, how its checkpoint starts the attempt on
the new shards (or stops the job when the reshard was cancelled), how an abandoned one fails it."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import pytest
from written_checkpoints import write_checkpoint

from trillium.data import load_job
from trillium.job.record import IllegalTransition
from trillium.runtime.checkpoint import Manifest
from trillium.services.coordinator.jobs import JobStore
from trillium.services.coordinator.registry import WorkerRegistration, WorkerRegistry
from trillium.services.coordinator.reshard import end_at_final_cut, request_reshard, reshard_abandoned
from trillium.wire import kafka, state

DATA = Path(__file__).resolve().parents[1] / "data"


@contextlib.asynccontextmanager
async def _coordinator(infra, run_dir: Path):
    redis = state.connect(infra.redis_database(6))
    await redis.flushdb()
    jobs, registry = JobStore(redis, run_dir, infra.kafka), WorkerRegistry(redis, 1.0)
    for shard in range(3):  # a stack of 3 PS shards
        name = f"embedding_ps-{shard}"
        await registry.register(
            WorkerRegistration(name=name, role="embedding_ps", index=shard, http_url="http://x", pid=1)
        )
    try:
        yield jobs, registry
    finally:
        await redis.flushdb()
        await redis.aclose()


async def _running(jobs: JobStore) -> str:
    job = await jobs.create(load_job(DATA / "tiny_job.yaml"))  # on 2 PS shards
    await jobs.transition(job.id, "starting")
    await jobs.transition(job.id, "running")
    return job.id


def _manifest(job, step: int) -> Manifest:
    return Manifest(
        job_id=job.id,
        attempt=job.attempt,
        step=step,
        epoch=0,
        reason="request",
        created_at=time.time(),
        pause_seconds=0.0,
        seconds_to_write=0.0,
        config=job.config,
        positions={},
        written={},
        lineage={},
        files=[],
    )


async def test_a_reshard_is_refused_naming_why(infra, tmp_path) -> None:
    async with _coordinator(infra, tmp_path) as (jobs, registry):
        job = await jobs.create(load_job(DATA / "tiny_job.yaml"))
        with pytest.raises(IllegalTransition, match="is submitted; only a running job can be resharded"):
            await request_reshard(jobs, registry, job.id, 3)
        await jobs.transition(job.id, "starting")
        await jobs.transition(job.id, "running")
        with pytest.raises(IllegalTransition, match="ps_shards: 5 needs embedding_ps-0..4, and embedding_ps-3, "):
            await request_reshard(jobs, registry, job.id, 5)
        with pytest.raises(IllegalTransition, match="ps_shards: job .* already runs on 2 PS shards"):
            await request_reshard(jobs, registry, job.id, 2)
        asked = await request_reshard(jobs, registry, job.id, 3)
        assert asked.stop_after == asked.checkpoint_seq == asked.reshards[0].seq == 1
        with pytest.raises(IllegalTransition, match="already being resharded to 3 PS shards"):
            await request_reshard(jobs, registry, job.id, 1)
        # A stop before the cut cancels it (with no step trained, the job stops at once).
        stopped = await jobs.request_stop(job.id, checkpoint=True)
        assert stopped.state == "stopping" and stopped.pending_reshard is None
        assert (stopped.reshards[0].state, stopped.reshards[0].error) == ("cancelled", "the job was stopping first")


async def test_the_reshards_checkpoint_starts_an_attempt_on_the_new_shards(infra, tmp_path) -> None:
    async with _coordinator(infra, tmp_path) as (jobs, registry):
        job_id = await _running(jobs)
        job = await jobs.require(job_id)
        await jobs.create_topics(job)
        await request_reshard(jobs, registry, job_id, 3)
        job = await jobs.require(job_id)
        # The final cut's checkpoint, written: the attempt checks it is there as it starts from it.
        write_checkpoint(jobs, job, 41, {}, None)
        store = jobs.checkpoints(job)
        assert store is not None
        location = store.location(41)
        manifest = store.dir(41).manifest()
        assert manifest is not None
        moved = await end_at_final_cut(jobs, job_id, manifest, location)
        assert (moved.state, moved.attempt, moved.config.topology.ps_shards, moved.stop_after) == (
            "recovering",
            1,
            3,
            None,
        )
        assert moved.restore is not None and (moved.restore.location, moved.restore.step) == (location, 41)
        (reshard,) = moved.reshards
        assert (reshard.state, reshard.attempt, reshard.checkpoint_step, reshard.to_shards) == ("done", 1, 41, 3)
        assert [(r.kind, r.checkpoint_step) for r in moved.recoveries] == [("reshard", 41)]
        admin = kafka.admin(jobs.kafka)
        await admin.start()
        try:
            (gradients,) = await admin.describe_topics([moved.topics.gradients])
        finally:
            await admin.close()
        assert len(gradients["partitions"]) == 3
        await jobs.transition(job_id, "stopping")
        await jobs.transition(job_id, "stopped")
        await jobs.delete(job_id)


async def test_a_cancelled_reshards_checkpoint_stops_the_job_and_an_abandoned_one_fails_it(infra, tmp_path) -> None:
    async with _coordinator(infra, tmp_path) as (jobs, registry):
        job_id = await _running(jobs)
        await request_reshard(jobs, registry, job_id, 1)
        assert await reshard_abandoned(jobs, job_id, "disk full")
        job = await jobs.require(job_id)
        assert (job.reshards[0].state, job.reshards[0].error, job.stop_after) == ("failed", "disk full", None)
        assert not await reshard_abandoned(jobs, job_id, "again")  # nothing pending: a plain stop's checkpoint
        # Cancelled between the cut and its checkpoint: the job stops at that checkpoint.
        await request_reshard(jobs, registry, job_id, 3)
        await jobs.update(job_id, lambda record: record.cancel_reshard("stopped before its checkpoint", time.time()))
        job = await jobs.require(job_id)
        ended = await end_at_final_cut(jobs, job_id, _manifest(job, 9), "/checkpoints/9")
        assert (ended.state, ended.attempt, ended.config.topology.ps_shards) == ("stopping", 0, 2)
