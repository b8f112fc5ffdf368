"""Jobs: their records and state machine, kept in Redis, and the loop that moves a job
through its states from what the workers report.

    submitted → starting → running ⇄ paused → stopping → finished | failed | stopped

One job runs at a time; the workers learn about it (config, topics, ranks, state) from the
coordinator's answer to their heartbeats and report their phase for it in their health.
Every change of a record is a compare-and-set (WATCH/MULTI): the REST API and the state
machine loop never overwrite each other's changes, and a restarted coordinator picks the
state machine up from Redis where the last one left it.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from typing import Literal

from pydantic import BaseModel
from redis.exceptions import WatchError

from trillium import kafka, state
from trillium.config import KafkaConnection
from trillium.job import (ACTIVE, TRANSITIONS, IllegalTransition, JobConfig, JobRecord, JobState, Topics,
                          participants)
from trillium.progress import JobProgress

from .registry import WorkerRegistry

logger = logging.getLogger("trillium.coordinator.jobs")

TERMINAL: frozenset[str] = frozenset(TRANSITIONS) - ACTIVE


class JobNotFound(LookupError):
    pass


class CheckpointRequest(BaseModel):
    """A request to checkpoint a job. Recorded only: writing checkpoints is not implemented yet."""

    id: str
    job_id: str
    requested_at: float
    state: Literal["requested"] = "requested"


def _either(states: frozenset[str]) -> str:
    ordered = [s for s in TRANSITIONS if s in states]  # in the state machine's order
    return ", ".join(ordered[:-1]) + " or " + ordered[-1] if len(ordered) > 1 else ordered[0]


class JobStore:
    def __init__(self, redis: state.aioredis.Redis) -> None:
        self.redis = redis
        self._current = state.key("current_job")
        self._ids = state.key("jobs")

    @staticmethod
    def _key(job_id: str) -> str:
        return state.key("job", job_id, "record")

    @staticmethod
    def _checkpoints(job_id: str) -> str:
        return state.key("job", job_id, "checkpoints")

    async def get(self, job_id: str) -> JobRecord | None:
        raw = await self.redis.get(self._key(job_id))
        return JobRecord.model_validate_json(raw) if raw else None

    async def require(self, job_id: str) -> JobRecord:
        job = await self.get(job_id)
        if job is None:
            raise JobNotFound(f"no job {job_id!r}")
        return job

    async def all(self) -> list[JobRecord]:
        ids = await self.redis.zrange(self._ids, 0, -1)
        jobs = [await self.get(i) for i in ids]
        return [j for j in jobs if j is not None]

    async def current(self) -> JobRecord | None:
        job_id = await self.redis.get(self._current)
        return await self.get(job_id) if job_id else None

    async def create(self, config: JobConfig) -> JobRecord:
        job_id = f"{config.name}-{uuid.uuid4().hex[:8]}"
        prefix = f"trillium.{job_id}"
        now = time.time()
        job = JobRecord(id=job_id, state="submitted", config=config, created_at=now, updated_at=now,
                        topics=Topics(samples=f"{prefix}.samples", eval=f"{prefix}.eval",
                                      gradients=f"{prefix}.gradients"))
        progress = JobProgress(self.redis, job_id)
        # The bound exists before the job does: a missing bound would read as "unbounded".
        await progress.set_bound(config.training.staleness_bound)
        async with self.redis.pipeline() as pipe:
            while True:
                try:
                    await pipe.watch(self._current)
                    current = await self.current()
                    if current is not None and current.state in ACTIVE:
                        await progress.delete()
                        raise IllegalTransition(f"job {current.id} is {current.state}; one job runs at a time")
                    pipe.multi()
                    pipe.set(self._key(job_id), job.model_dump_json())
                    pipe.zadd(self._ids, {job_id: now})
                    pipe.set(self._current, job_id)
                    await pipe.execute()
                    return job
                except WatchError:
                    continue

    async def _update(self, job_id: str, change: Callable[[JobRecord], None]) -> JobRecord:
        """Read-modify-write one record, retried if it changed in between."""
        key = self._key(job_id)
        async with self.redis.pipeline() as pipe:
            while True:
                try:
                    await pipe.watch(key)
                    raw = await pipe.get(key)
                    if raw is None:
                        raise JobNotFound(f"no job {job_id!r}")
                    job = JobRecord.model_validate_json(raw)
                    change(job)
                    job.updated_at = time.time()
                    pipe.multi()
                    pipe.set(key, job.model_dump_json())
                    await pipe.execute()
                    return job
                except WatchError:
                    continue

    async def transition(self, job_id: str, to: JobState, *, expect: frozenset[str] | None = None,
                         error: str | None = None, metrics: dict | None = None) -> JobRecord:
        """Move a job to `to` if the state machine allows it from its current state (and that
        state is in `expect`, when given), else raise IllegalTransition saying why."""
        allowed = frozenset(s for s, targets in TRANSITIONS.items() if to in targets)
        if expect is not None:
            allowed &= expect

        def change(job: JobRecord) -> None:
            if job.state not in allowed:
                raise IllegalTransition(f"job {job.id} is {job.state}, not {_either(allowed)}")
            logger.info("job state", extra={"job": job.id, "from": job.state, "to": to, "error": error})
            job.state = to
            if error:
                job.error = error
            if metrics is not None:
                job.metrics = metrics
            if to == "running" and job.started_at is None:
                job.started_at = time.time()
            if to in TERMINAL:
                job.finished_at = time.time()

        return await self._update(job_id, change)

    async def delete(self, job_id: str) -> None:
        """Forget a finished, failed or stopped job and every key it has in Redis."""
        key = self._key(job_id)
        async with self.redis.pipeline() as pipe:
            while True:
                try:
                    await pipe.watch(key, self._current)
                    job = await self.require(job_id)
                    if job.state not in TERMINAL:
                        raise IllegalTransition(f"job {job_id} is {job.state}; only a finished, failed or "
                                                "stopped job can be deleted (stop it first)")
                    is_current = await pipe.get(self._current) == job_id
                    pipe.multi()
                    pipe.delete(key)
                    pipe.zrem(self._ids, job_id)
                    if is_current:
                        pipe.delete(self._current)
                    await pipe.execute()
                    break
                except WatchError:
                    continue
        await JobProgress(self.redis, job_id).delete()

    async def request_checkpoint(self, job_id: str) -> CheckpointRequest:
        job = await self.require(job_id)
        if job.state not in ("running", "paused"):
            raise IllegalTransition(f"job {job_id} is {job.state}; only a running or paused job can be checkpointed")
        request = CheckpointRequest(id=f"ckpt-{uuid.uuid4().hex[:12]}", job_id=job_id, requested_at=time.time())
        await self.redis.rpush(self._checkpoints(job_id), request.model_dump_json())
        return request

    async def checkpoints(self, job_id: str) -> list[CheckpointRequest]:
        await self.require(job_id)
        return [CheckpointRequest.model_validate_json(r)
                for r in await self.redis.lrange(self._checkpoints(job_id), 0, -1)]


def _needed(config: JobConfig) -> list[str]:
    return [f"{role}-{i}" for role, n in participants(config).items() for i in range(n)]


async def lost_workers(registry: WorkerRegistry, job: JobRecord) -> list[str]:
    """The active job's workers the coordinator has not heard from in time (or that are gone)."""
    if job.state not in ACTIVE:
        return []
    workers = {w.name: w for w in await registry.workers()}
    return [n for n in _needed(job.config) if n not in workers or workers[n].status == "lost"]


