"""The loop that moves the current job through its states (`jobs.py` keeps the records) from
what its workers report in their heartbeats: a job starts once every worker it needs is ready,
finishes once its ranks' results are in and its last checkpoint and version are written, and
recovers, or fails, when a worker fails or goes silent."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from trillium.job import JobConfig
from trillium.job.record import ACTIVE, IllegalTransition, JobRecord
from trillium.runtime.progress import JobProgress

from .jobs import JobStore, NoCheckpoint
from .registry import WorkerRegistry, failure_cause, failure_explained

logger = logging.getLogger("trillium.coordinator.lifecycle")

REGISTRATION_GRACE_S = 60.0  # how long a new job waits for the workers it needs to register
RECOVERY_GRACE_S = 300.0  # how long a recovering job waits for a silent worker (being restarted)
FAILURE_SETTLE_S = 5.0  # how long a failure no report explains waits for one that does


def needed(config: JobConfig) -> list[str]:
    return [f"{role}-{i}" for role, n in config.topology.workers().items() for i in range(n)]


async def lost_workers(registry: WorkerRegistry, job: JobRecord) -> list[str]:
    """The active job's workers the coordinator has not heard from in time (or that are gone)."""
    if job.state not in ACTIVE:
        return []
    workers = {w.name: w for w in await registry.workers()}
    return [n for n in needed(job.config) if n not in workers or workers[n].status == "lost"]


async def advance(
    store: JobStore, registry: WorkerRegistry, writing: Callable[[JobRecord, dict[int, dict]], bool]
) -> None:
    """One tick of the job state machine, driven by the workers' reports. `writing(job, results)`
    says whether the job's last checkpoint or model version is still being written, its ranks'
    `results` in (the job finishes only after them)."""
    job = await store.current()
    if job is None or job.state not in ACTIVE:
        return
    try:
        await _advance(store, registry, job, writing)
    except IllegalTransition as err:
        # The API moved the job meanwhile (paused, stopped it): the next tick sees that.
        logger.debug("job moved under the state machine", extra={"job": job.id, "error": str(err)})


async def _advance(
    store: JobStore, registry: WorkerRegistry, job: JobRecord, writing: Callable[[JobRecord, dict[int, dict]], bool]
) -> None:
    config = job.config
    workers = {w.name: w for w in await registry.workers()}
    names = needed(config)
    missing = [name for name in names if name not in workers]
    involved = [workers[n] for n in names if n in workers]
    phases = {w.name: w.job_phase(job.id, job.attempt) for w in involved}

    failed = [(w.name, w.job_error()) for w in involved if phases[w.name] == "failed"]
    lost = [w.name for w in involved if w.status == "lost"]
    if job.state == "recovering" and lost and not failed:
        # A worker being restarted is silent until it registers again: give it time, rather
        # than starting attempt after attempt for the same death.
        since = job.recoveries[-1].at if job.recoveries else job.updated_at
        if time.time() - since < RECOVERY_GRACE_S:
            return
        lost = [f"{name} (not back after {RECOVERY_GRACE_S:.0f}s)" for name in lost]
    if job.state in ("starting", "running", "paused", "recovering") and (failed or lost):
        if not failure_explained(failed, lost, workers):
            # gRPC hid the status: wait for the restarted process's report, or a caller's naming it.
            since = store.unexplained_since.setdefault((job.id, job.attempt), time.monotonic())
            if time.monotonic() - since < FAILURE_SETTLE_S:
                return
        store.unexplained_since.pop((job.id, job.attempt), None)
        final = [f"{w.name}: {w.job_error()}" for w in involved if w.job_final(job.id, job.attempt)]
        if final:  # a new attempt would meet it again
            await store.transition(job.id, "failed", expect=frozenset({job.state}), error=final[0])
            return
        await recover_or_fail(store, job, failure_cause(failed, lost, workers))
        return

    if job.state == "submitted":
        if missing:
            # A worker restarting (an NN rank leaving an earlier job's attempt) registers within seconds.
            if time.time() - job.created_at < REGISTRATION_GRACE_S:
                return
            await store.transition(
                job.id,
                "failed",
                error=f"the stack lacks workers this job needs: {', '.join(missing)} "
                "(start it with a topology at least as large as the job's)",
            )
            return
        await store.create_topics(job)
        await store.transition(job.id, "starting")
    elif job.state in ("starting", "recovering"):
        if not missing and all(phases[n] in ("ready", "done") for n in names):
            await store.transition(job.id, "running")
    elif job.state == "running":
        results = await JobProgress(store.redis, job.id).rank_results()
        if len(results) == config.topology.nn_ranks and not writing(job, results):
            await store.transition(job.id, "finished", metrics=results[0].get("eval"))
    elif job.state == "stopping":
        if lost:
            await store.transition(job.id, "failed", error=f"lost contact with {', '.join(lost)} while stopping")
        elif all(phases[n] in (None, "stopped", "done", "failed") for n in phases):
            await store.transition(job.id, "stopped")


async def recover_or_fail(store: JobStore, job: JobRecord, cause: str) -> None:
    """A process of the job failed: start a new attempt from the last checkpoint if the job
    can recover (from the beginning if it has written none yet), else fail it with a one-line
    reason."""
    expect = frozenset({job.state})
    if job.config.checkpoint is None:
        await store.transition(
            job.id, "failed", expect=expect, error=f"{cause} (the job takes no checkpoints: checkpoint: null)"
        )
        return
    if not await store.kafka_answers():
        # Kafka is away (a broker restarting): an attempt now would fail at once, and again, and
        # use up max_recoveries in seconds. The job recovers once Kafka answers again.
        if job.id not in store.waiting_for_kafka:
            store.waiting_for_kafka[job.id] = time.time()
            logger.warning("the job waits for Kafka before it recovers", extra={"job": job.id, "cause": cause})
        return
    store.waiting_for_kafka.pop(job.id, None)
    limit = job.config.checkpoint.max_recoveries
    recoveries = sum(1 for r in job.recoveries if r.kind == "recovery")
    if recoveries >= limit:
        await store.transition(
            job.id,
            "failed",
            expect=expect,
            error=f"{cause} (gave up after {recoveries} recoveries: max_recoveries is {limit})",
        )
        return
    try:
        pick = await store.pick_checkpoint(job)
    except NoCheckpoint:
        # As TorchElastic restarts a job's workers: what a failed attempt wrote is skipped
        # (its attempt), never lost, so starting over repeats nothing. Its topics are made again
        # if they are not there: nothing of them is needed.
        await store.create_topics(job)
        pick = None
    except IllegalTransition as err:
        await store.transition(job.id, "failed", expect=expect, error=f"{cause} ({err})")
        return
    await store.start_attempt(job, pick, cause, expect=expect)
