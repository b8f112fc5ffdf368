"""A job record of the tiny job (tests/data/tiny_job.yaml), as the coordinator would hand it to a
worker, for tests of a worker's own logic with no coordinator."""

from __future__ import annotations

import time
from pathlib import Path

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
