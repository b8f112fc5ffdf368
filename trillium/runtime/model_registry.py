"""The model registry: where serving finds each published model, one entry a model in the Redis
hash `trillium.wire.state.MODELS` (its name the key, the entry's JSON the value). The
coordinator's publisher writes a model's entry when it commits a version (`announce`); serving
replicas and shards read every entry to find the models they follow, and the REST API lists them
(`GET /v1/models`): one schema for the three, `RegisteredModel`."""

from __future__ import annotations

import json

from pydantic import BaseModel, Field, ValidationError

from trillium.wire import state


class RegisteredModel(BaseModel):
    """A published model, as the registry has it: serving replicas find its versions there."""

    model: str
    dir: str = Field(description="the model store its versions are in")
    topic: str = Field(description="where its versions are announced")
    version: int = Field(description="the newest version")
    job_id: str = Field(description="the job that published it")
    updated_at: float = Field(description="when that version was committed (UNIX time)")


class BadRegistryEntry(ValueError):
    """A registry entry that is not a `RegisteredModel` (written by hand, or torn): named, so a
    reader can skip it and follow the others."""


class ModelRegistry:
    def __init__(self, redis: state.aioredis.Redis) -> None:
        self.redis = redis

    async def models(self) -> dict[str, RegisteredModel | BadRegistryEntry]:
        """Every entry by model name, in name order: the model, or why its entry cannot be read."""
        raw = await self.redis.hgetall(state.MODELS)
        return {name: _parsed(name, entry) for name, entry in sorted(raw.items())}

    async def announce(self, entry: RegisteredModel) -> None:
        """Record `entry` as its model's: replicas find its newest version there."""
        await self.redis.hset(state.MODELS, entry.model, entry.model_dump_json(exclude={"model"}))


def _parsed(name: str, entry: str) -> RegisteredModel | BadRegistryEntry:
    try:
        return RegisteredModel.model_validate({**json.loads(entry), "model": name})
    except ValidationError as err:
        why = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors())
    except (ValueError, TypeError) as err:  # not JSON, or not an object
        why = str(err)
    return BadRegistryEntry(f"model registry entry {name!r} is unreadable: {why}")
