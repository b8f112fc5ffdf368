"""`staleness_bound: auto` set live: the coordinator's job-control tick turns the ranks' calibration
timings into the bound (trillium.runtime.autobound decides it), soon after every rank has trained
its calibration steps: a short job must not end at k = 0 because the choice waited a slower loop."""

from __future__ import annotations

import logging

from trillium.job.record import JobRecord
from trillium.runtime.autobound import choose_bound, refine_bound
from trillium.runtime.progress import JobProgress
from trillium.wire.state import aioredis

logger = logging.getLogger("trillium.coordinator.bound")


async def choose_live_bound(redis: aioredis.Redis, job: JobRecord | None) -> None:
    """For a running `staleness_bound: auto` job: once the ranks have calibrated at k = 0, set
    the bound their timings call for; then check it hides the wait, raising it while it does not
    (an operator's live change of the bound stands: the automatic one stops there)."""
    if job is None or job.state != "running" or job.config.training.staleness_bound != "auto":
        return
    progress = JobProgress(redis, job.id)
    chosen, timings = await progress.auto_bound(), await progress.timings(job.config.topology.nn_ranks)
    if chosen is None:
        choice = choose_bound(timings)
        if choice is not None:
            await progress.set_auto_bound(choice.as_dict())
            logger.info(
                "staleness bound chosen", extra={"job": progress.job_id, "bound": choice.bound, "reason": choice.reason}
            )
        return
    if chosen.get("settled") or await progress.bound() != chosen["bound"]:
        return
    refined = refine_bound(chosen, timings)
    if refined is None:
        return
    await progress.set_auto_bound(refined)
    if refined["bound"] != chosen["bound"]:
        logger.info(
            "staleness bound raised",
            extra={"job": progress.job_id, "bound": refined["bound"], "reason": refined["reason"]},
        )
