"""A serving replica's own rules, without a stack: a pin asked while a newer version is being
applied wins (the catch-up never overwrites it), versions changing under every try of one request
are a 503 (busy, not broken), and /readyz says ready only once every model has tried its first
load, however long that takes."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest
from fastapi import HTTPException
from fastapi.testclient import TestClient
from unconnected import unconnected_settings

from trillium.config import KafkaConnection
from trillium.services.serving import served as served_module
from trillium.services.serving.follower import ModelFollower
from trillium.services.serving.server import ServingReplica


def _loads_nothing(first):
    raise AssertionError(f"this test loads no version, but {first.version} was")


class SlowStore:
    """Versions 1 and 2; reading version 2's manifest holds until `release` (or a second)."""

    model = "m"

    def __init__(self) -> None:
        self.reading = threading.Event()  # version 2's manifest is being read
        self.release = threading.Event()

    def versions(self) -> list[int]:
        return [1, 2]

    def manifest(self, version: int) -> SimpleNamespace:
        if version == 2:
            self.reading.set()
            self.release.wait(1.0)
        return SimpleNamespace(version=version)


class Served:
    """A model at one version that never takes another on top (each is loaded whole)."""

    def __init__(self, version: int) -> None:
        self.version = version
        self.manifest = SimpleNamespace(version=version)

    def fits(self, manifest) -> bool:
        return False


def test_a_pin_asked_while_a_newer_version_is_applied_is_what_serves_after() -> None:
    store = SlowStore()
    follower = ModelFollower(store, "trillium.m.model", KafkaConnection(bootstrap="127.0.0.1:1"), _loads_nothing)

    async def load_chain(version: int) -> Served:
        if version == 1:  # the pin's load: the catch-up's read of version 2 may end now
            store.release.set()
        return Served(version)

    follower._load_chain = load_chain  # type: ignore[method-assign]
    follower.served = Served(1)

    async def scenario() -> None:
        catch_up = asyncio.create_task(follower._catch_up())  # reads version 2 (held)
        assert await asyncio.to_thread(store.reading.wait, 10)
        await follower.pin(1)
        await catch_up

    asyncio.run(scenario())
    assert follower.state.pinned == 1
    assert follower.served.version == 1, "the catch-up served version 2 over the pin"


def test_versions_changing_under_every_try_of_a_request_are_a_503(monkeypatch) -> None:
    model = object.__new__(served_module.ServedModel)
    model.name, model.layout = "m", None
    encoder = SimpleNamespace(batch=lambda instances: SimpleNamespace(ids=None))
    model._versions = {1: SimpleNamespace(encoder=encoder, manifest=SimpleNamespace(version=1))}
    # The tables are at version 1 when a request starts, and a newer one by its lookup, every time.
    model.tables = SimpleNamespace(version=1, lookup=lambda wanted: ([], 2, []))
    monkeypatch.setattr(served_module.pooling, "plan", lambda layout, ids: SimpleNamespace(tables={}))
    replica = ServingReplica(unconnected_settings("serving"))
    replica.followers["m"] = SimpleNamespace(served=model, state=SimpleNamespace(error=None))
    with pytest.raises(HTTPException) as refused:
        replica.predict("m", [{}], "rest")
    assert refused.value.status_code == 503 and "versions changed" in refused.value.detail


def test_ready_only_once_every_model_has_tried_its_first_load() -> None:
    replica = ServingReplica(unconnected_settings("serving"))
    replica.ready = True  # started: its servers answer
    with TestClient(replica.app) as http:
        assert http.get("/readyz").status_code == 503
        replica._first_load.set()
        assert http.get("/readyz").json() == {"ready": True}
