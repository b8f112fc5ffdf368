"""A new topic's replication by the cluster's size: the broker's own view of it is
tests/integration/test_infra.py (one broker); the rule for larger clusters is checked here."""

from __future__ import annotations

import pytest

from trillium.wire.kafka import replication


@pytest.mark.parametrize(
    ("brokers", "replicas", "insync"),
    [(1, 1, "1"), (2, 2, "1"), (3, 3, "2"), (7, 3, "2")],
)
def test_a_write_is_acknowledged_by_all_replicas_but_one(brokers: int, replicas: int, insync: str) -> None:
    assert replication(brokers) == (replicas, {"min.insync.replicas": insync})


def test_a_topic_config_given_is_kept_beside_it_and_wins() -> None:
    configs = {"retention.ms": "1000", "min.insync.replicas": "3"}
    assert replication(5, configs) == (3, configs)
    assert replication(3, {"retention.ms": "1000"}) == (3, {"min.insync.replicas": "2", "retention.ms": "1000"})
