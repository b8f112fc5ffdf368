"""A right to be forgotten (GDPR Art. 17): `POST /v1/jobs/{id}/forget` removes a user's IDs from
everything of the job that holds them, and returns a receipt, kept as an audit record.

The values asked for (a user column's values, as the data has them) are hashed as every slot that
uses the table hashes its values, and those IDs are removed

1. from the live PS shards (`/job/forget` on each: the native store removes the rows, resident or
   on disk; the next capture is a full one, a delta cannot say a row left);
2. from every checkpoint of the job (each PS snapshot rewritten without them, the manifest's sizes
   and checksums updated; the old file is replaced, not kept), and checkpoints no recovery can read
   (incomplete, refused) are deleted;
3. from every model version (each values file rewritten, its manifest updated), and parts no version
   names are deleted; the model's forget count is raised (`forgotten.json` beside its versions) and
   a notice sent: every replica reloads the version it serves from the rewritten files;
4. from the job's later attempts: a `ForgetMask` on the job record makes the embedding workers look
   the IDs up as zeros, creating no row, in every batch the job had written when the forget ran
   (a recovery from an older checkpoint replays them); a later batch is new data, where the ID is
   a new ID. The samples, eval and gradients topics still hold those batches until retention
   trims them behind the oldest kept checkpoint (the receipt says from which offsets).

It runs only while the job runs nothing (stopped, failed or finished): no capture, export or
gradient is in flight to bring a row back. Dense weights are not per ID: they keep what they learnt.

It reaches every job linked to the job (`linked_jobs`): those warm-started from it (`init_from`),
and those publishing its model, each in turn; all must have ended (409 naming those that run).
Each is a forget of its own, with its receipt, which the job's receipt names (`linked`).

It is crash-safe: the forget is written down (a `ForgetIntent`, with the IDs) before anything is
touched, then the job record is marked `forgetting` in one compare-and-set with its state, so no
resume or delete starts until the receipt is written; a coordinator that starts runs each intent
left again (every step above is idempotent) until its receipt is complete.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import secrets
import time

import httpx
import numpy as np
from aiokafka import TopicPartition
from fastapi import HTTPException, status
from pydantic import BaseModel, Field

import trillium_native
from trillium.job.record import TERMINAL, ForgetMask, IllegalTransition, JobRecord
from trillium.runtime.checkpoint import JobCheckpoints
from trillium.runtime.forget import (
    MAX_FORGET_VALUES,
    ForgetIntent,
    ForgetReceipt,
    Place,
    ShardForgetRequest,
    ShardForgetResult,
)
from trillium.runtime.model_store import ModelStore, model_topic
from trillium.runtime.storage import StorageDir
from trillium.wire import codec, kafka, state
from trillium.wire.kafka import KafkaConnection

from .jobs import JobNotFound, JobStore
from .registry import WorkerRegistry

logger = logging.getLogger("trillium.coordinator.forget")

# A forget left undone by a coordinator before this one runs until its receipt is complete, this
# many times at most, this far apart: its PS shards may be registering again meanwhile.
RESUMED_RUNS = 6
RESUMED_RETRY_S = 5.0


class ForgetRequest(BaseModel):
    table: str = Field(description="the embedding table, e.g. `user`")
    values: list[str] = Field(
        min_length=1,
        max_length=MAX_FORGET_VALUES,
        description="the IDs as the data has them (the values of the columns whose slots use the table)",
    )


class Forgetter:
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
        self.http = http
        self._lock = asyncio.Lock()  # one forget at a time: each rewrites the same files
        self._retry: asyncio.Task[None] | None = None

    async def forget(self, job_id: str, request: ForgetRequest) -> ForgetReceipt:
        """Forget on the job and on every job linked to it (`linked_jobs`), each a forget of its
        own with its receipt; the job's receipt names theirs. All of them must have ended."""
        job = await self.jobs.require(job_id)
        _require_ended(job)
        if request.table not in job.config.tables:
            raise HTTPException(
                status.HTTP_422_UNPROCESSABLE_ENTITY,
                f"job {job_id} has no table {request.table!r}; tables: {', '.join(job.config.tables)}",
            )
        records = {r.id: r for r in await self.jobs.all()}
        linked = linked_jobs(list(records.values()), job, self.shared_root)
        if running := [f"{other} ({why})" for other, why in linked.items() if records[other].state not in TERMINAL]:
            raise IllegalTransition(
                f"job {job_id}'s rows are also in jobs still running: {'; '.join(running)}; stop them first, "
                "forget, then resume them"
            )
        reached = [
            (records[other], why) for other, why in linked.items() if request.table in records[other].config.tables
        ]
        started = time.time()
        receipt = f"forget-{time.strftime('%Y%m%d-%H%M%S', time.gmtime(started))}-{secrets.token_hex(3)}"

        def intent_on(target: JobRecord, number: int, reason: str | None) -> ForgetIntent:
            return ForgetIntent(
                receipt=f"{receipt}-{number}" if number else receipt,
                job_id=target.id,
                table=request.table,
                values=len(request.values),
                ids=table_ids(target, request.table, request.values).tolist(),
                started_at=started,
                linked_from=receipt if number else None,
                reason=reason,
            )

        intents = [intent_on(job, 0, None), *(intent_on(r, n, why) for n, (r, why) in enumerate(reached, 1))]
        intents[0].linked = [i.receipt for i in intents[1:]]
        # Durable before anything is touched: a coordinator killed from here on runs them at start.
        for intent in intents:
            await self._save(intent)
        async with self._lock:
            await self._claim_all(intents)
            try:
                receipts = [await self._carry_out(intent, runs=1) for intent in intents]
            except Exception:
                # The jobs left stay marked and their intents kept: run again soon, as at a start.
                self._retry = asyncio.create_task(self._resume_later(), name="forget retry")
                raise
        return receipts[0]

    async def _claim_all(self, intents: list[ForgetIntent]) -> None:
        """Mark every job of a forget, or none: a job that cannot be claimed (resumed meanwhile)
        releases those claimed before it and drops every intent."""
        claimed: list[ForgetIntent] = []
        try:
            for intent in intents:
                await self._claim(intent)
                claimed.append(intent)
        except BaseException:
            for intent in claimed:
                await self._release(intent)
            for intent in intents:
                await self.jobs.redis.hdel(state.FORGET_INTENTS, intent.receipt)
            raise

    async def _release(self, intent: ForgetIntent) -> None:
        def release(record: JobRecord) -> None:
            if record.forgetting == intent.receipt:
                record.forgetting = None

        await self.jobs.update(intent.job_id, release)

    async def _resume_later(self) -> None:
        await asyncio.sleep(RESUMED_RETRY_S)
        await self.resume_interrupted()

    async def close(self) -> None:
        if self._retry is not None:
            self._retry.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._retry
        await self.http.aclose()

    async def resume_interrupted(self) -> None:
        """Run every forget a coordinator before this one left undone (killed mid-forget), oldest
                first, until each receipt is complete (its PS shards re-registering meanwhile) or
                RESUMED_RUNS have run. One the job never took (resumed or deleted before the forget could
                mark it; its caller was answered with an error) is dropped, logged. One that fails again
        stays, the job marked, for the next start."""
        raw = await self.jobs.redis.hvals(state.FORGET_INTENTS)
        for intent in sorted((ForgetIntent.model_validate_json(r) for r in raw), key=lambda i: i.started_at):
            async with self._lock:
                try:
                    await self._claim(intent)
                except (IllegalTransition, JobNotFound) as err:
                    logger.warning("forget dropped", extra={"receipt": intent.receipt, "why": str(err)})
                    await self.jobs.redis.hdel(state.FORGET_INTENTS, intent.receipt)
                    continue
                logger.warning("forget resumed", extra={"receipt": intent.receipt, "job": intent.job_id})
                try:
                    await self._carry_out(intent, runs=RESUMED_RUNS)
                except Exception:  # the job stays marked: the next start runs it again
                    logger.exception("forget failed again", extra={"receipt": intent.receipt})

    async def receipts(self, job_id: str | None) -> list[ForgetReceipt]:
        raw = await self.jobs.redis.hvals(state.FORGETS)
        found = [ForgetReceipt.model_validate_json(r) for r in raw]
        return sorted((r for r in found if job_id in (None, r.job_id)), key=lambda r: r.started_at)

    async def _save(self, intent: ForgetIntent) -> None:
        await self.jobs.redis.hset(state.FORGET_INTENTS, intent.receipt, intent.model_dump_json())

    async def _claim(self, intent: ForgetIntent) -> None:
        """Mark the job as forgetting, in one compare-and-set with its state: from then on no
        resume or delete of it starts (jobs.py refuses both while `forgetting` is set), and one
        that started first has already moved it out of the states a forget takes."""

        def claim(record: JobRecord) -> None:
            _require_ended(record)
            if record.forgetting not in (None, intent.receipt):
                raise IllegalTransition(f"job {record.id}: forget {record.forgetting} is running on it")
            record.forgetting = intent.receipt

        await self.jobs.update(intent.job_id, claim)

    async def _carry_out(self, intent: ForgetIntent, runs: int) -> ForgetReceipt:
        """Run the claimed forget (again, while places are unreached, up to `runs` runs), keep its
        receipt, and release the job."""
        while True:
            intent.runs += 1
            await self._save(intent)
            job = await self.jobs.require(intent.job_id)
            receipt = await self._run(job, intent)
            runs -= 1
            if receipt.complete or runs <= 0:
                break
            await asyncio.sleep(RESUMED_RETRY_S)
        await self.jobs.redis.hset(state.FORGETS, receipt.id, receipt.model_dump_json())
        await self._release(intent)
        await self.jobs.redis.hdel(state.FORGET_INTENTS, intent.receipt)
        logger.info(
            "forgot",
            extra={
                "job": intent.job_id,
                "receipt": receipt.id,
                "ids": receipt.ids,
                "rows_removed": receipt.rows_removed,
                "runs": receipt.runs,
            },
        )
        return receipt

    async def _run(self, job: JobRecord, intent: ForgetIntent) -> ForgetReceipt:
        ids = np.asarray(intent.ids, dtype=np.uint64)
        through = await self._through_batch(job)
        if through is not None:  # before the rows go: a recovery started meanwhile masks them already
            mask = ForgetMask(receipt=intent.receipt, tables={intent.table: intent.ids}, through_batch=through)

            def add_mask(record: JobRecord) -> None:  # in place of a run's before this one
                record.forgotten = [m for m in record.forgotten if m.receipt != mask.receipt] + [mask]

            await self.jobs.update(job.id, add_mask)
        places = await self._ps_shards(job, intent.table, ids)
        drop = {intent.table: ids}
        places += await asyncio.to_thread(_checkpoints, job, self.shared_root, drop)
        places += await self._model_versions(job, drop)
        places += self._topics(job, through)
        return ForgetReceipt(
            id=intent.receipt,
            job_id=job.id,
            table=intent.table,
            values=intent.values,
            ids=len(ids),
            ids_sha256=hashlib.sha256(ids.astype("<u8").tobytes()).hexdigest(),
            started_at=intent.started_at,
            finished_at=time.time(),
            through_batch=through,
            rows_removed=sum(p.rows_removed for p in places if p.kind == "ps_shard"),
            complete=not any(p.note and p.note.startswith("not reached") for p in places),
            places=places,
            runs=intent.runs,
            linked=intent.linked,
            linked_from=intent.linked_from,
            reason=intent.reason,
        )

    async def _ps_shards(self, job: JobRecord, table: str, ids: np.ndarray) -> list[Place]:
        workers = {w.name: w for w in await self.registry.workers()}
        body = ShardForgetRequest(job_id=job.id, table=table, ids=ids.tolist()).model_dump(mode="json")

        async def one(shard: int) -> Place:
            name = f"embedding_ps-{shard}"
            worker = workers.get(name)
            if worker is None:
                return Place(kind="ps_shard", name=name, note="not reached: not registered (its rows died with it)")
            try:
                r = await self.http.post(worker.http_url + "/job/forget", json=body)
                r.raise_for_status()
            except httpx.HTTPError as err:
                return Place(kind="ps_shard", name=name, note=f"not reached: {err}")
            result = ShardForgetResult.model_validate(r.json())
            note = None if result.held else "holds no rows of this job (another job's since, or restarted)"
            return Place(kind="ps_shard", name=name, rows_removed=result.removed, note=note)

        shards = job.config.topology.ps_shards
        return list(await asyncio.gather(*(one(s) for s in range(shards))))

    async def _through_batch(self, job: JobRecord) -> int | None:
        """The newest batch_id in the samples topic: what the job had written (None: nothing, or
        the topics are gone with a finished job and nothing can replay)."""
        if job.topics_deleted:
            return None
        consumer = kafka.consumer(self.kafka, group_id=None)
        await consumer.start()
        try:
            partitions = [TopicPartition(job.topics.samples, p) for p in range(job.config.topology.nn_ranks)]
            consumer.assign(partitions)
            first = await consumer.beginning_offsets(partitions)
            end = await consumer.end_offsets(partitions)
            newest: int | None = None
            for tp in partitions:
                if end[tp] <= first[tp]:
                    continue
                # The last records: an epoch's end marker may follow the last batch of each.
                consumer.seek(tp, max(first[tp], end[tp] - 4))
                while await consumer.position(tp) < end[tp]:
                    for record in (await consumer.getmany(tp, timeout_ms=1000)).get(tp, []):
                        if kafka.epoch_end(record.headers) is None:
                            batch_id = codec.decode_batch(record.value).batch_id
                            newest = batch_id if newest is None else max(newest, batch_id)
            return newest
        finally:
            await consumer.stop()

    async def _model_versions(self, job: JobRecord, drop: dict[str, np.ndarray]) -> list[Place]:
        store = ModelStore.of(job.config, self.shared_root)
        if store is None:
            return []
        places = await asyncio.to_thread(_versions, store, drop)
        seq = await asyncio.to_thread(store.raise_forget_seq)
        # Replicas read the count at every notice (and every poll): each reloads what it serves.
        producer = kafka.producer(self.kafka)
        note = f"forget {seq}: every replica reloads its version from the rewritten files"
        try:
            await producer.start()
            await producer.send_and_wait(model_topic(store.model), f'{{"forget": {seq}}}'.encode())
        except Exception as err:  # noqa: BLE001 (replicas also poll the store)
            note = f"forget {seq}: notice not sent ({err}); replicas see it at their next poll of the store"
        finally:
            await producer.stop()
        return [*places, Place(kind="serving", name=store.model, note=note)]

    def _topics(self, job: JobRecord, through: int | None) -> list[Place]:
        if job.topics_deleted:
            gone = "deleted with the finished job"
            return [Place(kind="topic", name=t, note=gone) for t in (job.topics.samples, job.topics.gradients)]
        note = (
            f"batches through {through} masked in every later attempt; retention deletes them "
            "behind the oldest kept checkpoint"
        )
        topics = [job.topics.samples, job.topics.eval, job.topics.gradients]
        return [Place(kind="topic", name=t, note=note) for t in topics]


