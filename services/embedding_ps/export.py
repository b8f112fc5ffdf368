"""A PS shard's part of a published model version (services/coordinator/publish.py has the protocol).

At a publish cut — gradients of step s flagged in-band, or an `ExportRequest` after a job's last
step — the shard captures its store right after applying step s (gradient application waits for
the copy only) and writes the rows as a values file, values only, in the job's publish dtype.
The copy holds the rows changed since the cut of the newest version the job has committed, when
this shard made that cut itself (its mark); otherwise — the attempt's first version, a row evicted
or expired since (an older version's copy would bring it back) — every row it owns. The file is
written while training goes on and reported in the shard's health.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import trillium_native
from trillium.job.record import JobRecord
from trillium.runtime.model_store import ModelPart, ModelStore, VersionFile, parts_name, ps_values
from trillium.runtime.service import describe_error

logger = logging.getLogger("trillium.embedding_ps")

MARKS_KEPT = 16  # the latest cuts' marks: a base is the newest committed version, a few cuts back at most


@dataclass(frozen=True)
class Captured:
    snapshot: trillium_native.StoreCapture
    delta_of: int | None  # the version a delta's rows are changed since (None: every row)


class Exporter:
    """One attempt's exports of one shard."""

    def __init__(self, shard: int, store: ModelStore, report: Callable[[ModelPart], None]) -> None:
        self.shard = shard
        self.store = store
        self.report = report
        self.marks: dict[int, trillium_native.CaptureMark] = {}  # step -> where that cut's capture stood
        self.exported: set[int] = set()

    def capture(self, native: trillium_native.EmbeddingStore, job: JobRecord, step: int) -> Captured | None:
        """Capture the rows of the cut after `step` (blocking; the caller holds gradient application):
        None when this cut was captured already (the last step's request after its flagged gradients)."""
        if step in self.exported:
            return None
        self.exported.add(step)
        published = job.published
        base = published if published is not None and published.attempt == job.attempt else None
        mark = self.marks.get(base.step) if base is not None else None
        started = time.monotonic()
        snapshot = native.capture(mark)
        self.marks[step] = snapshot.mark
        for old in sorted(self.marks)[:-MARKS_KEPT]:
            if base is None or old != base.step:
                del self.marks[old]
        delta_of = base.version if snapshot.delta and base is not None else None
        logger.info(
            "export captured",
            extra={
                "step": step,
                "rows": snapshot.rows,
                "delta_of": delta_of,
                "seconds": round(time.monotonic() - started, 3),
            },
        )
        return Captured(snapshot, delta_of)

    def write(self, job: JobRecord, step: int, captured: Captured) -> None:
        """Write a capture in the background (training goes on) and report it."""
        asyncio.get_running_loop().create_task(self._write(job, step, captured.snapshot, captured.delta_of))

    async def _write(self, job: JobRecord, step: int, snapshot, delta_of: int | None) -> None:
        name = ps_values(self.shard)
        assert job.config.publish is not None
        try:
            with self.store.parts(parts_name(job.id, job.attempt, step)).writing(name) as path:
                size, sha = await asyncio.to_thread(snapshot.write_values, path, job.config.publish.dtype)
            snapshot.release()
            entry = VersionFile(
                name=name, bytes=size, sha256=sha, shard=self.shard, full=delta_of is None, base=delta_of
            )
            self.report(ModelPart(step=step, files=[entry]))
        except Exception as err:  # noqa: BLE001 (the version is abandoned, not the job)
            logger.exception("writing the values file failed", extra={"step": step})
            self.report(ModelPart(step=step, error=describe_error(err)))
