"""A topic the broker refuses to create is an error, not a topic taken for made: aiokafka returns
the broker's per-topic error in its admin response rather than raising it, and the job that
needed the topic failed each attempt on UnknownTopicOrPartition (bench/nemesis.py, seed 1). The
oracle is the broker's own topic list."""

from __future__ import annotations

import uuid

import pytest
from aiokafka.errors import InvalidConfigurationError
from topic_records import topic_names

from trillium.wire import kafka


async def test_a_topic_the_broker_refuses_raises_and_one_it_makes_is_made_once(infra) -> None:
    refused, made = f"refused-{uuid.uuid4().hex[:8]}", f"made-{uuid.uuid4().hex[:8]}"
    with pytest.raises(InvalidConfigurationError, match=f"could not create topic {refused}"):
        await kafka.ensure_topics(infra.kafka, {refused: 1}, {"cleanup.policy": "no-such-policy"})
    assert refused not in await topic_names(infra.kafka)

    await kafka.ensure_topics(infra.kafka, {made: 2})
    await kafka.ensure_topics(infra.kafka, {made: 2})  # there already: nothing to do, no error
    assert made in await topic_names(infra.kafka)
    await kafka.delete_topics(infra.kafka, [made])