def _require_ended(job: JobRecord) -> None:
    if job.state not in TERMINAL:
        raise IllegalTransition(
            f"job {job.id} is {job.state}: stop it first (its final checkpoint keeps its progress), "
            "forget, then resume it"
        )


def linked_jobs(records: list[JobRecord], origin: JobRecord, shared_root: str) -> dict[str, str]:
    """The jobs a forget of `origin` must reach too, by id, each with why: those warm-started from
    it (`init_from`, and from those in turn: their tables began as its rows), and those publishing
    the model it publishes (one's versions hold the other's rows, and a running one would publish
    them again), and so on from each job reached."""
    why: dict[str, str] = {}
    models = {r.id: ModelStore.key(r.config, shared_root) for r in [origin, *records]}
    reached, queue = {origin.id}, [origin]
    while queue:
        job = queue.pop(0)
        model = models[job.id]
        for other in records:
            if other.id in reached:
                continue
            if other.config.init_from is not None and other.config.init_from.job == job.id:
                why[other.id] = f"warm-started from {job.id}"
            elif model is not None and models[other.id] == model:
                why[other.id] = f"publishes model {model[1]}, as {job.id} does"
            else:
                continue
            reached.add(other.id)
            queue.append(other)
    return why


def table_ids(job: JobRecord, table: str, values: list[str]) -> np.ndarray:
    """The IDs `values` hash to in every slot that uses `table` (in the slot's ID space: the
    table's, or its own with `ids: per_slot`), sorted and unique."""
    slots = [s for s in job.config.slots if s.table == table]
    hashed = [trillium_native.hash_cells(job.config.id_space(s), values)[1] for s in slots]
    return np.unique(np.concatenate(hashed))


