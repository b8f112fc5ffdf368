"""One rank's step on the CPU (a 1-rank gloo group): the same bits as a plain torch computation,
through the CPU path and through the CUDA path's host side (staging, one embedding leaf)."""

from __future__ import annotations

import copy
import gc
import os
import sys
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from nn_step_shapes import NUM_DENSE, SHAPES
from rank_processes import rank_processes, run_ranks
from torch.nn.parallel import DistributedDataParallel

from trillium.models import DNN
from trillium.services.nn_worker.embeddings import SlotEmbeddings
from trillium.services.nn_worker.step import Control, Trainer
from trillium.wire.batch import Batch, KeyedIds

pytestmark = pytest.mark.usefixtures("one_rank_group")  # conftest.py's 1-rank gloo group, for every test


def batch_of(dense: np.ndarray, labels: np.ndarray, shapes=SHAPES) -> Batch:
    size = len(labels)
    ids = KeyedIds.from_slots(
        {f"s{i}": (np.arange(size, dtype=np.uint64), np.ones(size, np.int32)) for i in range(len(shapes))}
    )
    return Batch(batch_id=0, epoch=0, rank=0, ids=ids, dense=dense, labels=labels)


def make_batch(rng: np.random.Generator, size: int, shapes=SHAPES) -> tuple[Batch, SlotEmbeddings]:
    dense, labels = rng.normal(size=(size, NUM_DENSE)).astype(np.float32), (rng.random(size) < 0.3).astype(np.float32)
    embeddings = SlotEmbeddings.of([rng.normal(size=(size, *shape)).astype(np.float32) for shape in shapes])
    return batch_of(dense, labels, shapes), embeddings


def copied(embeddings: SlotEmbeddings) -> SlotEmbeddings:
    return SlotEmbeddings.of([e.copy() for e in embeddings.slots()])


def make_trainer(
    precision="fp32", staged=False, world=1, rank=0, shapes=SHAPES
) -> tuple[Trainer, torch.nn.Module, torch.optim.Optimizer]:
    """A Trainer, and a copy of its model and optimizer for the plain computation."""
    torch.manual_seed(0)
    model = DNN(NUM_DENSE, [s[-1] for s in shapes], hidden=(8, 4), dense_proj=4, sparse_proj=8)
    plain = copy.deepcopy(model)
    ddp = DistributedDataParallel(model)
    trainer = Trainer(
        ThreadPoolExecutor(1),
        ddp,
        torch.optim.Adam(ddp.parameters(), lr=0.01),
        torch.device("cpu"),
        world,
        rank,
        None,
        precision,
        staged,
    )
    return trainer, plain, torch.optim.Adam(plain.parameters(), lr=0.01)


def plain_step(model, optimizer, batch: Batch, embeddings: SlotEmbeddings):
    """What a step is, written out, one tensor per slot: the gradient of the loss summed over the
    batch divided by its sample count (the mean loss's), the optimizer on it."""
    embs = [torch.from_numpy(e.copy()).requires_grad_() for e in embeddings.slots()]
    logits = model(torch.from_numpy(batch.dense), embs)
    loss_sum = F.binary_cross_entropy_with_logits(logits, torch.from_numpy(batch.labels), reduction="sum")
    optimizer.zero_grad()
    loss_sum.backward()
    for p in model.parameters():
        p.grad.div_(batch.batch_size)
    optimizer.step()
    return (
        loss_sum.item(),
        [(e.grad / batch.batch_size).numpy() for e in embs],
        torch.sigmoid(logits.detach()).numpy(),
    )


