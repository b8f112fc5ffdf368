"""One rank's step on the CPU (a 1-rank gloo group): the same bits as a plain torch computation,
through the CPU path and through the CUDA path's host side (staging, one embedding leaf)."""

from __future__ import annotations

import copy
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from trillium.batch import Batch, KeyedIds
from trillium.models import DNN
from trillium.services.nn_worker.step import Trainer

NUM_DENSE = 3
SHAPES = [(4,), (4,), (3, 4)]  # two pooled slots and a sequence slot of max_len 3


@pytest.fixture(scope="module", autouse=True)
def one_rank_group(tmp_path_factory):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path_factory.mktemp('pg')}/store", rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


def make_batch(rng: np.random.Generator, size: int) -> tuple[Batch, list[np.ndarray]]:
    ids = KeyedIds.from_slots({f"s{i}": (np.arange(size, dtype=np.uint64), np.ones(size, np.int32))
                               for i in range(len(SHAPES))})
    batch = Batch(batch_id=0, epoch=0, rank=0, ids=ids, dense=rng.normal(size=(size, NUM_DENSE)).astype(np.float32),
                  labels=(rng.random(size) < 0.3).astype(np.float32))
    return batch, [rng.normal(size=(size, *shape)).astype(np.float32) for shape in SHAPES]


def make_trainer(precision="fp32", staged=False) -> tuple[Trainer, torch.nn.Module, torch.optim.Optimizer]:
    """A Trainer, and a copy of its model and optimizer for the plain computation."""
    torch.manual_seed(0)
    model = DNN(NUM_DENSE, [s[-1] for s in SHAPES], hidden=(8, 4), dense_proj=4, sparse_proj=8)
    plain = copy.deepcopy(model)
    ddp = DistributedDataParallel(model)
    trainer = Trainer(ThreadPoolExecutor(1), ddp, torch.optim.Adam(ddp.parameters(), lr=0.01),
                      torch.device("cpu"), 1, 0, None, precision, staged)
    return trainer, plain, torch.optim.Adam(plain.parameters(), lr=0.01)


def plain_step(model, optimizer, batch: Batch, embeddings: list[np.ndarray]):
    """What a step is, written out: the mean loss over the batch, the optimizer on it."""
    embs = [torch.from_numpy(e.copy()).requires_grad_() for e in embeddings]
    logits = model(torch.from_numpy(batch.dense), embs)
    loss_sum = F.binary_cross_entropy_with_logits(logits, torch.from_numpy(batch.labels), reduction="sum")
    optimizer.zero_grad()
    (loss_sum * (1 / batch.batch_size)).backward()
    optimizer.step()
    return loss_sum.item(), [e.grad.numpy() for e in embs], torch.sigmoid(logits.detach()).numpy()


@pytest.mark.parametrize("staged", [False, True])
def test_a_step_gives_the_plain_computations_bits(staged: bool) -> None:
    trainer, plain, optimizer = make_trainer(staged=staged)
    rng = np.random.default_rng(7)
    for size in (16, 40, 9):  # the staging buffer grows, then a smaller batch reuses it
        batch, embeddings = make_batch(rng, size)
        loss, grads, probs = trainer.step(batch, [e.copy() for e in embeddings], size)
        want_loss, want_grads, want_probs = plain_step(plain, optimizer, batch, embeddings)
        assert loss == want_loss
        assert all(g.shape == w.shape and np.array_equal(g, w) for g, w in zip(grads, want_grads, strict=True))
        assert np.array_equal(probs, want_probs)
    for mine, theirs in zip(trainer.model.parameters(), plain.parameters(), strict=True):
        assert torch.equal(mine, theirs)
    batch, embeddings = make_batch(rng, 12)
    with torch.no_grad():
        want = torch.sigmoid(plain(torch.from_numpy(batch.dense), [torch.from_numpy(e) for e in embeddings]))
    assert np.array_equal(trainer.scores(batch, embeddings), want.numpy())


def test_warm_up_changes_no_parameter_or_optimizer_state() -> None:
    trainer, _, _ = make_trainer(staged=True)
    rng = np.random.default_rng(1)
    trainer.step(*make_batch(rng, 8), 8)  # the optimizer has state to keep
    before = copy.deepcopy((trainer.model.state_dict(), trainer.optimizer.state_dict(),
                            [p.grad for p in trainer.model.parameters()]))
    trainer.warm_up(64, NUM_DENSE, SHAPES)
    model, optimizer = trainer.model.state_dict(), trainer.optimizer.state_dict()
    assert all(torch.equal(model[k], v) for k, v in before[0].items())
    assert all(torch.equal(p.grad, g) for p, g in zip(trainer.model.parameters(), before[2], strict=True))
    for k, state in before[1]["state"].items():
        assert all(torch.equal(optimizer["state"][k][name], value) for name, value in state.items())


def test_bf16_autocast_trains_on_the_cpu() -> None:
    trainer, _, _ = make_trainer(precision="bf16")
    rng = np.random.default_rng(3)
    batch, embeddings = make_batch(rng, 64)
    losses = []
    for _ in range(30):  # one batch over and over: the loss must fall
        loss, grads, probs = trainer.step(batch, [e.copy() for e in embeddings], 64)
        assert np.isfinite(loss) and all(g.dtype == np.float32 and np.isfinite(g).all() for g in grads)
        assert probs.dtype == np.float32
        losses.append(loss)
    assert losses[-1] < losses[0]
    fp32, _, _ = make_trainer()
    assert fp32.step(batch, [e.copy() for e in embeddings], 64)[0] != losses[0]  # autocast did run in bf16
