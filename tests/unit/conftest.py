"""Fixtures of the unit tests."""

import pytest
import torch


@pytest.fixture(autouse=True)
def one_torch_thread():
    # Tiny models: intra-op threads only add contention (badly so on a busy 2-core machine).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
