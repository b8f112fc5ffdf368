"""Online jobs as the end-to-end tests run them (test_online.py, test_stream_faults.py):
examples/online/job.yaml on topics of a test's own, the fields its impressions map, and messages
written into those topics."""

from __future__ import annotations

from pathlib import Path

from trillium.config import KafkaConnection
from trillium.data import load_job
from trillium.job import JobConfig
from trillium.wire import kafka

ROOT = Path(__file__).resolve().parents[2]

# Every field an impression of the online job maps, with a value.
FIELDS = {f"C{i}": "x" for i in range(1, 27)} | {f"I{i}": 1.0 for i in range(1, 14)}


def online_job(name: str, impressions: str, clicks: str, late_labels: str = "correct", **training) -> JobConfig:
    """examples/online/job.yaml on these topics: the join of the example, a 2 s window."""
    raw = load_job(ROOT / "examples/online/job.yaml").model_dump(mode="json")
    raw["name"] = name
    raw["data"]["join"] |= {
        "impressions": impressions,
        "labels": clicks,
        "window_seconds": 2.0,
        "allowed_lateness_seconds": 0.5,
        "late_labels": late_labels,
    }
    raw["training"] |= training
    raw["topology"] |= {"data_loaders": 1}
    return JobConfig.model_validate(raw)


async def produce(conn: KafkaConnection, messages: list[tuple[str, int, bytes]]) -> None:
    """Write each `(topic, partition, value)` in turn, and wait until the broker has them all."""
    producer = kafka.producer(conn)
    await producer.start()
    try:
        for topic, partition, value in messages:
            await producer.send(topic, value, partition=partition)
        await producer.flush()
    finally:
        await producer.stop()
