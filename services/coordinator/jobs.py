"""Jobs: their records and state machine, kept in Redis, and the loop that moves a job
through its states from what the workers report.

    submitted → starting → running ⇄ paused → stopping → finished | failed | stopped

One job runs at a time; the workers learn about it (config, topics, ranks) from the
coordinator's answer to their heartbeats and report their phase for it in their health.
"""

from __future__ import annotations

import logging
import time
import uuid

from trillium import kafka, state
from trillium.job import (ACTIVE, TRANSITIONS, IllegalTransition, JobConfig, JobRecord, JobState, Topics,
                          participants)
from trillium.progress import JobProgress

from .registry import Worker, WorkerRegistry

logger = logging.getLogger("trillium.coordinator.jobs")

class JobStore:
    def __init__(self, redis: state.aioredis.Redis) -> None:
        self.redis = redis

    def _key(self, job_id: str) -> str:
        return state.key("job", job_id, "record")

    async def get(self, job_id: str) -> JobRecord | None:
        raw = await self.redis.get(self._key(job_id))
        return JobRecord.model_validate_json(raw) if raw else None

    async def save(self, job: JobRecord) -> None:
        job.updated_at = time.time()
        await self.redis.set(self._key(job.id), job.model_dump_json())

    async def all(self) -> list[JobRecord]:
        ids = await self.redis.zrange(state.key("jobs"), 0, -1)
        jobs = [await self.get(i) for i in ids]
        return [j for j in jobs if j is not None]

    async def current(self) -> JobRecord | None:
        job_id = await self.redis.get(state.key("current_job"))
        return await self.get(job_id) if job_id else None

    async def create(self, config: JobConfig) -> JobRecord:
        current = await self.current()
        if current is not None and current.state in ACTIVE:
            raise IllegalTransition(f"job {current.id} is {current.state}; one job runs at a time")
        job_id = f"{config.name}-{uuid.uuid4().hex[:8]}"
        prefix = f"trillium.{job_id}"
        now = time.time()
        job = JobRecord(id=job_id, state="submitted", config=config, created_at=now, updated_at=now,
                        topics=Topics(samples=f"{prefix}.samples", eval=f"{prefix}.eval",
                                      gradients=f"{prefix}.gradients"))
        await self.save(job)
        await self.redis.zadd(state.key("jobs"), {job_id: now})
        await self.redis.set(state.key("current_job"), job_id)
        await JobProgress(self.redis, job_id).set_bound(config.training.staleness_bound)
        return job

    async def transition(self, job: JobRecord, to: JobState, error: str | None = None) -> JobRecord:
        if to not in TRANSITIONS[job.state]:
            raise IllegalTransition(f"job {job.id} is {job.state}; it cannot become {to}")
        logger.info("job state", extra={"job": job.id, "from": job.state, "to": to, "error": error})
        job.state = to
        if error:
            job.error = error
        if to == "running" and job.started_at is None:
            job.started_at = time.time()
        if to in ("finished", "failed", "stopped"):
            job.finished_at = time.time()
        await self.save(job)
        return job


def _job_phase(worker: Worker, job_id: str) -> str | None:
    """What a worker reports about the job in its health: setting_up, ready, done, failed."""
    job = worker.health.get("job") or {}
    return job.get("phase") if job.get("id") == job_id else None


async def advance(store: JobStore, registry: WorkerRegistry, bootstrap: str) -> None:
    """One tick of the job state machine, driven by the workers' reports."""
    job = await store.current()
    if job is None or job.state not in ACTIVE:
        return
    config = job.config
    workers = {w.name: w for w in await registry.workers()}
    needed = [f"{role}-{i}" for role, n in participants(config).items() for i in range(n)]
    missing = [name for name in needed if name not in workers]
    involved = [workers[n] for n in needed if n in workers]

    failed = [(w.name, (w.health.get("job") or {}).get("error")) for w in involved if _job_phase(w, job.id) == "failed"]
    lost = [w.name for w in involved if w.status == "lost"]
    if job.state in ("starting", "running", "paused") and (failed or lost):
        why = "; ".join(f"{n}: {e}" for n, e in failed) or f"lost contact with {', '.join(lost)}"
        await store.transition(job, "failed", why)
        return

    if job.state == "submitted":
        if missing:
            await store.transition(job, "failed", f"the stack lacks workers this job needs: {', '.join(missing)} "
                                                  "(start it with a topology at least as large as the job's)")
            return
        await kafka.ensure_topics(bootstrap, {job.topics.samples: config.topology.nn_ranks,
                                              job.topics.eval: config.topology.nn_ranks,
                                              job.topics.gradients: config.topology.ps_shards})
        await store.transition(job, "starting")
    elif job.state == "starting":
        if all(_job_phase(w, job.id) in ("ready", "done") for w in involved) and not missing:
            await store.transition(job, "running")
    elif job.state == "running":
        results = await JobProgress(store.redis, job.id).rank_results()
        if len(results) == config.topology.nn_ranks:
            job.metrics = results[0].get("eval")
            await store.transition(job, "finished")
    elif job.state == "stopping":
        if all(_job_phase(w, job.id) in (None, "stopped", "done") for w in involved):
            await store.transition(job, "stopped")
