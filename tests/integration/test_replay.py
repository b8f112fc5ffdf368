"""`trillium replay` into the real broker: every row once as its impression, a click for each
positive row in the same partition (the one Kafka's partitioner gives its key), each topic's
partitions in event-time order, the late and malformed shares it reports, and its pace."""

from __future__ import annotations

import json
import uuid
from collections import defaultdict
from pathlib import Path

import pytest
from aiokafka.partitioner import DefaultPartitioner
from topic_records import read_all

from trillium.data import load_job
from trillium.data.replay import replay
from trillium.data.sources.datagen import generate_criteo
from trillium.job import JobConfig

ROOT = Path(__file__).resolve().parents[2]
PARTITIONS = 4


def _job(run: str, window: float) -> JobConfig:
    raw = load_job(ROOT / "examples/online/job.yaml").model_dump(mode="json")
    raw["data"]["join"] |= {"impressions": f"imps-{run}", "labels": f"clicks-{run}", "window_seconds": window}
    return JobConfig.model_validate(raw)


@pytest.mark.parametrize("rate", [0.0, 4000.0])
async def test_replay_sends_each_row_once_co_partitioned_in_event_time_order(infra, tmp_path, rate) -> None:
    rows, window = 3000, 1.0
    data = generate_criteo(tmp_path / "stream.tsv", rows, seed=7)
    run = uuid.uuid4().hex[:8]
    job = _job(run, window)
    report = await replay(
        data.path, job, infra.kafka, fmt="criteo", rate=rate, late_fraction=0.1, malformed_fraction=0.02, seed=4
    )
    imps, clicks = (
        await read_all(infra.kafka, f"imps-{run}", PARTITIONS),
        await read_all(infra.kafka, f"clicks-{run}", PARTITIONS),
    )
    positives = sum(1 for line in data.path.read_text().splitlines() if line.split("\t")[0] == "1")

    assert report.impressions == len(imps) == rows
    assert sorted(r.key for r in imps) == sorted(f"r4-{i}".encode() for i in range(rows))
    assert report.clicks == len(clicks) == positives
    partitioner = DefaultPartitioner()
    every = list(range(PARTITIONS))
    for record in imps + clicks:
        assert record.partition == partitioner(record.key, every, every), record.key

    times: dict[str, float] = {}
    by_partition: dict[int, list[float]] = defaultdict(list)
    garbage = 0
    for record in sorted(imps, key=lambda r: (r.partition, r.offset)):
        try:
            event = json.loads(record.value)
            times[event["request_id"]] = event["ts"]
            by_partition[record.partition].append(event["ts"])
            assert {s.column for s in job.slots} <= event.keys()
            assert all(event[d.column] is None or event[d.column] == event[d.column] for d in job.dense)  # no NaN
        except (ValueError, KeyError, AssertionError):
            garbage += 1
    assert garbage == report.malformed > 0
    assert all(ts == sorted(ts) for ts in by_partition.values())
    if rate:  # row i's event time is the schedule's: the start's plus i / rate
        starts = [ts - int(key.split("-")[1]) / rate for key, ts in times.items()]
        assert max(starts) - min(starts) < 1e-5
        assert report.seconds >= (rows - 1) / rate

    click_times: dict[int, list[float]] = defaultdict(list)
    late = 0
    for record in sorted(clicks, key=lambda r: (r.partition, r.offset)):
        event = json.loads(record.value)
        click_times[record.partition].append(event["ts"])
        if event["request_id"] in times:  # its impression was not replaced by garbage
            assert event["ts"] >= times[event["request_id"]]
            late += event["ts"] - times[event["request_id"]] > window
    assert all(ts == sorted(ts) for ts in click_times.values())
    assert late <= report.late_clicks and report.late_clicks > 0
