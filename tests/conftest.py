"""Session fixtures: one real Kafka broker and one real Redis, started by the launcher."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from trillium import launcher


@dataclass(frozen=True)
class Infra:
    run_dir: Path
    kafka_bootstrap: str
    redis_url: str


@pytest.fixture(scope="session")
def infra(tmp_path_factory: pytest.TempPathFactory) -> Infra:
    run_dir = tmp_path_factory.mktemp("infra")
    st = launcher.up(run_dir, services=False)
    try:
        yield Infra(run_dir, st["kafka"]["bootstrap"], st["redis"]["url"])
    finally:
        launcher.down(run_dir)
