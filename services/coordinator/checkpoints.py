"""The coordinator's side of checkpoints: request → cut → capture → release → parts → manifest.

1. A checkpoint is asked for (the REST API, `every_seconds`) by raising the job's
   `checkpoint_seq`; the NN ranks agree on it in their per-step control all-reduce and cut
   after the same step s. `every_steps` cuts and the final cut need no request: every rank
   knows them.
2. At the cut each rank hands its gradients up to s to Kafka, then holds and says so in its
   health (`CutReport`).
3. Once every rank holds at s, a driver task waits until every PS shard has applied every
   rank's gradients up to s (the applied watermarks), asks each PS shard and data loader to
   capture its state (`POST /job/capture`), and releases the ranks (`POST /job/release`).
   Training pauses for this only.
4. The parts are written while training goes on; each worker reports its files in its health
   (`PartReport`).
5. The manifest is written last; retention keeps the newest `keep_last` (and the checkpoints
   their deltas are loaded on top of).

A PS shard writes a delta (only the rows changed since) when it captured the newest complete
checkpoint itself (`_delta_base`); every `checkpoint.full_every`-th checkpoint is full.

Anything failing on the way abandons the checkpoint: held ranks are released, its directory is
removed. A restarted coordinator drives a cut the ranks still hold from the start again (every
step of it is idempotent on the workers), and removes directories nobody finished.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import httpx
from pydantic import BaseModel, Field

from trillium.config import Role
from trillium.job.record import IllegalTransition, JobRecord
from trillium.runtime.checkpoint import (
    DENSE,
    CaptureRequest,
    CaptureResult,
    CutReport,
    JobCheckpoints,
    Manifest,
    Offsets,
    PartFile,
    PartReport,
    ReleaseRequest,
    ledger_file,
    live_head,
    loader_file,
    ps_file,
    rank_file,
    timeline,
)
from trillium.runtime.progress import JobProgress
from trillium.wire.state import aioredis

from .jobs import JobStore
from .lifecycle import recover_or_fail
from .registry import Worker, WorkerRegistry
from .reshard import end_at_final_cut, reshard_abandoned
from .retention import TopicRetention

logger = logging.getLogger("trillium.coordinator.checkpoints")

POLL_S = 0.02  # how often a driver looks at the workers' reports while the ranks hold
APPLY_TIMEOUT_S = 120.0  # the PS shards apply what the ranks pushed before the cut well within this


# The roles that hold part of a checkpoint (the embedding workers keep nothing across a cut).
STATEFUL_ROLES: tuple[Role, ...] = ("nn_worker", "embedding_ps", "data_loader")


class CheckpointAbandoned(RuntimeError):
    pass


class CheckpointInfo(BaseModel):
    """A complete checkpoint, as listed by the API."""

    step: int
    epoch: int
    attempt: int
    reason: str
    created_at: float
    bytes: int
    seconds_to_write: float
    pause_seconds: float
    location: str
    positions: Offsets
    eval: dict[str, Any] | None = None
    files: list[PartFile] = Field(default_factory=list)

    @classmethod
    def of(cls, manifest: Manifest, location: str) -> CheckpointInfo:
        return cls(
            step=manifest.step,
            epoch=manifest.epoch,
            attempt=manifest.attempt,
            reason=manifest.reason,
            created_at=manifest.created_at,
            bytes=manifest.bytes,
            seconds_to_write=manifest.seconds_to_write,
            pause_seconds=manifest.pause_seconds,
            location=location,
            positions=manifest.positions,
            eval=manifest.eval,
            files=manifest.files,
        )


class Checkpointer:
    def __init__(
        self,
        redis: aioredis.Redis,
        registry: WorkerRegistry,
        jobs: JobStore,
        retention: TopicRetention,
        http: httpx.AsyncClient,
    ) -> None:
        self.redis = redis
        self.registry = registry
        self.jobs = jobs
        self.retention = retention
        self.http = http  # the workers' HTTP ports: the token on every call, TLS checked when set
        self._drivers: dict[str, asyncio.Task[None]] = {}
        self._due: dict[tuple[str, int], float] = {}  # (job, attempt) -> when every_seconds asks next
        self._latest: dict[str, CheckpointInfo | None] = {}  # job -> newest complete checkpoint, once read
        self._writing_on: dict[str, int] = {}  # job -> the step the checkpoint being written takes deltas on

    def busy(self, job_id: str) -> bool:
        task = self._drivers.get(job_id)
        return task is not None and not task.done()

    async def close(self) -> None:
        for task in self._drivers.values():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.http.aclose()

    # ---- listing -------------------------------------------------------------------------------------
    async def list(self, job: JobRecord) -> list[CheckpointInfo]:
        store = self.jobs.checkpoints(job)
        if store is None:
            return []
        manifests = await asyncio.to_thread(store.complete)
        return [CheckpointInfo.of(m, store.location(m.step)) for m in manifests]

    async def latest(self, job: JobRecord) -> CheckpointInfo | None:
        """The newest checkpoint a recovery would restore (its live timeline's)."""
        if job.id not in self._latest:
            store = self.jobs.checkpoints(job)
            live = await asyncio.to_thread(store.live, job) if store is not None else []
            self._latest[job.id] = CheckpointInfo.of(live[-1], store.location(live[-1].step)) if live else None
        return self._latest[job.id]

    async def delete(self, job: JobRecord, step: int) -> bool:
        """Delete the checkpoint at `step` (False if there is none); IllegalTransition while a kept
        checkpoint's delta is loaded on top of it, while an attempt restores it (or a delta of
        it), or while the checkpoint being written takes deltas on it."""
        store = self.jobs.checkpoints(job)
        if store is None:
            return False
        async with self.jobs.checkpoint_files:
            job = await self.jobs.require(job.id)  # as it stands now, under the lock
            if step not in await asyncio.to_thread(store.steps):
                return False
            in_use = await asyncio.to_thread(self._in_use, job, store)
            if step in in_use:
                raise IllegalTransition(
                    f"checkpoint {step} of job {job.id} is {in_use[step]}: delete it once that is done"
                )
            dependents = await asyncio.to_thread(store.dependents, step)
            if dependents:
                raise IllegalTransition(
                    f"checkpoint {step} of job {job.id} is the base of the deltas of checkpoints "
                    f"{dependents}: delete those first"
                )
            await asyncio.to_thread(store.dir(step).remove)
        self._latest.pop(job.id, None)
        return True

    def _in_use(self, job: JobRecord, store: JobCheckpoints) -> dict[int, str]:
        """The steps a delete must leave, with why: those an attempt is restoring, and those the
        checkpoint being written takes deltas on."""
        by_step = {m.step: m for m in store.complete()}
        in_use: dict[int, str] = {}
        base = self._writing_on.get(job.id)
        if base is not None and base in by_step:
            for s in store.needed([by_step[base]], by_step):
                in_use[s] = "what the checkpoint being written takes its deltas on"
        if job.state == "recovering" and job.restore is not None and job.restore.step in by_step:
            for s in store.needed([by_step[job.restore.step]], by_step):
                in_use[s] = f"being restored by attempt {job.attempt}"
        return in_use

    # ---- the loop ------------------------------------------------------------------------------------
    async def tick(self, job: JobRecord | None) -> None:
        for job_id, task in list(self._drivers.items()):
            if task.done():
                del self._drivers[job_id]
            elif job is None or job.id != job_id or job.state not in ("running", "paused"):
                task.cancel()  # the job stopped or recovers: its cut is gone with its attempt
        if job is None or job.config.checkpoint is None or job.state not in ("running", "paused"):
            return
        if self.busy(job.id):
            return
        store = self.jobs.checkpoints(job)
        assert store is not None
        cuts = await self._cuts(job)
        if len(cuts) == job.config.topology.nn_ranks and len({c.step for c in cuts.values()}) == 1:
            self._drivers[job.id] = asyncio.create_task(self._drive(job, store, cuts), name=f"checkpoint-{job.id}")
            return
        every = job.config.checkpoint.every_seconds
        if every is not None and job.state == "running":
            now = time.monotonic()
            due = self._due.setdefault((job.id, job.attempt), now + every)
            if now >= due:
                self._due[(job.id, job.attempt)] = now + every
                await self.jobs.request_checkpoint(job.id)

    async def _cuts(self, job: JobRecord) -> dict[int, CutReport]:
        out = {}
        for w in await self.registry.workers():
            report = w.job_report(job.id, job.attempt) if w.role == "nn_worker" else None
            if report and report.get("cut"):
                out[w.index] = CutReport.model_validate(report["cut"])
        return out

    async def _participants(self, job: JobRecord) -> dict[str, list[Worker]]:
        topology = job.config.topology
        workers = {(w.role, w.index): w for w in await self.registry.workers()}
        out: dict[str, list[Worker]] = {}
        for role in STATEFUL_ROLES:
            n = topology.count(role)
            missing = [f"{role}-{i}" for i in range(n) if (role, i) not in workers]
            if missing:
                raise CheckpointAbandoned(f"{', '.join(missing)} not registered")
            out[role] = [workers[(role, i)] for i in range(n)]
        return out

    # ---- one checkpoint ------------------------------------------------------------------------------
    async def _drive(self, job: JobRecord, store: JobCheckpoints, cuts: dict[int, CutReport]) -> None:
        step = next(iter(cuts.values())).step
        ckdir = store.dir(step)
        # A stop asked with a final checkpoint: the ranks hold after this cut, the job stops once it is written.
        stopping = job.stop_after is not None and max(c.seq for c in cuts.values()) >= job.stop_after
        started = time.time()
        released = False
        try:
            # Directories left by a write that never finished (a crash, a restarted coordinator, a
            # part written late into a checkpoint abandoned for its timeout).
            await asyncio.to_thread(store.cleanup_incomplete, {step})
            workers = await self._participants(job)
            previous = await asyncio.to_thread(ckdir.manifest)
            if previous is not None and previous.attempt != job.attempt:
                await asyncio.to_thread(ckdir.remove)  # an abandoned attempt's checkpoint at the same step
            await self._wait_applied(job, step)
            request = CaptureRequest(
                job_id=job.id,
                attempt=job.attempt,
                step=step,
                location=store.location(step),
                base=await self._pin_base(job, store),
            )
            captures = await asyncio.gather(
                *(
                    self._post(w, "/job/capture", request, CaptureResult)
                    for w in workers["embedding_ps"] + workers["data_loader"]
                )
            )
            evaluate = job.config.checkpoint is not None and job.config.checkpoint.evaluate
            await self._release(job, workers["nn_worker"], step, store.location(step), evaluate, stopping)
            released = True
            pause = time.time() - min(c.at for c in cuts.values())
            reports = await self._parts(job, workers, step, job.config.checkpoint.write_timeout_seconds)
            positions: Offsets = {}
            written: Offsets = {}
            for cut in cuts.values():
                _merge(positions, cut.positions)
            for capture in captures:
                _merge(positions, capture.positions)
                _merge(written, capture.written)
            files = [f for r in reports for f in r.files]
            expected = {
                DENSE,
                *(rank_file(r) for r in range(job.config.topology.nn_ranks)),
                *(ps_file(s) for s in range(job.config.topology.ps_shards)),
                *(ledger_file(s) for s in range(job.config.topology.ps_shards)),
                *(loader_file(i) for i in range(job.config.topology.data_loaders)),
            }
            if {f.name for f in files} != expected:
                raise CheckpointAbandoned(
                    f"parts written: {sorted(f.name for f in files)}, expected {sorted(expected)}"
                )
            cut = next(iter(cuts.values()))
            before = [m.step for m in await asyncio.to_thread(store.live, job) if m.step < step]
            manifest = Manifest(
                job_id=job.id,
                attempt=job.attempt,
                step=step,
                epoch=cut.epoch,
                reason=cut.reason,
                created_at=time.time(),
                pause_seconds=pause,
                seconds_to_write=time.time() - started,
                config=job.config,
                positions=positions,
                written=written,
                lineage=job.lineage,
                files=files,
                eval=next((r.eval for r in reports if r.eval is not None), None),
                parent=before[-1] if before else None,
            )
            await asyncio.to_thread(ckdir.write_manifest, manifest)
            self._latest[job.id] = CheckpointInfo.of(manifest, store.location(step))
            deleted = await asyncio.to_thread(store.retain, job.config.checkpoint.keep_last, job)
            kept = await asyncio.to_thread(store.live, job)
            trimmed = await self.retention.trim(job, kept[-job.config.checkpoint.keep_last :][0])
            if job.config.checkpoint.every_seconds is not None:
                self._due[(job.id, job.attempt)] = time.monotonic() + job.config.checkpoint.every_seconds
            if stopping:  # or the reshard that asked for it starts its new attempt from it
                await end_at_final_cut(self.jobs, job.id, manifest, store.location(step))
            logger.info(
                "checkpoint written",
                extra={
                    "job": job.id,
                    "step": step,
                    "bytes": manifest.bytes,
                    "seconds": round(manifest.seconds_to_write, 3),
                    "pause_s": round(pause, 3),
                    "deleted": deleted,
                    "trimmed": {f"{tp.topic}/{tp.partition}": first for tp, first in trimmed.items()},
                },
            )
        except (Exception, asyncio.CancelledError) as err:
            cancelled = isinstance(err, asyncio.CancelledError)
            resharding = False  # a reshard's checkpoint: the job goes on with the shards it has
            if not cancelled:
                logger.error("checkpoint abandoned", extra={"job": job.id, "step": step, "error": str(err)})
                with contextlib.suppress(Exception):  # Redis away: the log has it
                    await asyncio.shield(self.jobs.checkpoint_failed(job.id, step, str(err)))
                if stopping:
                    with contextlib.suppress(Exception):
                        resharding = await asyncio.shield(reshard_abandoned(self.jobs, job.id, str(err)))
            if not released:
                with contextlib.suppress(Exception):
                    ranks = (await self._participants(job))["nn_worker"]
                    await asyncio.shield(self._release(job, ranks, step, None, False, stopping and not resharding))
            with contextlib.suppress(Exception):
                if await asyncio.to_thread(ckdir.manifest) is None:
                    await asyncio.to_thread(ckdir.remove)
            if stopping and not cancelled:
                with contextlib.suppress(Exception):
                    if resharding and released:  # the ranks hold at the cut: on from the last checkpoint
                        cause = f"the reshard's checkpoint at step {step} was abandoned: {err}"
                        await recover_or_fail(self.jobs, job, cause)
                    elif not resharding:  # the stop goes on, without its checkpoint
                        error = f"stopped without its final checkpoint: {err}"
                        await self.jobs.transition(
                            job.id, "stopping", expect=frozenset({"running", "paused"}), error=error
                        )
            if cancelled:
                raise
        finally:
            self._writing_on.pop(job.id, None)

    async def _pin_base(self, job: JobRecord, store: JobCheckpoints) -> tuple[int, int] | None:
        """The checkpoint this one's deltas go on (`_delta_base`), kept from deletion until the
        write ends: chosen under the same lock a delete takes."""
        async with self.jobs.checkpoint_files:
            base = await asyncio.to_thread(_delta_base, job, store)
            if base is not None:
                self._writing_on[job.id] = base[1]
        return base

    async def _wait_applied(self, job: JobRecord, step: int) -> None:
        """Until every PS shard has applied every rank's gradients up to `step`."""
        progress = JobProgress(self.redis, job.id, job.attempt)
        topo = job.config.topology
        deadline = time.monotonic() + APPLY_TIMEOUT_S
        while True:
            applied = await progress.applied()
            behind = [
                cell
                for cell in ((s, r) for s in range(topo.ps_shards) for r in range(topo.nn_ranks))
                if applied.get(cell, -1) < step
            ]
            if not behind:
                return
            if time.monotonic() > deadline:
                raise CheckpointAbandoned(f"PS shards did not apply step {step} in {APPLY_TIMEOUT_S:.0f}s: {behind}")
            await asyncio.sleep(POLL_S)

    async def _release(
        self, job: JobRecord, ranks: list[Worker], step: int, location: str | None, evaluate: bool, stop: bool = False
    ) -> None:
        request = ReleaseRequest(
            job_id=job.id, attempt=job.attempt, step=step, location=location, evaluate=evaluate, stop=stop
        )
        await asyncio.gather(*(self._post(w, "/job/release", request, None) for w in ranks))

    async def _parts(
        self, job: JobRecord, workers: dict[str, list[Worker]], step: int, timeout_s: float
    ) -> list[PartReport]:
        """Every participant's part of the checkpoint at `step`, as reported in its health."""
        names = {w.name for group in workers.values() for w in group}
        deadline = time.monotonic() + timeout_s
        while True:
            reports: dict[str, PartReport] = {}
            for w in await self.registry.workers():
                report = w.job_report(job.id, job.attempt) if w.name in names else None
                part = (report or {}).get("parts", {}).get(str(step))
                if part is not None:
                    reports[w.name] = PartReport.model_validate(part)
            failed = [f"{name}: {r.error}" for name, r in reports.items() if r.error]
            if failed:
                raise CheckpointAbandoned("; ".join(failed))
            if len(reports) == len(names):
                return list(reports.values())
            if time.monotonic() > deadline:
                raise CheckpointAbandoned(
                    f"parts not written within {timeout_s:g}s (checkpoint.write_timeout_seconds): "
                    f"{', '.join(sorted(names - reports.keys()))}"
                )
            current = await self.jobs.get(job.id)
            if current is None or current.attempt != job.attempt or current.state not in ("running", "paused"):
                raise CheckpointAbandoned(f"job {job.id} is {current.state if current else 'gone'}")
            await asyncio.sleep(0.1)

    async def _post(self, worker: Worker, path: str, body: BaseModel, answer: type[BaseModel] | None) -> Any:
        try:
            r = await self.http.post(worker.http_url + path, json=body.model_dump(mode="json"))
        except httpx.HTTPError as err:
            raise CheckpointAbandoned(f"{worker.name} did not answer {path}: {err}") from None
        if r.status_code != 200:
            raise CheckpointAbandoned(f"{worker.name} {path}: HTTP {r.status_code} {r.text[:300]}")
        return answer.model_validate(r.json()) if answer is not None else None


def _delta_base(job: JobRecord, store: JobCheckpoints) -> tuple[int, int] | None:
    """(attempt, step) of the checkpoint the PS shards may write deltas on: the newest of the live
    timeline, if it is this attempt's (a shard holds the marks of its own captures only) and its
    chain is shorter than `full_every`; None for a full checkpoint."""
    assert job.config.checkpoint is not None
    manifests = store.complete()
    live = timeline(manifests, live_head(manifests, job))
    if not live or live[-1].attempt != job.attempt:
        return None
    newest = live[-1]
    chain = store.needed([newest], {m.step: m for m in manifests})
    return (newest.attempt, newest.step) if len(chain) < job.config.checkpoint.full_every else None


def _merge(into: Offsets, more: Offsets) -> None:
    for topic, partitions in more.items():
        into.setdefault(topic, {}).update(partitions)