@pytest.mark.parametrize("shapes", [SHAPES, [(3, 4)], [(4,), (5,)]], ids=["mixed", "sequence", "pooled"])
@pytest.mark.parametrize("staged", [False, True])
def test_a_step_gives_the_plain_computations_bits(staged: bool, shapes) -> None:
    trainer, plain, optimizer = make_trainer(staged=staged, shapes=shapes)
    rng = np.random.default_rng(7)
    for size in (16, 40, 9):  # the staging buffer grows, then a smaller batch reuses it
        batch, embeddings = make_batch(rng, size, shapes)
        result = trainer.step(batch, copied(embeddings), paused=size == 40, seq=size, publish=size + 1)
        loss, grads, probs = result.loss_sum, result.grads, result.probs
        assert result.control == Control(samples=size, paused=size == 40, seq=size, publish=size + 1)
        want_loss, want_grads, want_probs = plain_step(plain, optimizer, batch, embeddings)
        assert loss == want_loss
        assert grads.widths == embeddings.widths and grads.pooled.shape == embeddings.pooled.shape
        assert all(g.shape == w.shape and np.array_equal(g, w) for g, w in zip(grads.slots(), want_grads, strict=True))
        assert np.array_equal(probs, want_probs)
    for mine, theirs in zip(trainer.model.parameters(), plain.parameters(), strict=True):
        assert torch.equal(mine, theirs)
    batch, embeddings = make_batch(rng, 12, shapes)
    with torch.no_grad():
        want = torch.sigmoid(plain(torch.from_numpy(batch.dense), [torch.from_numpy(e) for e in embeddings.slots()]))
    assert np.array_equal(trainer.scores(batch, embeddings), want.numpy())


def test_warm_up_changes_no_parameter_or_optimizer_state() -> None:
    trainer, _, _ = make_trainer(staged=True)
    rng = np.random.default_rng(1)
    trainer.step(*make_batch(rng, 8))  # the optimizer has state to keep
    before = copy.deepcopy(
        (trainer.model.state_dict(), trainer.optimizer.state_dict(), [p.grad for p in trainer.model.parameters()])
    )
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
        result = trainer.step(batch, copied(embeddings))
        loss, grads, probs = result.loss_sum, result.grads, result.probs
        assert np.isfinite(loss) and all(g.dtype == np.float32 and np.isfinite(g).all() for g in grads.slots())
        assert probs.dtype == np.float32
        losses.append(loss)
    assert losses[-1] < losses[0]
    fp32, _, _ = make_trainer()
    assert fp32.step(batch, copied(embeddings)).loss_sum != losses[0]  # autocast did run in bf16


def _step_ranks():
    """The context the 2-rank tests start their ranks in, the step's modules imported once."""
    return rank_processes("trillium.models", "trillium.services.nn_worker.step")


def _rank_step(rank: int, store: str, batches, embeddings, results) -> None:
    """Rank `rank` of a 2-rank gloo group (a spawned process): one step on its own batch."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        trainer, _, _ = make_trainer(world=2, rank=rank)  # both ranks start from the same seed's weights
        result = trainer.step(batches[rank], embeddings[rank], paused=rank == 1, seq=3 + rank, publish=7 - rank)
        held = trainer.control(paused=rank == 0, seq=rank, publish=2 * rank)  # outside a step: its own collective
        results.put(
            (
                rank,
                result.loss_sum,
                result.step_loss_sums,
                result.grads.slots(),
                result.control,
                held,
                [p.detach().numpy().copy() for p in trainer.model.parameters()],
            )
        )  # arrays: no shared memory
        trainer.finish()  # as a rank ends its job: a barrier, then the group torn down
    except BaseException:
        dist.destroy_process_group()
        raise


def test_two_ranks_step_as_one_process_over_both_batches_and_agree_on_the_control_words(tmp_path) -> None:
    rng = np.random.default_rng(11)
    (b0, e0), (b1, e1) = make_batch(rng, 24), make_batch(rng, 40)  # uneven: the step's count is summed
    got = run_ranks(_step_ranks(), _rank_step, [(r, str(tmp_path / "store"), [b0, b1], [e0, e1]) for r in range(2)])
    _, plain, optimizer = make_trainer()
    both = batch_of(np.concatenate([b0.dense, b1.dense]), np.concatenate([b0.labels, b1.labels]))
    joined = SlotEmbeddings.of([np.concatenate(p) for p in zip(e0.slots(), e1.slots(), strict=True)])
    want_loss, want_grads, _ = plain_step(plain, optimizer, both, joined)
    assert got[0][0] + got[1][0] == pytest.approx(want_loss, rel=1e-6)
    for rank, rows in ((0, slice(0, 24)), (1, slice(24, 64))):
        _, step_loss_sums, grads, control, held, params = got[rank]
        assert sum(step_loss_sums) == pytest.approx(want_loss, rel=1e-6)  # each rank knows the whole step's loss
        assert control == Control(samples=64, paused=True, seq=4, publish=7)  # a sum, any, maxima over the ranks
        assert held == Control(samples=0, paused=True, seq=1, publish=2)
        for g, w in zip(grads, want_grads, strict=True):
            np.testing.assert_allclose(g, w[rows], rtol=1e-5, atol=1e-7)
        for mine, theirs in zip(params, plain.parameters(), strict=True):
            np.testing.assert_allclose(mine, theirs.detach().numpy(), rtol=1e-5, atol=1e-6)


def _rank_ends(rank: int, store: str, results) -> None:
    """Rank 1 dies without ending its job; rank 0 ends it and says how long that took."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    trainer, _, _ = make_trainer(world=2, rank=rank)
    if rank == 1:
        os._exit(1)  # a peer dead before the job's end
    started = time.monotonic()
    try:
        trainer.finish(timeout=timedelta(seconds=3))
        results.put(("finished", time.monotonic() - started))
    except RuntimeError as err:
        results.put((str(err), time.monotonic() - started))


