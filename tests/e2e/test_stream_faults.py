"""What a stream's input can do to a running job, on a real stack and broker: records no parser
expects go to the dead-letter topic while the job trains on, never costing a recovery; records
deleted before the loader read them (retention passing a stopped job's position) fail the job
naming them, or with `data.on_gap: skip` are skipped and counted."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import httpx
import pytest
from aiokafka import TopicPartition
from aiokafka.admin import RecordsToDelete
from online_jobs import FIELDS, online_job, produce
from poison import POISON
from topic_records import read_all
from waiting import wait_until

from trillium.config import KafkaConnection
from trillium.job import JobConfig
from trillium.stack import read_state, read_token
from trillium.stack.client import ApiError, CoordinatorClient
from trillium.wire import kafka


def _imp(key: str, ts: float) -> bytes:
    return json.dumps({"request_id": key, "ts": ts} | FIELDS).encode()


def _topics(conn: KafkaConnection) -> tuple[str, str, str]:
    run = uuid.uuid4().hex[:8]
    imps, clicks = f"imps-{run}", f"clicks-{run}"
    asyncio.run(kafka.ensure_topics(conn, {imps: 1, clicks: 1}))
    return run, imps, clicks


def _closed(view: dict) -> int:
    joined = view["stream"]["joined"] if view["stream"] else {}
    return joined.get("positives", 0) + joined.get("negatives", 0)


def test_poison_records_go_to_the_dead_letter_topic_while_the_job_trains_on(training_stack, infra) -> None:
    run, imps, clicks = _topics(infra.kafka)
    t = time.time() - 100
    before = [(imps, 0, _imp(f"a{i}", t + i)) for i in range(10)]
    after = [(imps, 0, _imp(f"b{i}", t + 20 + i)) for i in range(10)]
    client = CoordinatorClient.for_stack(training_stack)
    try:
        job_id = client.submit(online_job(f"poison-{run}", imps, clicks, late_labels="count"))["id"]
        asyncio.run(produce(infra.kafka, before))
        wait_until(lambda: _closed(client.job(job_id)) == 10, "the first impressions to close")
        asyncio.run(produce(infra.kafka, [(imps, 0, raw) for raw, _ in POISON] + after))
        view = wait_until(
            lambda: _closed(v := client.job(job_id)) == 20 and v["progress"]["steps"] > 0 and v,
            "the impressions after the poison to close and train",
        )
        assert view["job"]["state"] == "running" and view["job"]["recoveries"] == [], view["job"]
        assert view["stream"]["dead_letters"] == {"undecodable": 6, "bad_value": 2}, view["stream"]["dead_letters"]
        client.stop(job_id, checkpoint=False)
        wait_until(lambda: client.job(job_id)["job"]["state"] == "stopped", "the job to stop", 120)
    finally:
        client.close()
    letters = asyncio.run(read_all(infra.kafka, view["job"]["topics"]["dlq"], 1))
    by_offset = {int(dict(r.headers)["trillium-source-offset"]): r for r in letters}
    assert sorted(by_offset) == list(range(10, 10 + len(POISON)))
    for offset, (raw, reason) in enumerate(POISON, start=10):
        letter = by_offset[offset]
        assert letter.value == raw  # the raw bytes, for whoever mends them
        assert dict(letter.headers)["trillium-dlq-reason"].decode().startswith(reason), (offset, letter.headers)


def _delete_before(conn: KafkaConnection, tp: TopicPartition, offset: int) -> None:
    async def delete() -> None:
        admin = kafka.admin(conn)
        await admin.start()
        try:
            await admin.delete_records({tp: RecordsToDelete(offset)})  # as retention deletes them
        finally:
            await admin.close()

    asyncio.run(delete())


def _skipped_metric(stack, job_id: str, topic: str) -> float | None:
    coordinator = next(p for p in read_state(stack)["processes"] if p["name"] == "coordinator-0")
    text = httpx.get(
        f"{coordinator['http_url']}/metrics", headers={"Authorization": f"Bearer {read_token(stack)}"}, timeout=10
    ).text
    for line in text.splitlines():
        if line.startswith("trillium_job_input_skipped_records{") and f'job="{job_id}"' in line and topic in line:
            return float(line.rsplit(" ", 1)[1])
    return None


@pytest.mark.parametrize("on_gap", ["fail", "skip"])
def test_records_gone_before_a_resume_read_them_fail_the_job_or_are_skipped_and_counted(
    training_stack, infra, on_gap
) -> None:
    run, imps, clicks = _topics(infra.kafka)
    t = time.time() - 100
    job = online_job(f"gap-{on_gap}-{run}", imps, clicks, late_labels="count")
    raw = job.model_dump(mode="json")
    raw["data"]["on_gap"] = on_gap
    client = CoordinatorClient.for_stack(training_stack)
    try:
        job_id = client.submit(JobConfig.model_validate(raw))["id"]
        asyncio.run(produce(infra.kafka, [(imps, 0, _imp(f"a{i}", t + i)) for i in range(10)]))
        wait_until(
            lambda: _closed(v := client.job(job_id)) == 10 and v["progress"]["steps"] > 0, "the impressions to train"
        )
        client.stop(job_id)  # a checkpoint whose loader resumes at offset 10
        wait_until(lambda: client.job(job_id)["job"]["state"] == "stopped", "the stop", 120)
        asyncio.run(produce(infra.kafka, [(imps, 0, _imp(f"b{i}", t + 20 + i)) for i in range(10)]))
        _delete_before(infra.kafka, TopicPartition(imps, 0), 15)  # offsets 10..14 gone, unread
        gone = f"records gone from {imps}[0]: offsets 10..14 (5 records) were deleted"
        if on_gap == "fail":  # the resume is refused, naming the gap; the job stays stopped
            with pytest.raises(ApiError) as refused:
                client.resume(job_id)
            assert refused.value.status == 409 and gone in str(refused.value.detail), refused.value.detail
            assert client.job(job_id)["job"]["state"] == "stopped"
            return
        client.resume(job_id)
        view = wait_until(
            # The joiner's counts come back with its checkpoint: 10 before the stop, 5 after the gap.
            # The loader reads on while the NN ranks are still forming their group: the attempt is
            # running only once every worker is ready.
            lambda: (v := client.job(job_id))["stream"] and _closed(v) == 15 and v["job"]["state"] == "running" and v,
            "the records after the gap to close, the job running",
        )
        assert view["stream"]["skipped"] == {f"{imps}/0": 5}
        assert wait_until(lambda: _skipped_metric(training_stack, job_id, imps), "the gauge") == 5
        client.stop(job_id, checkpoint=False)
        wait_until(lambda: client.job(job_id)["job"]["state"] == "stopped", "the job to stop", 120)
    finally:
        client.close()