def _checkpoints(job: JobRecord, shared_root: str, drop: dict[str, np.ndarray]) -> list[Place]:
    checkpoints = JobCheckpoints.of(job.config, job.id, shared_root)
    if checkpoints is None:
        return []
    places = []
    complete, refused = checkpoints.scan()
    for step in refused:
        checkpoints.dir(step).remove()
        places.append(Place(kind="checkpoint", name=f"{step}", note="refused (unreadable manifest): deleted"))
    for step in checkpoints.cleanup_incomplete():
        places.append(Place(kind="checkpoint", name=f"{step}", note="incomplete: deleted"))
    for manifest in complete:
        where = checkpoints.dir(manifest.step)
        removed = 0
        for entry in manifest.files:
            if entry.role == "embedding_ps" and entry.name.endswith(".snap"):
                n, entry.bytes, entry.sha256 = _rewrite(where, entry.name, trillium_native.forget_in_snapshot, drop)
                removed += n
        where.write_manifest(manifest)
        places.append(Place(kind="checkpoint", name=f"{manifest.step}", rows_removed=removed))
    return places


def _versions(store: ModelStore, drop: dict[str, np.ndarray]) -> list[Place]:
    places = []
    for version in store.versions():
        manifest = store.manifest(version)  # every job's that published the model: the same IDs
        parts = store.parts(manifest.parts)
        removed = 0
        for entry in manifest.values:
            n, entry.bytes, entry.sha256 = _rewrite(parts, entry.name, trillium_native.forget_in_values, drop)
            removed += n
        store.commit(manifest)
        places.append(Place(kind="model_version", name=f"{store.model} v{version}", rows_removed=removed))
    referenced = {store.manifest(v).parts for v in store.versions()}
    for name in store.remove_unreferenced(referenced, protect=lambda name: False):
        places.append(
            Place(kind="model_version", name=f"{store.model} parts {name}", note="no version names it: deleted")
        )
    return places


def _rewrite(where: StorageDir, name: str, rewrite, drop: dict[str, np.ndarray]) -> tuple[int, int, str]:
    """A file of `where` rewritten in place without the rows of `drop` (downloaded and uploaded
    again when remote): (rows removed, bytes, sha256)."""
    with where.reading(name) as src, where.writing(name) as dst:
        return rewrite(src, dst, drop)
