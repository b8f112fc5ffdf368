"""A job record of the tiny job (tests/data/tiny_job.yaml), as the coordinator would hand it to a
worker, for tests of a worker's own logic with no coordinator; and the job context an embedding
worker keeps for it, for stand-in workers under the real servicer."""

from __future__ import annotations

import time
from collections import OrderedDict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from trillium import pooling
from trillium.data import load_job
from trillium.job.record import JobRecord, Topics

TINY_JOB = Path(__file__).resolve().parent / "data" / "tiny_job.yaml"


def tiny_record(state: str = "submitted", attempt: int = 0) -> JobRecord:
    now = time.time()
    return JobRecord(
        id="tiny-0123abcd",
        state=state,
        config=load_job(TINY_JOB),
        created_at=now,
        updated_at=now,
        topics=Topics(samples="s", eval="e", gradients="g"),
        attempt=attempt,
    )


async def _applied_at_once(steps: int) -> None:
    return None


def worker_context(job: JobRecord, **more: Any) -> SimpleNamespace:
    """What the embedding worker's servicer reads of a job's context (ranks 0 and 1, every step
    applied at once), with `more` fields."""
    layout = pooling.Layout(job.config.slots, job.config.tables, job.config.topology.ps_shards)
    return SimpleNamespace(
        job=job,
        layout=layout,
        widths=[c[1] - c[0] if c is not None else 0 for c in layout.columns],
        pending=OrderedDict(),
        ranks=[0, 1],
        watermark=SimpleNamespace(wait_applied=_applied_at_once),
        **more,
    )
