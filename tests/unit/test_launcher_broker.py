"""The local broker's heap is a setting of the launcher, checked before a JVM is started."""

from __future__ import annotations

import pytest

from trillium.stack.broker import DEFAULT_KAFKA_HEAP, ENV_KAFKA_HEAP, kafka_heap
from trillium.stack.procs import LauncherError


def test_the_broker_heap_defaults_and_follows_the_environment(monkeypatch) -> None:
    monkeypatch.delenv(ENV_KAFKA_HEAP, raising=False)
    assert kafka_heap() == DEFAULT_KAFKA_HEAP
    monkeypatch.setenv(ENV_KAFKA_HEAP, "2g")
    assert kafka_heap() == "2g"


@pytest.mark.parametrize("heap", ["", "0m", "12x", "768 m", "-1g", "1.5g"])
def test_a_malformed_broker_heap_is_refused_naming_the_variable(monkeypatch, heap) -> None:
    monkeypatch.setenv(ENV_KAFKA_HEAP, heap)
    with pytest.raises(LauncherError, match=ENV_KAFKA_HEAP):
        kafka_heap()
