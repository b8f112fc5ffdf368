"""A job whose process is lost before it has written a checkpoint starts over from the beginning,
in `starting` as in `running`: the coordinator's decision (services/coordinator/lifecycle.py) on a
real Redis and Kafka. One whose checkpoints are all refused still fails, naming why: starting over
would hide that its checkpoints are bad."""

from __future__ import annotations

from pathlib import Path

import pytest_asyncio
from written_checkpoints import write_checkpoint

from trillium.data import load_job
from trillium.job import JobConfig
from trillium.job.record import PartitionLineage
from trillium.runtime.checkpoint import DENSE
from trillium.services.coordinator.jobs import JobStore
from trillium.services.coordinator.lifecycle import recover_or_fail
from trillium.wire import state

TINY_JOB = Path(__file__).resolve().parents[1] / "data" / "tiny_job.yaml"


@pytest_asyncio.fixture(loop_scope="function")  # the test's loop: its Redis connections are of it
async def jobs(infra, tmp_path):
    """A JobStore on a Redis database of its own, emptied before and after."""
    redis = state.connect(infra.redis_database(14))
    await redis.flushdb()
    try:
        yield JobStore(redis, tmp_path, infra.kafka)
    finally:
        await redis.flushdb()
        await redis.aclose()


def _job(tmp_path: Path, max_recoveries: int) -> JobConfig:
    raw = load_job(TINY_JOB).model_dump(mode="json")
    raw["checkpoint"] = (raw.get("checkpoint") or {}) | {
        "dir": str(tmp_path / "checkpoints"),
        "max_recoveries": max_recoveries,
    }
    return JobConfig.model_validate(raw)


async def test_a_job_lost_before_its_first_checkpoint_starts_over_until_max_recoveries(jobs, tmp_path) -> None:
    job = await jobs.create(_job(tmp_path, max_recoveries=2))
    job = await jobs.transition(job.id, "starting")

    await recover_or_fail(jobs, job, "nn_worker-0: lost (no heartbeat for 10 s)")
    job = await jobs.require(job.id)
    assert (job.state, job.attempt, job.restore, job.error) == ("recovering", 1, None, None)
    ((kind, step, cause),) = [(r.kind, r.checkpoint_step, r.cause) for r in job.recoveries]
    assert (kind, step, cause) == ("recovery", None, "nn_worker-0: lost (no heartbeat for 10 s)")
    # Each rank's partitions of the loader-written topics: attempt 1's records count wherever
    # they land, attempt 0's (written before, and by a zombie after) nowhere.
    ranks = job.config.topology.nn_ranks
    assert job.lineage == {t: {r: [(0, 1)] for r in range(ranks)} for t in (job.topics.samples, job.topics.eval)}
    lineage = PartitionLineage(job.lineage[job.topics.samples][0])
    assert [lineage.counts(offset, 0) for offset in (0, 7, 10**6)] == [False] * 3
    assert [lineage.counts(offset, 1) for offset in (0, 7, 10**6)] == [True] * 3

    # Failing again before a checkpoint, from `recovering`: a second start over, then no more.
    await recover_or_fail(jobs, job, "embedding_ps-1: lost")
    job = await jobs.require(job.id)
    assert (job.state, job.attempt, [r.checkpoint_step for r in job.recoveries]) == ("recovering", 2, [None, None])
    await recover_or_fail(jobs, job, "embedding_ps-1: lost")
    job = await jobs.require(job.id)
    assert job.state == "failed" and job.attempt == 2
    assert job.error == "embedding_ps-1: lost (gave up after 2 recoveries: max_recoveries is 2)"


async def test_a_job_whose_only_checkpoint_is_refused_fails_naming_it(jobs, tmp_path) -> None:
    job = await jobs.create(_job(tmp_path, max_recoveries=3))
    job = await jobs.transition(job.id, "starting")
    job = await jobs.transition(job.id, "running")
    write_checkpoint(jobs, job, 40, {}, None)
    dense = Path(jobs.checkpoints(job).location(40)) / DENSE
    dense.write_bytes(b"not what its manifest says")

    await recover_or_fail(jobs, job, "nn_worker-1: lost")
    job = await jobs.require(job.id)
    assert (job.state, job.attempt, job.recoveries) == ("failed", 0, [])
    assert job.error.startswith(
        f"nn_worker-1: lost (job {job.id} has no complete checkpoint to recover from (refused: "
    )
    assert "40" in job.error and DENSE in job.error
