"""The real broker and Redis the launcher starts answer their own protocols."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import uuid

import numpy as np
import pytest
import uvloop
from aiokafka import AIOKafkaClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.client import ConnectionGroup
from aiokafka.errors import KafkaConnectionError
from aiokafka.protocol.metadata import MetadataRequest

from trillium.config import ENV_KAFKA_BOOTSTRAP, ENV_REDIS_URL
from trillium.wire import kafka, state


async def test_kafka_produce_consume_round_trip(infra) -> None:
    topic = f"roundtrip-{uuid.uuid4().hex[:8]}"
    await kafka.ensure_topics(infra.kafka, {topic: 2})
    payloads = [np.arange(i, i + 1000, dtype=np.uint64).tobytes() for i in range(10)]
    producer = kafka.producer(infra.kafka)
    await producer.start()
    try:
        for i, payload in enumerate(payloads):
            await producer.send_and_wait(topic, payload, partition=i % 2, key=str(i).encode())
    finally:
        await producer.stop()
    consumer = kafka.consumer(infra.kafka, group_id=f"g-{topic}")
    consumer.subscribe([topic])
    await consumer.start()
    received: dict[bytes, bytes] = {}
    try:
        while len(received) < len(payloads):
            batch = await consumer.getmany(timeout_ms=10_000)
            assert batch, "no records within 10 s"
            for records in batch.values():
                received.update((r.key, r.value) for r in records)
        await consumer.commit()
    finally:
        await consumer.stop()
    assert received == {str(i).encode(): p for i, p in enumerate(payloads)}


def test_a_write_to_a_connection_the_broker_closed_is_a_connection_error_on_uvloop(infra) -> None:
    """What the services' loop (uvloop) does between a broker's close and aiokafka's reader
    seeing it: a request written then is a KafkaConnectionError, which aiokafka's callers retry,
    not uvloop's RuntimeError, which ends a consumer's fetcher (aio-libs/aiokafka#1038)."""

    async def main() -> None:
        client = AIOKafkaClient(**kafka._connection(infra.kafka))
        await client.bootstrap()
        try:
            (broker,) = client.cluster.brokers()
            assert await client.ready(broker.nodeId)
            connection = client._conns[(broker.nodeId, ConnectionGroup.DEFAULT)]
            connection._writer.transport.abort()  # as a broker's close reaches the transport ...
            await asyncio.sleep(0)  # ... which closes it; aiokafka's reader task runs after this one
            with pytest.raises(KafkaConnectionError, match="broken"):
                await connection.send(MetadataRequest([]))
            assert await client.ready(broker.nodeId)  # a new connection
            metadata = await client.send(broker.nodeId, MetadataRequest([]))
            assert [b.nodeId for b in client.cluster.brokers()] == [broker.nodeId] and metadata.brokers
        finally:
            await client.close()

    uvloop.run(main())


async def test_ensure_topics_is_idempotent(infra) -> None:
    topic = f"topics-{uuid.uuid4().hex[:8]}"
    await kafka.ensure_topics(infra.kafka, {topic: 3})
    await kafka.ensure_topics(infra.kafka, {topic: 3})
    admin = kafka.admin(infra.kafka)
    await admin.start()
    try:
        (described,) = await admin.describe_topics([topic])
    finally:
        await admin.close()
    assert sorted(p["partition"] for p in described["partitions"]) == [0, 1, 2]


async def test_a_new_topic_is_replicated_as_the_brokers_allow_with_min_insync_one_less(infra) -> None:
    """The broker's own description of the topics created: one broker here, so one replica and
    min.insync.replicas 1 (the rule for more brokers: tests/unit/test_kafka_replication.py);
    a topic config given explicitly is what the broker keeps."""
    chosen, pinned = f"insync-{uuid.uuid4().hex[:8]}", f"pinned-{uuid.uuid4().hex[:8]}"
    await kafka.ensure_topics(infra.kafka, {chosen: 1})
    await kafka.ensure_topics(infra.kafka, {pinned: 1}, {"min.insync.replicas": "2"})
    admin = kafka.admin(infra.kafka)
    await admin.start()
    try:
        described = {t["topic"]: t for t in await admin.describe_topics([chosen, pinned])}
        (response,) = await admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, t) for t in described])
    finally:
        await admin.close()
    insync = {
        resource[3]: dict(entry[:2] for entry in resource[4])["min.insync.replicas"] for resource in response.resources
    }
    assert insync == {chosen: "1", pinned: "2"}
    assert {t: len(d["partitions"][0]["replicas"]) for t, d in described.items()} == {chosen: 1, pinned: 1}


async def test_ensure_partitions_grows_a_topic_and_never_shrinks_it(infra) -> None:
    """A job resharded onto more PS shards gets a gradients partition for each."""
    topic = f"grow-{uuid.uuid4().hex[:8]}"
    await kafka.ensure_topics(infra.kafka, {topic: 2})
    await kafka.ensure_partitions(infra.kafka, {topic: 3})
    await kafka.ensure_partitions(infra.kafka, {topic: 1})  # fewer: left as it is
    admin = kafka.admin(infra.kafka)
    await admin.start()
    try:
        (described,) = await admin.describe_topics([topic])
    finally:
        await admin.close()
    assert sorted(p["partition"] for p in described["partitions"]) == [0, 1, 2]


async def test_redis_round_trip(infra) -> None:
    client = state.connect(infra.redis_url)
    try:
        key = state.key("test", uuid.uuid4().hex)
        await client.hset(key, mapping={"a": "1", "b": "two"})
        assert await client.hgetall(key) == {"a": "1", "b": "two"}
        assert await client.config_get("appendonly") == {"appendonly": "yes"}
    finally:
        await client.aclose()


def test_independent_clients_see_the_servers(infra) -> None:
    """redis-cli (Debian's) talks to the same server the launcher reports."""
    port = infra.redis_url.rsplit(":", 1)[1].split("/")[0]
    out = subprocess.run(["redis-cli", "-p", port, "PING"], capture_output=True, text=True, timeout=10)
    assert out.stdout.strip() == "PONG"


def test_service_with_bad_config_fails_naming_the_field(tmp_path) -> None:
    env = {ENV_KAFKA_BOOTSTRAP: "127.0.0.1:1", ENV_REDIS_URL: "http://not-redis", "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-m", "trillium.services.embedding_ps", "--http-port", "0"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert out.returncode == 2
    assert "redis_url: Value error, must start with redis://" in out.stderr
    assert "token: Field required (set TRILLIUM_TOKEN)" in out.stderr
    assert "Traceback" not in out.stderr
