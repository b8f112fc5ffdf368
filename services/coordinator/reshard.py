"""Live resharding: a running job moved onto another number of PS shards.

    POST /v1/jobs/{id}/reshard {"ps_shards": N}

It is a stop with a final checkpoint that does not stop (jobs.py `request_stop`,
checkpoints.py): the request raises the job's `checkpoint_seq` and marks it the last
(`stop_after`), the NN ranks cut after the step on which they agree on it and hold there, and
once that checkpoint's manifest is written the coordinator starts a new attempt from it with
the job's topology changed to N shards (`start_resharded`). Every PS shard of the new attempt
loads the IDs it owns from every old shard's snapshot (services/embedding_ps, as a warm start
on another number of shards does), the data loaders and the ranks restore their positions as
in a resume, and the lineage skips what the old attempt wrote past the cut: no sample is lost
or trained twice.

The shards are the stack's `embedding_ps` processes 0..N-1 (the launcher's `--ps-shards`, a
StatefulSet's replicas): a reshard onto more than are registered is refused. A process dying
before the cut carries the reshard over its recovery; a stop asked before the cut cancels it;
a checkpoint abandoned fails it, and the job goes on with its shards as they were.
"""

from __future__ import annotations

import logging
import time

from trillium.job import JobConfig
from trillium.job.record import IllegalTransition, JobRecord, Reshard
from trillium.runtime.checkpoint import Manifest
from trillium.wire import kafka

from .jobs import JobStore, Picked
from .registry import WorkerRegistry

logger = logging.getLogger("trillium.coordinator.reshard")


def with_ps_shards(config: JobConfig, shards: int) -> JobConfig:
    return config.model_copy(update={"topology": config.topology.model_copy(update={"ps_shards": shards})})


async def request_reshard(jobs: JobStore, registry: WorkerRegistry, job_id: str, shards: int) -> JobRecord:
    """Ask a running job to move onto `shards` PS shards; IllegalTransition (409) says why not."""
    job = await jobs.require(job_id)
    registered = {w.index for w in await registry.workers() if w.role == "embedding_ps" and w.status != "lost"}
    missing = [f"embedding_ps-{i}" for i in range(shards) if i not in registered]
    if missing:
        raise IllegalTransition(
            f"ps_shards: {shards} needs embedding_ps-0..{shards - 1}, and {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not registered (the stack runs {len(registered)} PS shards; "
            "start it with more: trillium up --ps-shards N, or the StatefulSet's replicas)"
        )

    def ask(record: JobRecord) -> None:
        if (pending := record.pending_reshard) is not None:
            raise IllegalTransition(
                f"job {job_id} is already being resharded to {pending.to_shards} PS shards; ask again once that is done"
            )
        if record.state != "running":
            hint = " (resume it first)" if record.state == "paused" else ""
            raise IllegalTransition(f"job {job_id} is {record.state}; only a running job can be resharded{hint}")
        if record.config.checkpoint is None:
            raise IllegalTransition(f"job {job_id} takes no checkpoints (checkpoint: null): a reshard restores one")
        if record.stop_after is not None:
            raise IllegalTransition(f"job {job_id} is stopping at its next checkpoint")
        current = record.config.topology.ps_shards
        if shards == current:
            raise IllegalTransition(f"ps_shards: job {job_id} already runs on {shards} PS shards")
        record.checkpoint_seq += 1
        record.stop_after = record.checkpoint_seq
        record.reshards.append(
            Reshard(requested_at=time.time(), from_shards=current, to_shards=shards, seq=record.checkpoint_seq)
        )

    updated = await jobs.update(job_id, ask)
    logger.info("reshard requested", extra={"job": job_id, "from": job.config.topology.ps_shards, "to": shards})
    return updated


async def end_at_final_cut(jobs: JobStore, job_id: str, manifest: Manifest, location: str) -> JobRecord:
    """The ranks hold at a stop's final checkpoint, now written: a pending reshard starts its new
    attempt from it; otherwise the job goes `stopping`."""
    job = await jobs.require(job_id)
    if job.pending_reshard is not None:
        try:
            return await start_resharded(jobs, job, Picked(manifest, location, []))
        except IllegalTransition as err:  # cancelled meanwhile by a stop: stop at this cut
            logger.info("reshard not started", extra={"job": job_id, "error": str(err)})
    return await jobs.transition(job_id, "stopping", expect=frozenset({"running", "paused"}))


async def start_resharded(jobs: JobStore, job: JobRecord, pick: Picked) -> JobRecord:
    """A new attempt from the checkpoint `pick`, on the pending reshard's number of PS shards."""
    reshard = job.pending_reshard
    assert reshard is not None
    # The gradients topic has a partition per shard: one can be added, never taken away (the
    # partitions of shards gone are left unread).
    await kafka.ensure_partitions(jobs.kafka, {job.topics.gradients: reshard.to_shards})
    step = pick.manifest.step

    def reshard_config(record: JobRecord) -> None:
        pending = record.pending_reshard
        if pending is None or pending.seq != reshard.seq:
            raise IllegalTransition(f"job {record.id}: the reshard to {reshard.to_shards} PS shards was cancelled")
        record.config = with_ps_shards(record.config, pending.to_shards)
        pending.state, pending.attempt, pending.checkpoint_step = "done", record.attempt, step
        pending.done_at = time.time()

    cause = f"resharded from {reshard.from_shards} to {reshard.to_shards} PS shards at step {step}"
    return await jobs.start_attempt(
        job, pick, cause, expect=frozenset({"running", "paused"}), kind="reshard", also=reshard_config
    )


async def reshard_abandoned(jobs: JobStore, job_id: str, error: str) -> bool:
    """A stop's final checkpoint was abandoned: a pending reshard fails (the job is to go on with the
    shards it has: True), a stop goes on without it (False)."""
    failed = False

    def fail(record: JobRecord) -> None:
        nonlocal failed
        failed = (pending := record.pending_reshard) is not None
        if pending is not None:
            pending.state, pending.error, pending.done_at = "failed", error, time.time()
            record.stop_after = None

    await jobs.update(job_id, fail)
    return failed
