"""A rank's staleness statistics in the real Redis, as the NN rank records them (what its lookups
saw since its last progress report) and the coordinator reads them: one script call a report, which
survives a Redis that lost its scripts (a restart)."""

from __future__ import annotations

from trillium.runtime.progress import STALENESS_BUCKETS, JobProgress, StalenessCounts
from trillium.wire import state


async def test_each_lookups_staleness_lands_in_its_ranks_histogram_count_mean_and_max(infra) -> None:
    redis = state.connect(infra.redis_database(9))
    await redis.flushdb()
    try:
        writer, reader = JobProgress(redis, "stale-job"), JobProgress(redis, "stale-job")
        await reader.set_bound(None)
        observed = {0: [0, 3, 1, 3, 40], 1: [2]}
        reports = {0: [[0, 3], [1, 3, 40], []], 1: [[2]]}  # rank 0's in three reports, the last with none
        for rank, parts in reports.items():
            counts = StalenessCounts()
            for n, values in enumerate(parts):
                if n == 1:  # as after a Redis restart: the scripts are gone, recording goes on
                    await redis.script_flush()
                for staleness in values:
                    counts.add(staleness)
                await writer.record_staleness(rank, counts)
                assert counts.take() is None  # recorded once
        stats = await reader.staleness(ranks=3)
        for rank, values in observed.items():
            histogram = [0] * STALENESS_BUCKETS
            for staleness in values:
                histogram[min(staleness, STALENESS_BUCKETS - 1)] += 1
            assert stats[rank].as_dict() == {
                "bound": None,
                "max": max(values),
                "mean": round(sum(values) / len(values), 4),
                "count": len(values),
                "histogram": histogram,
            }
        assert stats[2].count == 0 and stats[2].max == 0
    finally:
        await redis.aclose()
