"""A complete checkpoint of a job's current attempt written as the coordinator writes one (a
dense file and its manifest), for the tests of picking, recovering and retaining checkpoints."""

from __future__ import annotations

import time

from trillium.job.record import JobRecord
from trillium.runtime.checkpoint import DENSE, Manifest, PartFile
from trillium.services.coordinator.jobs import JobStore


def write_checkpoint(
    jobs: JobStore, job: JobRecord, step: int, positions: dict[str, dict[int, int]], parent: int | None
) -> None:
    """`job`'s checkpoint at `step`, its readers resuming at `positions`, after `parent` on its
    timeline; one an abandoned attempt left at the same step goes first, as the checkpointer
    removes it."""
    store = jobs.checkpoints(job)
    assert store is not None
    ckdir = store.dir(step)
    ckdir.remove()
    size, sha = ckdir.write_bytes(DENSE, b"dense of step %d, attempt %d" % (step, job.attempt))
    ckdir.write_manifest(
        Manifest(
            job_id=job.id,
            attempt=job.attempt,
            step=step,
            epoch=0,
            reason="schedule",
            created_at=time.time(),
            pause_seconds=0.0,
            seconds_to_write=0.0,
            config=job.config,
            positions=positions,
            written={},
            lineage={},
            files=[PartFile(name=DENSE, role="nn_worker", index=0, bytes=size, sha256=sha, seconds=0.0)],
            parent=parent,
        )
    )
