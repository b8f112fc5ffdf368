"""The job view's stream counts are the job's own: a loader's heartbeat can carry the next
attempt's first report beside the counts of the stream it still runs, which must not be shown
as the new one's (a test waiting for the new job's joins saw the old job's and went on)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from trillium.data import load_job
from trillium.job.record import JobRecord, Topics
from trillium.services.coordinator.observe import stream_view
from trillium.services.coordinator.registry import Worker

TINY_JOB = Path(__file__).resolve().parents[1] / "data" / "tiny_job.yaml"


class _Registry:
    def __init__(self, workers: list[Worker]) -> None:
        self._workers = workers

    async def workers(self) -> list[Worker]:
        return self._workers


def _loader(report_of: tuple[str, int], stream_of: tuple[str, int], joined: int) -> Worker:
    health = {
        "job": {"id": report_of[0], "attempt": report_of[1], "phase": "setting_up"},
        "stream": {"job": list(stream_of), "inputs": [], "events": {}, "joined": {"impressions": joined}},
    }
    return Worker(
        name="data_loader-0",
        role="data_loader",
        index=0,
        http_url="http://x",
        pid=1,
        registered_at=0.0,
        last_heartbeat=0.0,
        health=health,
    )


def test_a_stream_view_counts_only_the_attempts_own_stream() -> None:
    job = JobRecord.model_construct(
        id="new-1", attempt=0, config=load_job(TINY_JOB), topics=Topics.model_construct(dlq="dlq")
    )
    stale = asyncio.run(stream_view(_Registry([_loader(("new-1", 0), ("old-1", 0), 5)]), job))
    assert stale is not None and stale.joined == {}
    own = asyncio.run(stream_view(_Registry([_loader(("new-1", 0), ("new-1", 0), 5)]), job))
    assert own is not None and own.joined == {"impressions": 5}
