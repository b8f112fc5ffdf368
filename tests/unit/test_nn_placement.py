"""Where NN ranks train: the collective backend for any host, with or without GPUs (no GPU needed)."""

from __future__ import annotations

import pytest
import torch

from trillium.services.nn_worker.step import choose_backend, local_placement


@pytest.mark.parametrize(
    ("idents", "backend"),
    [
        (["cpu", "cpu"], "gloo"),
        (["cuda:a", "cuda:b"], "nccl"),  # one GPU each
        (["cuda:a", "cuda:a"], "gloo"),  # two ranks on one GPU: NCCL refuses duplicate GPUs
        (["cuda:a", "cuda:b", "cuda:a"], "gloo"),
        (["cuda:a", "cpu"], "gloo"),
        (["cuda:a"], "nccl"),
    ],
)
def test_nccl_only_when_every_rank_has_a_gpu_of_its_own(idents, backend) -> None:
    chosen, why = choose_backend(idents)
    assert chosen == backend and why


def test_without_cuda_every_rank_is_on_the_cpu(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert local_placement(3).device == torch.device("cpu") and local_placement(3).ident == "cpu"


def test_the_device_can_be_forced_to_the_cpu(monkeypatch) -> None:
    monkeypatch.setenv("TRILLIUM_DEVICE", "cpu")
    assert local_placement(0).ident == "cpu"
