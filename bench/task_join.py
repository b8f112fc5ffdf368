"""The multi-task joiner's memory on a long window: clicks within 10 minutes, conversions within
24 hours (trillium/data/sources/task_joiner.py), 48 hours of event time through one partition's
join, in a process of its own per cap.

An impression is tracked until its longest window closes: 24 h of impressions, unless
`max_open_per_partition` caps them. Each run feeds the same stream (impressions at `--rate` a
second of event time, each an event of Criteo's 39 fields, ~300 bytes of text; 5% clicked within
10 minutes, 1% converting within 24 h) and prints, as the stream goes, the impressions tracked and
the process's resident memory, then:

- `bytes_per_tracked`: resident memory over the baseline, per tracked impression, at the end;
- `bound_mb`: that times the cap, the memory the join can hold however long the stream runs;
- `conversions`: in the sample, corrected later, and lost to the cap (unmatched: their impression
  was forgotten before they came), against how many the stream had.

    python bench/task_join.py --json
    python bench/task_join.py --rate 20 --hours 48 --caps 250000 2000000
"""

from __future__ import annotations

import argparse
import heapq
import json
import multiprocessing
import os
import time
from typing import Any

import numpy as np

HOUR = 3600.0
CLICK_WINDOW, CONVERSION_WINDOW = 10 * 60.0, 24 * HOUR


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _job(cap: int):
    from trillium.job import JobConfig

    return JobConfig.model_validate(
        {
            "name": "task-join-bench",
            "data": {
                "source": "kafka",
                "event_time": "ts",
                "join": {
                    "impressions": "imps",
                    "key": "id",
                    "labels": [
                        {"topic": "clicks", "task": "click", "window_seconds": CLICK_WINDOW},
                        {"topic": "conversions", "task": "conversion", "window_seconds": CONVERSION_WINDOW},
                    ],
                    "max_open_per_partition": cap,
                },
            },
            "slots": [{"name": "user", "column": "user"}],
            "tables": {"user": {"dim": 4}},
            "labels": [{"name": "click", "column": "click"}, {"name": "conversion", "column": "conversion"}],
            "model": {"cls": "trillium.models:DNN", "kwargs": {"num_dense": 0, "embedding_dims": [4], "tasks": 2}},
            "training": {"batch_size": 8, "epochs": None, "staleness_bound": 4, "dense_optimizer": {"name": "sgd"}},
        }
    )


def run(cap: int, rate: float, hours: float, seed: int) -> dict[str, Any]:
    """One stream through one join of this cap (in a fresh process: its memory is the join's)."""
    from trillium.data.sources.events import FIELD_SEP, Event
    from trillium.data.sources.task_joiner import PartitionTaskJoin

    rng = np.random.default_rng(seed)
    baseline = _rss_mb()
    join = PartitionTaskJoin(_job(cap))
    n = int(rate * hours * HOUR)
    labels: list[tuple[float, int, str]] = []  # a heap of (time, task, key)
    converting = 0
    samples = 0
    progress = []
    started = time.perf_counter()
    for i in range(n):
        t = i / rate
        key = f"imp-{i}"
        ids = rng.integers(0, 2**32, 26)
        values = FIELD_SEP.join([*(f"{x:08x}" for x in ids.tolist()), *(str(v) for v in range(13))])
        join.impression(Event(values, key, t))
        if rng.random() < 0.05:
            heapq.heappush(labels, (t + rng.uniform(0, CLICK_WINDOW), 0, key))
        if rng.random() < 0.01:
            heapq.heappush(labels, (t + rng.uniform(0, CONVERSION_WINDOW), 1, key))
            converting += 1
        if i % 1000 == 999 or i == n - 1:  # the labels due by now, then the watermark
            while labels and labels[0][0] <= t:
                at, task, label_key = heapq.heappop(labels)
                join.label(task, label_key, at)
            samples += len(join.advance(t).events)
        if i % (n // 8) == n // 8 - 1:
            progress.append(
                {"event_hours": round(t / HOUR, 1), "tracked": join.tracked_count, "rss_mb": round(_rss_mb(), 1)}
            )
    seconds = time.perf_counter() - started
    tracked = join.tracked_count
    rss = _rss_mb()
    conversion = join.task_counts["conversion"]
    return {
        "max_open_per_partition": cap,
        "impressions": n,
        "event_hours": hours,
        "impressions_per_second": round(n / seconds),
        "tracked_at_end": tracked,
        "progress": progress,
        "bytes_per_tracked": round((rss - baseline) * 2**20 / max(tracked, 1)),
        "bound_mb": round((rss - baseline) / max(tracked, 1) * cap, 1),
        "counts": dict(join.counts),
        "conversions": {
            "in_stream_so_far": converting - len([1 for _, task, _ in labels if task == 1]),
            "in_sample": conversion["in_sample"],
            "corrections": conversion["corrections"],
            "lost_to_the_cap": conversion["unmatched_labels"],
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=20.0, help="impressions a second of event time")
    parser.add_argument("--hours", type=float, default=48.0, help="hours of event time streamed")
    parser.add_argument(
        "--caps",
        type=int,
        nargs="+",
        default=[250_000, 2_000_000],
        help="max_open_per_partition of each run (24 h at the default rate needs 1,728,000)",
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="one line of JSON")
    args = parser.parse_args()
    context = multiprocessing.get_context("spawn")
    runs = []
    for cap in args.caps:
        with context.Pool(1) as pool:
            runs.append(pool.apply(run, (cap, args.rate, args.hours, args.seed)))
    needed = int(args.rate * CONVERSION_WINDOW)
    report = {"windows": {"click_s": CLICK_WINDOW, "conversion_s": CONVERSION_WINDOW}, "tracked_uncapped": needed}
    print(json.dumps(report | {"runs": runs}, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