def test_a_dead_peer_fails_the_end_of_a_job_within_its_timeout(tmp_path) -> None:
    """Not the collective's 10-minute timeout: the monitored barrier names the rank it misses."""
    context = _step_ranks()
    results = context.Queue()
    ranks = [context.Process(target=_rank_ends, args=(r, str(tmp_path / "store"), results)) for r in range(2)]
    for p in ranks:
        p.start()
    error, seconds = results.get(timeout=120)
    for p in ranks:
        p.join(timeout=60)
    assert "1" in error and error != "finished" and seconds < 30, (error, seconds)


def test_no_step_leaves_its_trainer_held_by_a_gloo_callback() -> None:
    """A callback gloo's thread drops after the step returned must not hold the trainer: the last
    reference dropped there would tear its group down on the group's own thread (std::terminate,
    "Resource deadlock avoided": one run of the test below in six, on the code before)."""
    trainer, _, _ = make_trainer()
    rng = np.random.default_rng(0)
    before = sys.getrefcount(trainer)
    held = []
    for _ in range(2000):  # the old callback was still alive after one step in 20 to 500
        trainer.step(*make_batch(rng, 8))
        held.append(sys.getrefcount(trainer) - before)
    assert set(held) == {0}, [(step, n) for step, n in enumerate(held) if n]


def _gloo_threads() -> int:
    return sum((t / "comm").read_text().startswith(("pt_gloo", "gloo")) for t in Path("/proc/self/task").iterdir())


def _jobs_in_a_row(store: str, results) -> None:
    """Three jobs' groups, trainers and steps, one after the other, as one NN rank runs them."""
    for job in range(3):
        dist.init_process_group("gloo", init_method=f"file://{store}{job}", rank=0, world_size=1)
        trainer, _, _ = make_trainer()
        trainer.step(*make_batch(np.random.default_rng(job), 8))
        trainer.finish()
        ended = weakref.ref(trainer)
        del trainer
        gc.collect()
        results.put((ended() is None, _gloo_threads()))


def test_a_finished_job_leaves_no_trainer_nor_gloo_threads_behind(tmp_path) -> None:
    """DDP keeps its communication hook's state in C++, out of the GC's sight: a Trainer there
    would never be freed, and each job's group would keep its gloo threads (4 more a job, seen
    on a long-lived stack). A fresh process: the module's own group must not count."""
    context = _step_ranks()
    results = context.Queue()
    rank = context.Process(target=_jobs_in_a_row, args=(str(tmp_path / "store"), results))
    rank.start()
    ends = [results.get(timeout=120) for _ in range(3)]
    rank.join(timeout=60)
    # Torch keeps one ended DDP group's threads until later (3, whichever job ran): not one per job.
    assert [freed for freed, _ in ends] == [True] * 3 and len({threads for _, threads in ends}) == 1, ends
