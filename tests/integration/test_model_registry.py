"""The model registry on a real Redis: what the publisher announces is what the API and serving
read back, field for field; an entry that cannot be read (torn, or written by hand) is named and
skipped, and the others still read."""

from __future__ import annotations

import pytest

from trillium.runtime.model_registry import BadRegistryEntry, ModelRegistry, RegisteredModel
from trillium.wire import state

pytestmark = pytest.mark.broker


async def test_an_announced_model_reads_back_and_a_bad_entry_is_named_not_fatal(infra) -> None:
    redis = state.connect(infra.redis_database(15))
    await redis.flushdb()
    try:
        registry = ModelRegistry(redis)
        first = RegisteredModel(model="b", dir="s3://m/b", topic="t.b", version=3, job_id="b-1", updated_at=1.5)
        await registry.announce(first)
        await registry.announce(first.model_copy(update={"model": "a", "dir": "/m/a", "topic": "t.a"}))
        await registry.announce(first.model_copy(update={"version": 4}))  # a newer version replaces it
        await redis.hset(state.MODELS, "torn", '{"dir": "/m/torn", "top')
        await redis.hset(state.MODELS, "short", '{"dir": "/m/short"}')
        models = await registry.models()
        assert list(models) == ["a", "b", "short", "torn"]
        assert models["b"] == first.model_copy(update={"version": 4})
        assert models["a"].dir == "/m/a" and models["a"].topic == "t.a"
        for name in ("short", "torn"):
            assert isinstance(models[name], BadRegistryEntry) and repr(name) in str(models[name])
        assert "topic" in str(models["short"])  # what it lacks
    finally:
        await redis.flushdb()
        await redis.aclose()