async def advance(store: JobStore, registry: WorkerRegistry, kafka_conn: KafkaConnection) -> None:
    """One tick of the job state machine, driven by the workers' reports."""
    job = await store.current()
    if job is None or job.state not in ACTIVE:
        return
    try:
        await _advance(store, registry, kafka_conn, job)
    except IllegalTransition as err:
        # The API moved the job meanwhile (paused, stopped it): the next tick sees that.
        logger.debug("job moved under the state machine", extra={"job": job.id, "error": str(err)})


async def _advance(store: JobStore, registry: WorkerRegistry, kafka_conn: KafkaConnection, job: JobRecord) -> None:
    config = job.config
    workers = {w.name: w for w in await registry.workers()}
    needed = _needed(config)
    missing = [name for name in needed if name not in workers]
    involved = [workers[n] for n in needed if n in workers]

    failed = [(w.name, w.job_error()) for w in involved if w.job_phase(job.id) == "failed"]
    lost = [w.name for w in involved if w.status == "lost"]
    if job.state in ("starting", "running", "paused") and (failed or lost):
        why = "; ".join(f"{n}: {e}" for n, e in failed) or f"lost contact with {', '.join(lost)}"
        await store.transition(job.id, "failed", error=why)
        return

    if job.state == "submitted":
        if missing:
            await store.transition(job.id, "failed",
                                   error=f"the stack lacks workers this job needs: {', '.join(missing)} "
                                   "(start it with a topology at least as large as the job's)")
            return
        await kafka.ensure_topics(kafka_conn, {job.topics.samples: config.topology.nn_ranks,
                                              job.topics.eval: config.topology.nn_ranks,
                                              job.topics.gradients: config.topology.ps_shards})
        await store.transition(job.id, "starting")
    elif job.state == "starting":
        if all(w.job_phase(job.id) in ("ready", "done") for w in involved) and not missing:
            await store.transition(job.id, "running")
    elif job.state == "running":
        results = await JobProgress(store.redis, job.id).rank_results()
        if len(results) == config.topology.nn_ranks:
            await store.transition(job.id, "finished", metrics=results[0].get("eval"))
    elif job.state == "stopping":
        if lost:
            await store.transition(job.id, "failed", error=f"lost contact with {', '.join(lost)} while stopping")
        elif all(w.job_phase(job.id) in (None, "stopped", "done", "failed") for w in involved):
            await store.transition(job.id, "stopped")
