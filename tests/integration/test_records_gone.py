"""A gap in a topic is never read past silently, against the real broker: records deleted before
a reader reached them (as retention deletes them) are an error naming the topic, partition and
offsets lost, and a recovery never picks a checkpoint whose records are gone."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from aiokafka import TopicPartition
from aiokafka.admin import RecordsToDelete
from written_checkpoints import write_checkpoint

from trillium.data import load_job
from trillium.job.record import IllegalTransition
from trillium.runtime.checkpoint import DENSE
from trillium.services.coordinator.jobs import JobStore
from trillium.wire import kafka, state

TINY_JOB = Path(__file__).resolve().parents[1] / "data" / "tiny_job.yaml"


async def _topic_of(conn, records: int, *, deleted_before: int) -> TopicPartition:
    """A new topic of one partition holding `records` records, those before `deleted_before` deleted."""
    tp = TopicPartition(f"gone-{uuid.uuid4().hex[:8]}", 0)
    await kafka.ensure_topics(conn, {tp.topic: 1})
    await _fill(conn, tp, records, deleted_before)
    return tp


async def _fill(conn, tp: TopicPartition, records: int, deleted_before: int) -> None:
    producer = kafka.producer(conn)
    await producer.start()
    try:
        for i in range(records):
            await producer.send(tp.topic, b"record %d" % i, partition=tp.partition)
        await producer.flush()
    finally:
        await producer.stop()
    admin = kafka.admin(conn)
    await admin.start()
    try:
        await admin.delete_records(
            {tp: RecordsToDelete(deleted_before)}
        )  # the log's start moves, as retention moves it
    finally:
        await admin.close()


async def _read_from(conn, tp: TopicPartition, position: int) -> list[int]:
    reader = kafka.positioned_consumer(conn, group_id=None)
    reader.assign([tp])
    await reader.start()
    try:
        reader.seek(tp, position)
        return [r.offset for r in (await kafka.fetch(reader, tp, timeout_ms=2000)).get(tp, [])]
    finally:
        await reader.stop()


async def test_a_reader_behind_the_log_start_is_told_which_records_are_gone(infra) -> None:
    tp = await _topic_of(infra.kafka, 10, deleted_before=6)
    with pytest.raises(kafka.RecordsGone, match=rf"{tp.topic}\[0\]: offsets 3\.\.5 \(3 records\) were deleted") as gone:
        await _read_from(infra.kafka, tp, 3)
    assert (gone.value.position, gone.value.start, gone.value.end, gone.value.lost) == (3, 6, 10, 3)
    assert await _read_from(infra.kafka, tp, 6) == [6, 7, 8, 9]  # from the log's start on, nothing is missing


async def test_a_position_past_the_log_end_is_an_error_and_the_end_itself_is_not(infra) -> None:
    tp = await _topic_of(infra.kafka, 4, deleted_before=0)
    with pytest.raises(kafka.RecordsGone, match="the position 9 is past the log's end 4") as gone:
        await _read_from(infra.kafka, tp, 9)
    assert gone.value.lost == 0
    assert await _read_from(infra.kafka, tp, 4) == []  # caught up: the next record is not written yet


async def test_a_recovery_never_picks_a_checkpoint_whose_records_are_gone(infra, tmp_path) -> None:
    redis = state.connect(infra.redis_database(13))
    await redis.flushdb()
    try:
        jobs = JobStore(redis, tmp_path, infra.kafka)
        raw = load_job(TINY_JOB).model_dump(mode="json")
        raw["checkpoint"] = (raw.get("checkpoint") or {}) | {"dir": str(tmp_path / "checkpoints"), "keep_last": 3}
        job = await jobs.create(type(load_job(TINY_JOB)).model_validate(raw))
        samples = TopicPartition(job.topics.samples, 0)
        await kafka.ensure_topics(infra.kafka, {samples.topic: 1})
        await _fill(infra.kafka, samples, 10, deleted_before=5)  # the samples before offset 5 trimmed
        write_checkpoint(jobs, job, 3, {samples.topic: {0: 3}}, None)  # its rank resumes at offset 3: gone
        write_checkpoint(jobs, job, 8, {samples.topic: {0: 8}}, 3)
        assert (await jobs.pick_checkpoint(job)).manifest.step == 8
        with pytest.raises(
            IllegalTransition, match=rf"{samples.topic}\[0\]: offsets 3\.\.4 \(2 records\) were deleted"
        ):
            await jobs.pick_checkpoint(job, step=3)
        # The newest refused (a file lost): the one before it has a gap, so there is none to recover from.
        (Path(jobs.checkpoints(job).location(8)) / DENSE).unlink()
        with pytest.raises(IllegalTransition, match="no complete checkpoint to recover from") as none:
            await jobs.pick_checkpoint(job)
        assert "checkpoint at step 3: records gone" in str(none.value)
    finally:
        await redis.flushdb()
        await redis.aclose()
