"""A model store that does not answer is not a bad version: a replica refuses nothing, says since
when the store is away, and tries again; a store that answers without a version's file is one."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
from botocore.exceptions import ConnectTimeoutError, EndpointConnectionError, ReadTimeoutError

from trillium.config import KafkaConnection
from trillium.runtime.model_store import ModelStore
from trillium.runtime.storage import filesystem, unreachable
from trillium.services.serving.follower import ModelFollower


def _loads_nothing(first):
    raise AssertionError(f"this test loads no version, but {first.version} was")


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def store_away(monkeypatch) -> str:
    """An S3 endpoint where nothing listens: every call is refused at connect."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{closed_port()}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "trillium-test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "trillium-test-secret")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    return f"s3://away-{time.monotonic_ns()}/models"


def test_what_counts_as_the_store_not_answering() -> None:
    url = "http://10.0.0.1:7070/b/k"
    away = [
        EndpointConnectionError(endpoint_url=url),
        ConnectTimeoutError(endpoint_url=url),
        ReadTimeoutError(endpoint_url=url),
        TimeoutError(),
        ConnectionResetError(),
    ]
    for err in away:
        assert unreachable(err), err
    for err in (FileNotFoundError("k"), PermissionError("k"), ValueError("not json")):
        assert not unreachable(err), err


def test_an_object_store_call_has_the_named_deadlines(store_away) -> None:
    fs, _ = filesystem(store_away)
    config = fs.config_kwargs
    assert (config["connect_timeout"], config["read_timeout"]) == (3.0, 5.0)
    assert config["retries"] == {"total_max_attempts": 1} and fs.retries == 3
    started = time.monotonic()
    with pytest.raises(Exception) as caught:
        fs.ls(store_away.removeprefix("s3://"))
    assert unreachable(caught.value), caught.value
    assert time.monotonic() - started < 5, "a refused connection took the deadlines' time"


def test_a_replica_whose_store_is_away_refuses_nothing_and_says_since_when(store_away) -> None:
    follower = ModelFollower(
        ModelStore(store_away, "m"), "trillium.m.model", KafkaConnection(bootstrap="127.0.0.1:1"), _loads_nothing
    )
    before = time.time()
    asyncio.run(follower._read_store())
    state = follower.state
    since = state.store_unreachable_since
    assert since is not None and before <= since <= time.time()
    asyncio.run(follower._read_store())
    assert state.store_unreachable_since == since, "a failure after the first moved the time it began"
    assert state.refused == [] and follower.served is None
    assert "Could not connect" in (state.store_error or ""), state.store_error


def test_a_store_that_answers_again_is_reachable_from_its_first_answer(tmp_path) -> None:
    follower = ModelFollower(
        ModelStore(str(tmp_path / "models"), "m"),
        "trillium.m.model",
        KafkaConnection(bootstrap="127.0.0.1:1"),
        _loads_nothing,
    )
    follower.state.store_unreachable_since, follower.state.store_error = time.time() - 30, "Connect timeout"
    asyncio.run(follower._read_store())  # an empty store: it answers, with no version
    assert follower.state.store_unreachable_since is None and follower.state.store_error is None
    assert follower.state.error == "no version published yet"


def test_a_replica_whose_every_version_is_refused_says_why_on_every_read(tmp_path) -> None:
    """What a predict's 503 says: the refusal, on the first read and on each after it (which skips
    the versions refused), never "no version published yet" while versions are published."""
    store = ModelStore(str(tmp_path / "models"), "m")
    follower = ModelFollower(store, "trillium.m.model", KafkaConnection(bootstrap="127.0.0.1:1"), _loads_nothing)
    asyncio.run(follower._read_store())
    assert follower.state.error == "no version published yet"
    versions = tmp_path / "models" / "m" / "versions"
    versions.mkdir(parents=True)
    (versions / "1.json").write_text('{"format": 1')  # torn: no valid manifest
    for _ in range(2):
        asyncio.run(follower._read_store())
        error = follower.state.error or ""
        assert error.startswith("no version of m loads: version 1 refused: "), error
        assert "version 1 has no valid manifest" in error, error
    assert [r.version for r in follower.state.refused] == [1] and follower.served is None
