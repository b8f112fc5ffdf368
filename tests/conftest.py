"""Session fixtures: one real Kafka broker and one real Redis, started by the stack."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from trillium import stack
from trillium.config import KafkaConnection
from trillium.job.trust import ENV_ALLOWED_PATHS


@dataclass(frozen=True)
class Infra:
    run_dir: Path
    kafka_bootstrap: str
    redis_url: str

    @property
    def kafka(self) -> KafkaConnection:
        return KafkaConnection(bootstrap=self.kafka_bootstrap)

    def redis_database(self, db: int) -> str:
        """The same Redis server, another of its databases. Every stack that lives alongside
        another one takes its own: two stacks on one database share the current job and the
        worker registry."""
        parts = urlsplit(self.redis_url)
        return parts._replace(path=f"/{db}").geturl()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test that needs the broker is marked `broker`: one that uses the session's (`infra`,
    itself or through a stack's), and every end-to-end and integration test (they start stacks of
    their own). `make test-unit` runs the others, the edit-test loop's fast tier."""
    for item in items:
        own_stack = item.path.parent.name in ("e2e", "integration")
        if own_stack or "infra" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.broker)


@pytest.fixture(scope="session", autouse=True)
def allowed_paths(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Every stack of the tests lets jobs keep state under pytest's temporary directories (their
    run directories, spill directories) and read data there, the checkpoint fixtures of
    tests/data and the examples' data; a test of the limit itself names a path outside them."""
    roots = [str(tmp_path_factory.getbasetemp()), str(stack.REPO_ROOT / "tests" / "data"), "s3://trillium"]
    roots.append(str(stack.REPO_ROOT / "examples"))
    os.environ.setdefault(ENV_ALLOWED_PATHS, ",".join(roots))


@pytest.fixture(scope="session")
def infra(tmp_path_factory: pytest.TempPathFactory) -> Infra:
    run_dir = tmp_path_factory.mktemp("infra")
    st = stack.up(run_dir, services=False)
    try:
        yield Infra(run_dir, st["kafka"]["bootstrap"], st["redis"]["url"])
    finally:
        stack.down(run_dir)
