"""A job's series in the real Redis: it spans the whole job in a bounded number of points."""

from __future__ import annotations

from trillium.runtime.progress import JobProgress
from trillium.wire import state


async def test_a_long_jobs_series_spans_it_in_at_most_keep_points_the_newest_kept(infra) -> None:
    redis = state.connect(infra.redis_database(7))
    await redis.flushdb()
    progress, keep = JobProgress(redis, "series-job"), 10
    try:
        for second in range(1000):  # a point a second, as the coordinator appends them
            await progress.append_series([float(second), second * 100, 0.5, 0.25], keep)
            assert len(await progress.series()) <= keep
        series = await progress.series()
        times = [point[0] for point in series]
        assert len(series) > keep // 2 and series[-1] == [999.0, 99_900, 0.5, 0.25]
        assert times == sorted(times) and times[0] < 1000 - keep  # older points thinned, not dropped
        gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
        assert gaps == sorted(gaps, reverse=True)  # the older, the coarser
    finally:
        await redis.aclose()
