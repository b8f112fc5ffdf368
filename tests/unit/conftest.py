"""Fixtures of the unit tests."""

import pytest
import torch
import torch.distributed as dist


@pytest.fixture(autouse=True)
def one_torch_thread():
    # Tiny models: intra-op threads only add contention (badly so on a busy 2-core machine).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def one_rank_group(tmp_path_factory):
    """A 1-rank gloo group for the whole of a module that asks for it (its `pytestmark`)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path_factory.mktemp('pg')}/store", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
