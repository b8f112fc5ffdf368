"""A job's views as the API answers them (views.py's models), assembled from the coordinator's
parts: its progress in Redis, its workers, checkpoints and versions, what the observer measured.

Apart from views.py because it sits above every part (parts.py), while observe.py and
publish.py, two of those parts, build views themselves."""

from __future__ import annotations

import time

from trillium.job.record import JobRecord
from trillium.runtime.progress import JobProgress

from .lifecycle import lost_workers
from .observe import progressive_view, stream_view
from .parts import CoordinatorParts
from .registry import unreachable
from .views import JobProgressView, JobView, SeriesPoint, StalenessReport, StalenessView


async def staleness_report(coord: CoordinatorParts, job: JobRecord) -> StalenessReport:
    progress = JobProgress(coord.redis, job.id)
    stats = await progress.staleness(job.config.topology.nn_ranks)
    return StalenessReport(
        job_id=job.id, bound=await progress.bound(), ranks={r: StalenessView(**s.as_dict()) for r, s in stats.items()}
    )


async def job_series(coord: CoordinatorParts, job: JobRecord) -> list[SeriesPoint]:
    return [
        SeriesPoint(time=t, samples=n, auc=auc, loss=loss)
        for t, n, auc, loss in await JobProgress(coord.redis, job.id).series()
    ]


async def job_view(coord: CoordinatorParts, job: JobRecord) -> JobView:
    progress = JobProgress(coord.redis, job.id)
    ranks = job.config.topology.nn_ranks
    training = await progress.training(ranks)
    elapsed = (job.finished_at or time.time()) - job.started_at if job.started_at else 0.0
    nan_to_none = lambda x: None if x != x else x  # noqa: E731 (JSON has no NaN)
    lost = await lost_workers(coord.registry, job)
    workers = {w.name: w for w in await coord.registry.workers()} if lost else {}
    return JobView(
        job=job,
        progress=JobProgressView(
            samples=training["samples"],
            steps=training["steps"],
            epoch=training["epoch"],
            samples_per_sec=training["samples"] / elapsed if elapsed > 0 else 0.0,
            recent_samples_per_sec=coord.observer.samples_per_sec(job.id),
            mean_loss=nan_to_none(training["mean_loss"]),
            last_loss=nan_to_none(training["last_loss"]),
        ),
        staleness={r: StalenessView(**s.as_dict()) for r, s in (await progress.staleness(ranks)).items()},
        auto_bound=await progress.auto_bound(),
        results=await progress.rank_results(),
        ledgers=await progress.ledgers(job.attempt + 1),
        lost_workers=lost,
        waiting_for=[unreachable(name, workers.get(name), time.time()) for name in lost],
        last_checkpoint=await coord.checkpointer.latest(job),
        checkpoint_in_progress=coord.checkpointer.busy(job.id),
        ps_shards=job.config.topology.ps_shards,
        reshard_in_progress=job.pending_reshard is not None
        or (job.state == "recovering" and bool(job.recoveries) and job.recoveries[-1].kind == "reshard"),
        publish_failures=coord.publisher.failures(job),
        progressive=await progressive_view(coord.redis, job),
        stream=await stream_view(coord.registry, job),
    )
