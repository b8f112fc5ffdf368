"""The coordinator's side of publishing a model: request → cut → parts → version → notice.

1. A version is asked for every `publish.every_seconds` of a running job, by raising its
   `publish_seq`; the NN ranks agree on it in their step's control words and cut after the same
   step s, **without holding**. A checkpoint cut (with `publish.at_checkpoints`) is a publish cut
   too, and so is the last step of a job: every rank knows those.
2. At the cut each rank flags its gradients of step s; the embedding worker carries the flag into
   the gradient messages, so every PS shard learns of the cut in-band, in step order: after
   applying step s, before s+1, it captures the rows changed since the version the job's
   `published` names (or all of them) and writes them as its values file. The last step has no
   step after it to wait for: once every shard has applied it, the coordinator asks each shard to
   export (`POST /job/export`). Rank 0 writes the dense weights; every rank reports the cut in its
   health. (The job's own evaluation at a cut — after the last step, at an evaluated checkpoint —
   leaves its predictions beside the cut's files, `eval.npy`, whatever became of the version.)
3. Once every rank has reported the cut at s, and every PS shard and rank 0 their files, the
   version's manifest is written, numbered next for the model: the version exists.
4. It is announced on `trillium.<model>.model`, recorded in the model registry (Redis) and in
   the job's record (`published`: the base the shards diff from next), and retention runs.

A version that fails on the way (a part not written, a cut not finished in `CUT_TIMEOUT_S`) is
abandoned: its files are removed, the job goes on, the next version diffs from the same base.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client import Counter, Gauge, Histogram

from trillium.config import KafkaConnection
from trillium.job.record import JobRecord, Published
from trillium.runtime.model_registry import BadRegistryEntry, ModelRegistry, RegisteredModel
from trillium.runtime.model_store import (
    DENSE,
    ExportRequest,
    ModelPart,
    ModelStore,
    PublishCut,
    VersionManifest,
    cuts_after,
    model_topic,
    parts_name,
    ps_values,
)
from trillium.runtime.progress import JobProgress
from trillium.wire import kafka

from .jobs import JobStore
from .registry import Worker, WorkerRegistry

logger = logging.getLogger("trillium.coordinator.publish")

CUT_TIMEOUT_S = 300.0  # a cut whose files are not all reported by then is abandoned

VERSIONS = Gauge("trillium_job_model_version", "the newest version the job published", ["job"])
PUBLISH_SECONDS = Histogram(
    "trillium_job_publish_seconds",
    "from a cut to its version's commit",
    ["job"],
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60),
)
ABANDONED = Counter("trillium_job_versions_abandoned_total", "publish cuts abandoned", ["job"])


@dataclass
class _Job:
    """What the publisher keeps of the current attempt of a job."""

    due: float
    done: set[int] = field(default_factory=set)  # steps committed or abandoned
    pending: set[int] = field(default_factory=set)  # steps cut, their versions not yet committed
    exports: set[int] = field(default_factory=set)  # final steps the PS shards were asked to export
    failures: list[str] = field(default_factory=list)


class Publisher:
    def __init__(
        self,
        jobs: JobStore,
        registry: WorkerRegistry,
        kafka_conn: KafkaConnection,
        shared_root: str,
        http: httpx.AsyncClient,
    ) -> None:
        self.jobs = jobs
        self.registry = registry
        self.kafka = kafka_conn
        self.shared_root = shared_root
        self.http = http  # the workers' HTTP ports: the token on every call, TLS checked when set
        self.models_registry = ModelRegistry(jobs.redis)
        self._producer = None
        self._attempts: dict[tuple[str, int], _Job] = {}
        self._next_version: dict[str, int] = {}  # model -> the number its next version takes

    async def close(self) -> None:
        if self._producer is not None:
            await self._producer.stop()
        await self.http.aclose()

    def final_done(self, job: JobRecord, results: dict[int, dict]) -> bool:
        """Whether the version of the cut after a job's last step is committed (or abandoned): the
        job finishes after it. `results`: the ranks', which say how many steps they trained."""
        last = max((r.get("steps", 0) for r in results.values()), default=0) - 1
        if job.config.publish is None or last < 0:
            return True
        held = self._attempts.get((job.id, job.attempt))
        return held is not None and last in held.done

    def failures(self, job: JobRecord) -> list[str]:
        held = self._attempts.get((job.id, job.attempt))
        return list(held.failures) if held is not None else []

    async def models(self) -> list[RegisteredModel]:
        """Every model published, by name, as `_announce` records it in the model registry (an
        unreadable entry logged and left out)."""
        models = []
        for entry in (await self.models_registry.models()).values():
            if isinstance(entry, BadRegistryEntry):
                logger.warning("model registry entry skipped", extra={"error": str(entry)})
            else:
                models.append(entry)
        return models

    # ---- the loop --------------------------------------------------------------------------------
    async def tick(self, job: JobRecord | None) -> None:
        if job is None or job.config.publish is None or job.state not in ("running", "paused", "stopping"):
            return
        store = ModelStore.of(job.config, self.shared_root)
        assert store is not None
        held = self._attempts.setdefault((job.id, job.attempt), _Job(due=time.monotonic()))
        every = job.config.publish.every_seconds
        if every is not None and job.state == "running" and time.monotonic() >= held.due:
            held.due = time.monotonic() + every
            await self.jobs.request_publish(job.id)
        topology = job.config.topology
        by_name = {w.name: w for w in await self.registry.workers()}
        ranks_heard = [by_name[f"nn_worker-{r}"] for r in range(topology.nn_ranks) if f"nn_worker-{r}" in by_name]
        cuts = _reports(ranks_heard, job, "publish_cuts", PublishCut)
        # The files of a version come from every PS shard and from rank 0 (the dense weights).
        writers = [f"embedding_ps-{s}" for s in range(topology.ps_shards)] + ["nn_worker-0"]
        parts = {
            name: _reports([by_name[name]], job, "model_parts", ModelPart) if name in by_name else {}
            for name in writers
        }
        held.pending = {step for step in cuts if step not in held.done}
        for step in sorted(held.pending):
            ranks = cuts[step]
            if len(ranks) < job.config.topology.nn_ranks:
                continue  # the other ranks report this step's cut within a step
            cut = next(iter(ranks.values()))
            if cut.reason == "final" and step not in held.exports:
                shards = [by_name.get(f"embedding_ps-{s}") for s in range(topology.ps_shards)]
                if await self._applied(job, step) and await self._export(job, shards, step):
                    held.exports.add(step)
                continue
            mine = {name: by_step.get(step) for name, by_step in parts.items()}
            failed = [f"{name}: {part.error}" for name, part in mine.items() if part is not None and part.error]
            missing = [name for name, part in mine.items() if part is None]
            if failed or (missing and time.time() - cut.at > CUT_TIMEOUT_S):
                await self._abandon(job, store, held, step, "; ".join(failed) or f"no files from {', '.join(missing)}")
            elif not missing:
                await self._commit(job, store, held, ranks, mine)

    async def _applied(self, job: JobRecord, step: int) -> bool:
        applied = await JobProgress(self.jobs.redis, job.id, job.attempt).applied()
        topo = job.config.topology
        return all(applied.get((s, r), -1) >= step for s in range(topo.ps_shards) for r in range(topo.nn_ranks))

    async def _export(self, job: JobRecord, shards: list[Worker | None], step: int) -> bool:
        """Ask every PS shard to export the cut after the last step; whether all did (else asked again)."""
        request = ExportRequest(job_id=job.id, attempt=job.attempt, step=step).model_dump(mode="json")
        for shard in shards:
            try:
                if shard is None:
                    raise httpx.HTTPError("not registered")
                (await self.http.post(shard.http_url + "/job/export", json=request)).raise_for_status()
            except httpx.HTTPError as err:
                logger.warning("export request failed", extra={"job": job.id, "step": step, "error": str(err)})
                return False
        return True

    # ---- one version -----------------------------------------------------------------------------
    async def _commit(
        self,
        job: JobRecord,
        store: ModelStore,
        held: _Job,
        ranks: dict[int, PublishCut],
        parts: dict[str, ModelPart | None],
    ) -> None:
        cut = ranks[0]
        files = [f for part in parts.values() if part is not None for f in part.files]
        values = [f for f in files if f.shard is not None]
        expected = {DENSE, *(ps_values(s) for s in range(job.config.topology.ps_shards))}
        if {f.name for f in files} != expected:
            await self._abandon(
                job, store, held, cut.step, f"files {sorted(f.name for f in files)}, expected {sorted(expected)}"
            )
            return
        bases = {f.base for f in values if not f.full}
        published = job.published if job.published is not None and job.published.attempt == job.attempt else None
        if bases and (published is None or any(b is None or b > published.version for b in bases)):
            await self._abandon(job, store, held, cut.step, f"deltas of versions {sorted(bases)} not committed")
            return
        version = await self._number(store)
        loader_stats = await JobProgress(self.jobs.redis, job.id).dense_stats()
        manifest = VersionManifest(
            model=store.model,
            version=version,
            job_id=job.id,
            attempt=job.attempt,
            step=cut.step,
            epoch=cut.epoch,
            cut_at=max(c.at for c in ranks.values()),
            created_at=time.time(),
            event_time=max((c.event_time for c in ranks.values() if c.event_time is not None), default=None),
            low_watermark=low_watermark([c.complete_through for c in ranks.values()]),
            kind="delta" if bases else "full",
            base=max(bases) if bases else None,
            parts=parts_name(job.id, job.attempt, cut.step),
            files=files,
            dtype=job.config.publish.dtype,
            config=job.config,
            dense_stats=loader_stats,
        )
        await asyncio.to_thread(store.commit, manifest)
        self._next_version[store.model] = version + 1
        held.done.add(cut.step)
        await self.jobs.update(
            job.id,
            lambda record: setattr(record, "published", Published(version=version, attempt=job.attempt, step=cut.step)),
        )
        await self._announce(store, manifest)
        # A cut after this one may be being written before any rank has reported it (rank 0
        # writes its dense weights at the cut): its directory is not an abandoned one.
        pending = {parts_name(job.id, job.attempt, step) for step in held.pending}
        after = cuts_after(job.id, job.attempt, cut.step)
        deleted = await asyncio.to_thread(
            store.retain, job.config.publish.keep_last, lambda name: name in pending or after(name)
        )
        VERSIONS.labels(job.id).set(version)
        PUBLISH_SECONDS.labels(job.id).observe(manifest.created_at - manifest.cut_at)
        logger.info(
            "version published",
            extra={
                "model": store.model,
                "version": version,
                "step": cut.step,
                "kind": manifest.kind,
                "bytes": manifest.bytes,
                "deleted": deleted,
            },
        )

    async def _number(self, store: ModelStore) -> int:
        """The next version of the model: one past the store's newest (the coordinator is its one writer)."""
        if store.model not in self._next_version:
            versions = await asyncio.to_thread(store.versions)
            self._next_version[store.model] = (versions[-1] if versions else 0) + 1
        return self._next_version[store.model]

    async def _announce(self, store: ModelStore, manifest: VersionManifest) -> None:
        """The notice on the model's topic and the registry entry replicas find the model by."""
        entry = RegisteredModel(
            model=store.model,
            dir=store.base,
            topic=model_topic(store.model),
            version=manifest.version,
            job_id=manifest.job_id,
            updated_at=manifest.created_at,
        )
        await self.models_registry.announce(entry)
        try:
            if self._producer is None:
                self._producer = kafka.producer(self.kafka)
                await self._producer.start()
            await self._producer.send_and_wait(model_topic(store.model), json.dumps(manifest.summary()).encode())
        except Exception as err:  # noqa: BLE001 (replicas also poll the store: the version is not lost)
            logger.warning("version notice not sent", extra={"model": store.model, "error": str(err)})

    async def _abandon(self, job: JobRecord, store: ModelStore, held: _Job, step: int, why: str) -> None:
        held.done.add(step)
        held.failures = [*held.failures[-9:], f"step {step}: {why}"]
        ABANDONED.labels(job.id).inc()
        logger.error("version abandoned", extra={"job": job.id, "step": step, "error": why})
        await asyncio.to_thread(store.parts(parts_name(job.id, job.attempt, step)).remove)


def _reports(workers: list[Worker], job: JobRecord, key: str, kind: type[Any]) -> dict[int, Any]:
    """step -> (rank -> report) for the cuts, or step -> report for one worker's parts."""
    out: dict[int, Any] = {}
    for w in workers:
        report = w.job_report(job.id, job.attempt) or {}
        for step, raw in (report.get(key) or {}).items():
            if kind is PublishCut:
                out.setdefault(int(step), {})[w.index] = PublishCut.model_validate(raw)
            else:
                out[int(step)] = ModelPart.model_validate(raw)
    return out


def low_watermark(stamps: list[float | None]) -> float | None:
    """A version's low watermark: the least of its ranks' (each rank's batches come from one loader,
    and the ranks stepped together to the cut), unknown when any rank's is."""
    if not stamps or any(stamp is None for stamp in stamps):
        return None
    return min(stamps)  # type: ignore[type-var]
