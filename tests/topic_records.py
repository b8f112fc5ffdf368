"""Every record a topic holds now, and every topic there is, read from the real broker."""

from __future__ import annotations

from aiokafka import TopicPartition

from trillium.config import KafkaConnection
from trillium.wire import kafka


async def read_all(conn: KafkaConnection, topic: str, partitions: int) -> list:
    """The records of partitions 0..partitions-1, up to each one's end offset when called."""
    consumer = kafka.consumer(conn, group_id=None)
    tps = [TopicPartition(topic, p) for p in range(partitions)]
    consumer.assign(tps)
    await consumer.start()
    try:
        ends = await consumer.end_offsets(tps)
        await consumer.seek_to_beginning(*tps)
        records = []
        while [tp for tp in tps if await consumer.position(tp) < ends[tp]]:
            for batch in (await consumer.getmany(timeout_ms=1000)).values():
                records += batch
        return records
    finally:
        await consumer.stop()


async def topic_names(conn: KafkaConnection) -> set[str]:
    """The names of every topic the broker holds now."""
    admin = kafka.admin(conn)
    await admin.start()
    try:
        return set(await admin.list_topics())
    finally:
        await admin.close()
