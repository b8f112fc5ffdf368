"""The local stack shares the host's cores between the processes whose compute takes threads."""

from __future__ import annotations

import pytest

from trillium import stack
from trillium.config import ENV_THREADS, StackTopology
from trillium.stack.supervisor import Supervisor


@pytest.mark.parametrize(("cores", "want"), [(2, 1), (16, 4), (17, 4), (1, 1)])
def test_each_ps_shard_and_nn_rank_gets_an_equal_share_of_the_cores(tmp_path, monkeypatch, cores, want) -> None:
    monkeypatch.delenv(ENV_THREADS, raising=False)
    monkeypatch.setattr(stack.os, "cpu_count", lambda: cores)
    supervisor = Supervisor(
        tmp_path, StackTopology(nn_ranks=2, ps_shards=2), True, "127.0.0.1:9092", "redis://127.0.0.1:6379/0"
    )
    assert supervisor.service_proc("embedding_ps", 1).env[ENV_THREADS] == str(want)
    assert supervisor.service_proc("nn_worker", 0).env[ENV_THREADS] == str(want)
    assert ENV_THREADS not in supervisor.service_proc("embedding_worker", 0).env


def test_a_threads_setting_in_the_environment_is_left_to_every_service(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(ENV_THREADS, "3")
    supervisor = Supervisor(
        tmp_path, StackTopology(nn_ranks=2, ps_shards=2), True, "127.0.0.1:9092", "redis://127.0.0.1:6379/0"
    )
    assert ENV_THREADS not in supervisor.service_proc("embedding_ps", 0).env  # inherited as it is
