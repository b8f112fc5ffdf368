"""A training stack (2 NN ranks, 2 PS shards, 1 embedding worker, 2 data loaders) on the session's
real Kafka and Redis, and helpers to run a job on it to the end."""

from __future__ import annotations

from pathlib import Path
import pytest

from trillium import launcher
from trillium.config import Topology
from trillium.job import JobConfig, load_job

from pipeline_helpers import DATA


@pytest.fixture(scope="session")
def training_stack(infra, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("training-stack")
    launcher.up(run_dir, Topology(nn_ranks=2, ps_shards=2, embedding_workers=1, data_loaders=2),
                kafka_bootstrap=infra.kafka_bootstrap, redis_url=infra.redis_database(2))
    yield run_dir
    launcher.down(run_dir)


@pytest.fixture(scope="session")
def tiny_job() -> JobConfig:
    return load_job(DATA / "tiny_job.yaml")
