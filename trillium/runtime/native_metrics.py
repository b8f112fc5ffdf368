"""Latency histograms a native data plane keeps (a PS shard's or an embedding worker's server),
exported as prometheus_client exports a Histogram: its buckets, `_sum` and `_count`, under the
names the Python servers had, so dashboards read them unchanged."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector

import trillium_native

# (count, seconds, the count of each bucket of `trillium_native.ShardServer.buckets()` and of +Inf)
Counts = tuple[int, float, list[int]]


class NativeHistograms(Collector):
    """One histogram family per name, each read when scraped by its `read()` (None: no server yet)."""

    def __init__(self, families: dict[str, tuple[str, Callable[[], Counts | None]]], labels: dict[str, str]) -> None:
        self.families = families
        self.labels = labels

    def collect(self) -> Iterator[HistogramMetricFamily]:
        bounds = [*(repr(b) for b in trillium_native.ShardServer.buckets()), "+Inf"]
        for name, (documentation, read) in self.families.items():
            family = HistogramMetricFamily(name, documentation, labels=list(self.labels))
            counts = read()
            if counts is not None:
                _, seconds, per_bucket = counts
                buckets = list(zip(bounds, itertools.accumulate(per_bucket), strict=True))
                family.add_metric(list(self.labels.values()), buckets, seconds)
            yield family
