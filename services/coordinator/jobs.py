"""Jobs: their records and the transitions of their state machine, kept in Redis (the loop
that moves a job through its states from what the workers report: `lifecycle.py`).

    submitted → starting → running ⇄ paused → stopping → finished | failed | stopped
                              ↓ ↑       ↓
                            recovering ←── failed | stopped (resume)

One job runs at a time; the workers learn about it (config, topics, ranks, attempt, state)
from the coordinator's answer to their heartbeats and report their phase for an attempt
in their health. When a process of a running job dies, the job recovers: a new attempt
starts from the last complete checkpoint (verified against its manifest; a corrupt one is
passed over for the one before), every worker rolls back to it, and the job goes on. Every
change of a record is a compare-and-set (WATCH/MULTI): the REST API and the state machine
loop never overwrite each other's changes, and a restarted coordinator picks the state
machine up from Redis where the last one left it.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from aiokafka.errors import KafkaError
from pydantic import BaseModel
from redis.exceptions import WatchError

from trillium.config import KafkaConnection
from trillium.job import JobConfig, KafkaData
from trillium.job.record import (
    ACTIVE,
    TERMINAL,
    TRANSITIONS,
    CheckpointRef,
    IllegalTransition,
    JobRecord,
    JobState,
    Recovery,
    Topics,
    extend_lineage,
    fresh_lineage,
)
from trillium.runtime.checkpoint import CorruptCheckpoint, JobCheckpoints, Manifest, default_dir, live_head, timeline
from trillium.runtime.model_store import ModelStore, model_topic
from trillium.runtime.progress import JobProgress
from trillium.wire import kafka, state

logger = logging.getLogger("trillium.coordinator.jobs")

KAFKA_PROBE_S = 1.0  # how long a recovery asks Kafka whether it is there
KAFKA_RECORDS_S = 10.0  # how long it asks whether a checkpoint's records are still there
PARSED_RECORDS = 64  # job records kept parsed (the current job's, and a listing's)
# A job's topics are kept until trimmed behind its checkpoints or deleted with it (retention.py),
# in segments small enough that a trim frees disk soon.
JOB_TOPIC_CONFIGS = {"retention.ms": "-1", "segment.bytes": str(32 << 20), "segment.ms": str(5 * 60 * 1000)}
# Dead letters are for a human to read, however old, but bounded: the newest GiB of them.
DLQ_TOPIC_CONFIGS = JOB_TOPIC_CONFIGS | {"retention.bytes": str(1 << 30)}


class JobNotFound(LookupError):
    pass


class NoCheckpoint(IllegalTransition):
    """The job has no checkpoint at all, none refused: a recovery starts it from the beginning."""


@dataclass(frozen=True)
class Picked:
    """The checkpoint a new attempt starts from, and the newer ones refused on the way."""

    manifest: Manifest
    location: str
    refused: list[str]


class CheckpointRequested(BaseModel):
    job_id: str
    seq: int
    requested_at: float
    state: str = "requested"


def _refuse_while_forgetting(job: JobRecord, what: str) -> None:
    """A forget rewrites the job's checkpoints and versions: a recovery would restore them half
    rewritten, a delete remove the record the forget marks."""
    if job.forgetting is not None:
        raise IllegalTransition(
            f"job {job.id}: forget {job.forgetting} is running on it; it can be {what} once that is done "
            "(GET /v1/forgets lists the receipts)"
        )


def _either(states: frozenset[str]) -> str:
    ordered = [s for s in TRANSITIONS if s in states]  # in the state machine's order
    return ", ".join(ordered[:-1]) + " or " + ordered[-1] if len(ordered) > 1 else ordered[0]


class JobStore:
    def __init__(self, redis: state.aioredis.Redis, shared_root: str, kafka_conn: KafkaConnection) -> None:
        self.redis = redis
        self.shared_root = shared_root  # the stack's (trillium.config.ServiceSettings.shared_root)
        self.kafka = kafka_conn
        self._current = state.CURRENT_JOB
        self._ids = state.JOBS
        # Records as last parsed, by their JSON: the loops and the API read the current job many
        # times a second, and validating a JobConfig is most of the coordinator's CPU. A record
        # read here is never changed in place (`update` parses its own).
        self._parsed: collections.OrderedDict[str, tuple[str, JobRecord]] = collections.OrderedDict()
        self.waiting_for_kafka: dict[str, float] = {}  # job -> since when its recovery waits for Kafka
        # Held while a checkpoint is deleted and while an attempt starts from one: a delete sees
        # the attempt restoring it (the record says `recovering`), or the attempt sees it gone.
        self.checkpoint_files = asyncio.Lock()
        self.unexplained_since: dict[tuple[str, int], float] = {}  # (job, attempt) -> a failure first seen (monotonic)

    @staticmethod
    def _key(job_id: str) -> str:
        return state.job_key(job_id, "record")

    def checkpoints(self, job: JobRecord) -> JobCheckpoints | None:
        return JobCheckpoints.of(job.config, job.id, self.shared_root)

    async def kafka_answers(self) -> bool:
        """Whether the cluster answers a metadata request now."""
        try:
            await kafka.wait_for_kafka(self.kafka, timeout_s=KAFKA_PROBE_S)
        except TimeoutError:
            return False
        return True

    async def get(self, job_id: str) -> JobRecord | None:
        raw = await self.redis.get(self._key(job_id))
        if not raw:
            self._parsed.pop(job_id, None)
            return None
        cached = self._parsed.get(job_id)
        if cached is not None and cached[0] == raw:
            self._parsed.move_to_end(job_id)
            return cached[1]
        job = JobRecord.model_validate_json(raw)
        self._parsed[job_id] = (raw, job)
        while len(self._parsed) > PARSED_RECORDS:
            self._parsed.popitem(last=False)
        return job

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

    async def current_json(self) -> str | None:
        """The current job's record as stored (JSON), unparsed: what a heartbeat answers."""
        job_id = await self.redis.get(self._current)
        return await self.redis.get(self._key(job_id)) if job_id else None

    def _warm_start(self, config: JobConfig) -> CheckpointRef | None:
        """The checkpoint `config.init_from` names, which must exist and be complete."""
        init = config.init_from
        if init is None:
            return None
        base = init.dir or (config.checkpoint.dir if config.checkpoint and config.checkpoint.dir else None)
        store = JobCheckpoints(base or default_dir(self.shared_root), init.job)
        manifests, refused = store.scan()
        complete = {m.step: m for m in manifests}
        if not complete:
            why = f" (refused: {'; '.join(refused.values())})" if refused else ""
            raise IllegalTransition(f"init_from: job {init.job} has no complete checkpoint in {store.base}{why}")
        step = max(complete | refused) if init.step is None else init.step
        if step in refused:
            raise IllegalTransition(f"init_from: {refused[step]}")
        if step not in complete:
            raise IllegalTransition(
                f"init_from: job {init.job} has no complete checkpoint at step {step}; it has {sorted(complete)}"
            )
        manifest = complete[step]
        for table, theirs in manifest.config.tables.items():
            ours = config.tables.get(table)
            if ours is not None and ours.ids != theirs.ids:
                raise IllegalTransition(
                    f"init_from: table {table!r} of job {init.job} has ids: {theirs.ids}, this job's ids: {ours.ids}; "
                    f"its rows are keyed in the other ID space: set tables.{table}.ids: {theirs.ids} to start from them"
                )
        for name in ("tables", "slots"):
            if getattr(manifest.config, name) != getattr(config, name):
                raise IllegalTransition(f"init_from: the {name} of job {init.job} differ from this job's")
        return CheckpointRef(location=store.location(step), step=step)

    async def create(self, config: JobConfig) -> JobRecord:
        job_id = f"{config.name}-{uuid.uuid4().hex[:8]}"
        prefix = f"trillium.{job_id}"
        now = time.time()
        warm = await asyncio.to_thread(self._warm_start, config)
        job = JobRecord(
            id=job_id,
            state="submitted",
            config=config,
            created_at=now,
            updated_at=now,
            init_from=warm,
            topics=Topics(
                samples=f"{prefix}.samples",
                eval=f"{prefix}.eval",
                gradients=f"{prefix}.gradients",
                dlq=f"{prefix}.dlq" if isinstance(config.data, KafkaData) else None,
            ),
        )
        progress = JobProgress(self.redis, job_id)
        # The bound exists before the job does: a missing bound would read as "unbounded". An
        # automatic one starts synchronous, to measure what it must hide (runtime/autobound.py).
        bound = config.training.staleness_bound
        await progress.set_bound(0 if bound == "auto" else bound)
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
                    pipe.publish(state.JOB_CHANGED, job_id)
                    await pipe.execute()
                    return job
                except WatchError:
                    continue

    async def update(self, job_id: str, change: Callable[[JobRecord], None]) -> JobRecord:
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
                    pipe.publish(state.JOB_CHANGED, job_id)
                    await pipe.execute()
                    return job
                except WatchError:
                    continue

    async def transition(
        self,
        job_id: str,
        to: JobState,
        *,
        expect: frozenset[str] | None = None,
        error: str | None = None,
        metrics: dict | None = None,
        also: Callable[[JobRecord], None] | None = None,
    ) -> JobRecord:
        """Move a job to `to` if the state machine allows it from its current state (and that
        state is in `expect`, when given), else raise IllegalTransition saying why. `also`
        changes the record in the same compare-and-set."""
        allowed = frozenset(s for s, targets in TRANSITIONS.items() if to in targets)
        if expect is not None:
            allowed &= expect

        def change(job: JobRecord) -> None:
            if job.state not in allowed:
                raise IllegalTransition(f"job {job.id} is {job.state}, not {_either(allowed)}")
            logger.info(
                "job state", extra={"job": job.id, "from": job.state, "to": to, "attempt": job.attempt, "error": error}
            )
            job.state = to
            if error:
                job.error = error
            if metrics is not None:
                job.metrics = metrics
            if to == "running" and job.started_at is None:
                job.started_at = time.time()
            if to in TERMINAL:
                job.finished_at = time.time()
            if to in TERMINAL | {"stopping"}:  # a reshard not yet at its cut never gets there
                job.cancel_reshard(f"the job was {to} first", time.time())
            if also is not None:
                also(job)

        return await self.update(job_id, change)

    async def start_attempt(
        self,
        job: JobRecord,
        pick: Picked | None,
        cause: str,
        expect: frozenset[str],
        kind: str = "recovery",
        also: Callable[[JobRecord], None] | None = None,
    ) -> JobRecord:
        """Move `job` to `recovering`: a new attempt every worker starts from the checkpoint (`also`:
        a reshard's), or from the beginning when `pick` is None (the job had written none)."""
        attempt = job.attempt + 1
        manifest = pick.manifest if pick is not None else None

        def roll_back(record: JobRecord) -> None:
            _refuse_while_forgetting(record, "resumed")
            record.attempt = attempt
            if manifest is None:
                # Restored from nothing, as attempt 0 was (its init_from kept): every record the
                # loaders wrote before is an earlier attempt's, and they write the whole job again.
                record.restore = None
                record.lineage = fresh_lineage(record, attempt)
            else:
                record.restore = CheckpointRef(location=pick.location, step=manifest.step)
                record.lineage = extend_lineage(manifest.lineage, manifest.written, attempt)
            record.recoveries.append(
                Recovery(
                    at=time.time(),
                    attempt=attempt,
                    kind=kind,
                    cause=cause,
                    checkpoint_step=manifest.step if manifest is not None else None,
                    refused=pick.refused if pick is not None else [],
                )
            )
            record.error = None
            if kind != "recovery":  # a stop (or reshard) still pending carries over a recovery only
                record.stop_after = None
            record.finished_at = None
            record.metrics = None
            if also is not None:
                also(record)

        async with self.checkpoint_files:
            store = self.checkpoints(job)
            if (
                manifest is not None
                and store is not None
                and await asyncio.to_thread(store.dir(manifest.step).manifest) is None
            ):
                raise IllegalTransition(f"job {job.id}: checkpoint {manifest.step} was deleted before it was restored")
            updated = await self.transition(job.id, "recovering", expect=expect, also=roll_back)
        await JobProgress(self.redis, job.id).clear_rank_results()
        step = manifest.step if manifest is not None else None
        logger.warning("job recovering", extra={"job": job.id, "attempt": attempt, "step": step, "cause": cause})
        return updated

    async def resume(self, job_id: str, step: int | None) -> JobRecord:
        """Resume a stopped or failed job from a checkpoint (the latest when `step` is None)."""
        job = await self.require(job_id)
        if job.state not in ("stopped", "failed"):
            raise IllegalTransition(
                f"job {job_id} is {job.state}; only a stopped or failed job resumes "
                "from a checkpoint (a paused one resumes as it is)"
            )
        _refuse_while_forgetting(job, "resumed")  # and again in the attempt's compare-and-set
        pick = await self.pick_checkpoint(job, step)
        async with self.redis.pipeline() as pipe:
            while True:
                try:
                    await pipe.watch(self._current)
                    current = await self.current()
                    if current is not None and current.id != job_id and current.state in ACTIVE:
                        raise IllegalTransition(f"job {current.id} is {current.state}; one job runs at a time")
                    pipe.multi()
                    pipe.set(self._current, job_id)
                    pipe.publish(state.JOB_CHANGED, job_id)
                    await pipe.execute()
                    break
                except WatchError:
                    continue
        return await self.start_attempt(
            job, pick, f"resumed from step {pick.manifest.step}", expect=frozenset({"stopped", "failed"}), kind="resume"
        )

    async def pick_checkpoint(self, job: JobRecord, step: int | None = None) -> Picked:
        """The newest complete checkpoint whose files match its manifest (or the one at `step`);
        IllegalTransition says why there is none."""
        store = self.checkpoints(job)
        if store is None:
            raise IllegalTransition(f"job {job.id} takes no checkpoints (checkpoint: null)")
        complete, refused = await asyncio.to_thread(store.scan)
        if step is None and (head := live_head(complete, job)) is not None:
            complete = timeline(complete, head)  # not what a resume from an older checkpoint rolled back from
        if step is not None:
            # Retention trims the topics behind the oldest of the newest keep_last: an older one is
            # kept only as the base of their deltas, its records gone (retention.py).
            settings = job.config.checkpoint
            readable = [m.step for m in complete[-settings.keep_last :]] if settings and settings.trim_topics else None
            complete = [m for m in complete if m.step == step]
            if not complete:
                why = f" ({refused[step]})" if step in refused else ""
                raise IllegalTransition(f"job {job.id} has no complete checkpoint at step {step}{why}")
            if readable is not None and step not in readable:
                raise IllegalTransition(
                    f"job {job.id}'s checkpoint at step {step} is kept only as the base of newer ones' deltas: "
                    f"the records after it are trimmed (checkpoint.trim_topics); resume from step "
                    f"{', '.join(map(str, readable))}"
                )
        # The manifests refused (corrupt, or of a newer format) newer than the one picked, newest first.
        newest = complete[-1].step if complete else -1
        problems = [why for s, why in sorted(refused.items(), reverse=True) if s > newest and step is None]
        for manifest in reversed(complete):
            try:
                await asyncio.to_thread(store.dir(manifest.step).verify, manifest)
            except CorruptCheckpoint as err:
                logger.error("checkpoint refused", extra={"job": job.id, "step": manifest.step, "error": str(err)})
                problems.append(str(err))
                continue
            gone = await self._records_gone(job, manifest)
            if not gone:
                return Picked(manifest, store.location(manifest.step), problems)
            logger.error("checkpoint refused", extra={"job": job.id, "step": manifest.step, "error": str(gone[0])})
            problems.append(f"checkpoint at step {manifest.step}: {gone[0]}")
        if not problems and step is None:
            raise NoCheckpoint(f"job {job.id} has no complete checkpoint to recover from")
        raise IllegalTransition(
            f"job {job.id} has no complete checkpoint to recover from"
            + (f" (refused: {'; '.join(problems)})" if problems else "")
        )

    async def _records_gone(self, job: JobRecord, manifest: Manifest) -> list[kafka.RecordsGone]:
        """The positions of a checkpoint's readers whose records are gone (trimmed by retention):
        a recovery from it would have a gap. A stream's input topics count unless the job skips
        their gaps (`data.on_gap: skip`). A broker that does not answer refuses none: the readers
        refuse a gap themselves (`kafka.fetch`)."""
        positions = manifest.positions
        data = job.config.data
        if isinstance(data, KafkaData) and data.on_gap == "skip":
            positions = {t: p for t, p in positions.items() if t not in data.input_topics}
        try:
            return await asyncio.wait_for(kafka.records_gone(self.kafka, positions), KAFKA_RECORDS_S)
        except (KafkaError, TimeoutError) as err:
            logger.warning("checkpoint's records not checked", extra={"step": manifest.step, "error": repr(err)})
            return []

    async def create_topics(self, job: JobRecord) -> None:
        """The job's topics: trimmed behind its checkpoints, deleted once it finished or is
        deleted (retention.py); a recovery or a resume, however late, re-reads them from its
        checkpoint's positions."""
        topo = job.config.topology
        topics = {
            job.topics.samples: topo.nn_ranks,
            job.topics.eval: topo.nn_ranks,
            job.topics.gradients: topo.ps_shards,
        }
        await kafka.ensure_topics(self.kafka, topics, JOB_TOPIC_CONFIGS)
        if job.topics.dlq is not None:
            await kafka.ensure_topics(self.kafka, {job.topics.dlq: 1}, DLQ_TOPIC_CONFIGS)
        models = ModelStore.of(job.config, self.shared_root)
        if models is not None:  # the model's notices: they only say what the store holds, a day of them
            await kafka.ensure_topics(
                self.kafka, {model_topic(models.model): 1}, {"retention.ms": str(24 * 3600 * 1000)}
            )

    async def delete(self, job_id: str) -> JobRecord:
        """Forget a finished, failed or stopped job: every key it has in Redis and its Kafka
        topics (its checkpoints stay: other jobs may start from them)."""
        key = self._key(job_id)
        async with self.redis.pipeline() as pipe:
            while True:
                try:
                    await pipe.watch(key, self._current)
                    job = await self.require(job_id)
                    if job.state not in TERMINAL:
                        raise IllegalTransition(
                            f"job {job_id} is {job.state}; only a finished, failed or "
                            "stopped job can be deleted (stop it first)"
                        )
                    _refuse_while_forgetting(job, "deleted")
                    is_current = await pipe.get(self._current) == job_id
                    pipe.multi()
                    pipe.delete(key)
                    pipe.zrem(self._ids, job_id)
                    if is_current:
                        pipe.delete(self._current)
                    pipe.publish(state.JOB_CHANGED, job_id)
                    await pipe.execute()
                    break
                except WatchError:
                    continue
        await JobProgress(self.redis, job_id).delete()
        await kafka.delete_topics(self.kafka, [t for t in job.topics.model_dump().values() if t is not None])
        return job

    async def request_stop(self, job_id: str, checkpoint: bool) -> JobRecord:
        """Stop an active job. With `checkpoint` (a running or paused job that takes checkpoints and
        has trained a step), as a savepoint: a checkpoint is asked for, the ranks cut at the step
        after they agree on it and hold there, and the job goes `stopping` once that checkpoint is
        written (services/coordinator/checkpoints.py), so that `resume` goes on from the very step it
        stopped at. Otherwise it goes `stopping` at once."""
        job = await self.require(job_id)
        trained = (await JobProgress(self.redis, job_id).training(job.config.topology.nn_ranks))["steps"]
        if checkpoint and job.config.checkpoint is not None and job.state in ("running", "paused") and trained:

            def ask(record: JobRecord) -> None:
                if record.state not in ("running", "paused"):
                    raise IllegalTransition(f"job {job_id} is {record.state}, not running or paused")
                if record.stop_after is None:  # a second stop waits for the same checkpoint
                    record.checkpoint_seq += 1
                    record.stop_after = record.checkpoint_seq
                record.cancel_reshard("stopped before its checkpoint", time.time())  # the job stops at that checkpoint

            try:
                return await self.update(job_id, ask)
            except IllegalTransition:
                pass  # it moved meanwhile (finished, recovering...): stop it as it is
        return await self.transition(job_id, "stopping", expect=frozenset(ACTIVE - {"stopping"}))

    async def request_publish(self, job_id: str) -> None:
        """Ask a running job for a model version (the ranks cut at the step after they agree on it)."""

        def ask(job: JobRecord) -> None:
            if job.state == "running" and job.config.publish is not None:
                job.publish_seq += 1

        await self.update(job_id, ask)

    async def checkpoint_failed(self, job_id: str, step: int, error: str) -> None:
        def count(job: JobRecord) -> None:
            failures = job.checkpoint_failures
            failures.count += 1
            failures.last_step, failures.last_error, failures.last_at = step, error, time.time()

        await self.update(job_id, count)

    async def request_checkpoint(self, job_id: str) -> CheckpointRequested:
        def ask(job: JobRecord) -> None:
            if job.state not in ("running", "paused"):
                raise IllegalTransition(
                    f"job {job_id} is {job.state}; only a running or paused job can be checkpointed"
                )
            if job.config.checkpoint is None:
                raise IllegalTransition(f"job {job_id} takes no checkpoints (checkpoint: null)")
            job.checkpoint_seq += 1

        job = await self.update(job_id, ask)
        return CheckpointRequested(job_id=job_id, seq=job.checkpoint_seq, requested_at=job.updated_at)

    async def set_bound(self, job_id: str, bound: int | None) -> JobRecord:
        """Change an active job's live staleness bound; the embedding workers apply it to their next
        lookup. Returns the job as it is."""
        job = await self.require(job_id)
        if job.state not in ACTIVE - {"stopping"}:
            raise IllegalTransition(f"job {job_id} is {job.state}; its staleness bound can no longer change")
        await JobProgress(self.redis, job_id).set_bound(bound)
        return job
