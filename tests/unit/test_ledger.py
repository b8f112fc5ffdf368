"""The PS shards' gradient ledger (trillium.runtime.ledger) and the check on it (tests/ledger.py):
the runs it keeps, its checkpoint form, a reshard's merge, and — through the shard's own apply
path — that a state which did not drop an abandoned attempt's steps at a restore fails the check,
as one with a step missing or a ledger unknown does."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from ledger import ledger_problems, train_steps
from unconnected import unconnected_settings

import trillium_native
from trillium.data import load_job
from trillium.runtime.checkpoint import CheckpointDir, Manifest, PartFile, ledger_file
from trillium.runtime.ledger import GradientLedger
from trillium.services.embedding_ps.server import EmbeddingPS
from trillium.wire import codec
from trillium.wire.batch import GradientUpdate

TINY_JOB = Path(__file__).resolve().parents[1] / "data" / "tiny_job.yaml"


def test_in_order_steps_of_one_attempt_keep_one_run_per_rank() -> None:
    ledger = GradientLedger()
    for step in range(1000):
        assert ledger.record(0, step, (0, 1)) == []
    for step in range(1000, 1500):
        ledger.record(1, step, (0, 1))
    assert ledger.contained == {r: [(0, 999, 0), (1000, 1499, 1)] for r in (0, 1)}
    assert ledger.steps(0) == [(0, 1499)] and ledger.duplicate_count == 0
    assert len(ledger.dumps()) < 200  # 3000 applications, a few runs


def test_a_step_out_of_order_joins_its_neighbours_and_a_second_one_is_a_duplicate() -> None:
    ledger = GradientLedger()
    for step in (0, 1, 3, 4, 7):
        ledger.record(0, step, (0,))
    ledger.record(0, 2, (0,))
    assert ledger.contained[0] == [(0, 4, 0), (7, 7, 0)]
    assert ledger.record(1, 3, (0, 1)) == [0]  # rank 0 held step 3; rank 1 did not
    assert ledger.record(1, 4, (0,)) == [0]
    assert ledger.duplicates == {0: [(3, 4, 1)]} and ledger.duplicate_count == 2
    assert ledger.contained[1] == [(3, 3, 1)]
    assert not ledger.holds(0, 5) and ledger.holds(0, 7) and ledger.holds(0, 0)


def test_the_json_form_round_trips_and_refuses_overlapping_runs() -> None:
    ledger = GradientLedger()
    for step in (0, 1, 2, 5):
        ledger.record(2, step, (0, 3))
    ledger.record(3, 1, (3,))
    again = GradientLedger.loads(ledger.dumps())
    assert again.to_json() == ledger.to_json() and again.contained == ledger.contained
    assert GradientLedger.loads(GradientLedger.unknown(39).dumps()).unknown_through == 39
    with pytest.raises(ValueError, match="not sorted and disjoint"):
        GradientLedger.from_json({"contained": {"0": [[0, 5, 0], [5, 9, 0]]}})


def test_a_resharded_state_holds_what_every_old_shard_held() -> None:
    a, b = GradientLedger(), GradientLedger()
    for step in range(10):
        a.record(0, step, (0, 1))
        if step != 6:
            b.record(0 if step < 5 else 1, step, (0, 1))
    b.record(1, 2, (1,))  # a duplicate on the old shard 1
    merged = GradientLedger.merged([a, b], 9)
    assert merged.steps(0) == [(0, 5), (7, 9)]  # step 6's rows from shard 1 lack it
    assert merged.contained[0] == [(0, 5, 0), (7, 9, 0)]  # attributed as the first old shard has them
    assert merged.duplicates == {1: [(2, 2, 1)]} and merged.duplicate_count == 1
    assert GradientLedger.merged([a, None], 9).to_json() == GradientLedger.unknown(9).to_json()


def test_a_checkpoint_without_a_ledger_file_reads_as_none(tmp_path) -> None:
    ckdir = CheckpointDir(str(tmp_path))
    ledger = GradientLedger()
    ledger.record(0, 0, (0,))
    size, sha = ckdir.write_bytes(ledger_file(1), ledger.dumps().encode())
    part = PartFile(name=ledger_file(1), role="embedding_ps", index=1, bytes=size, sha256=sha, seconds=0.0)
    manifest = SimpleNamespace(files=[part], file=lambda name: part)
    assert ckdir.read_ledger(manifest, 1).contained == {0: [(0, 0, 0)]}  # type: ignore[arg-type]
    assert ckdir.read_ledger(SimpleNamespace(files=[]), 0) is None  # type: ignore[arg-type]
    assert "ledger" not in Manifest.model_fields  # it travels as a file of the PS part


def test_the_expected_steps_come_from_the_config() -> None:
    job = load_job(TINY_JOB)  # 1000 rows, batches of 50, 2 ranks: 10 steps an epoch
    assert train_steps(job) == 10 * job.training.epochs
    short = job.model_copy(update={"training": job.training.model_copy(update={"batch_size": 60, "epochs": 2})})
    assert train_steps(short) == 2 * 9  # 17 batches, the last of 40 rows: 9 steps, rank 1's last one empty
    several = job.model_copy(update={"topology": job.topology.model_copy(update={"data_loaders": 2})})
    with pytest.raises(ValueError, match="steps_per_epoch"):
        train_steps(several)
    assert train_steps(several, steps_per_epoch=11) == 11 * job.training.epochs


# ---- through the shard's apply path --------------------------------------------------------------------


class _Progress:
    """What a shard's apply path writes to Redis: the ledger it reports with each step applied."""

    def __init__(self, attempt: int) -> None:
        self.attempt = attempt
        self.reported: str | None = None

    async def set_applied_all(self, shard: int, ranks: int, step: int, ledger: str | None = None) -> None:
        self.reported = ledger


def _shard() -> tuple[EmbeddingPS, trillium_native.EmbeddingStore]:
    config = load_job(TINY_JOB)
    ps = EmbeddingPS(unconnected_settings("embedding_ps"))
    store = trillium_native.EmbeddingStore(threads=1)
    table = config.tables["a"]
    store.create_table("a", **table.store_kwargs(config.training.seed), **table.tier_kwargs())
    return ps, store


def _step(step: int) -> list:
    """Step `step` of ranks 0 and 1, one message from their embedding worker."""
    ids = np.array([step % 7, 100 + step], np.uint64)
    grads = np.full((2, 4), 0.1, np.float32)
    update = GradientUpdate(ranks=(0, 1), step=step, epoch=0, shard=0, tables={"a": (ids, grads)})
    message = codec.encode_gradients(update)  # as it comes off the gradients topic
    return [(step, {0: (message, step, False), 1: (message, step, False)})]


async def _train(ps: EmbeddingPS, store, progress: _Progress, steps: range) -> None:
    for step in steps:
        await ps._apply_steps(store, _step(step), progress)  # type: ignore[arg-type]


def _view(attempts: dict[int, str | None]) -> dict:
    """A finished job's view on one PS shard, its last ledger in each attempt."""
    last = max(attempts)
    ledgers = {str(a): ({"0": GradientLedger.loads(raw).to_json()} if raw else {}) for a, raw in attempts.items()}
    return {"job": {"attempt": last, "config": {"topology": {"ps_shards": 1}}}, "ledgers": ledgers}


@pytest.mark.parametrize("restore_drops_the_abandoned_steps", [True, False], ids=["restored", "not-rolled-back"])
async def test_steps_applied_again_after_a_restore_that_kept_them_fail_the_check(
    restore_drops_the_abandoned_steps,
) -> None:
    """Attempt 0 trains steps 0..5, is cut at step 3 (its ledger captured with the store, as
    `capture` does) and abandoned; attempt 1 restores and trains 4..9. A restore that drops what
    attempt 0 applied after the cut passes; one that keeps it (the state not rolled back) holds
    steps 4 and 5 twice, and the check names them — the ranks' own counters would not see it."""
    ps, store = _shard()
    first = _Progress(attempt=0)
    await _train(ps, store, first, range(0, 4))
    at_the_cut = ps._ledger.copy()
    await _train(ps, store, first, range(4, 6))  # after the cut: lost with the attempt
    if restore_drops_the_abandoned_steps:
        ps._ledger = GradientLedger.loads(at_the_cut.dumps())  # through its checkpoint form
    second = _Progress(attempt=1)
    await _train(ps, store, second, range(4, 10))
    problems = ledger_problems(_view({0: first.reported, 1: second.reported}), steps=10, ranks=2)
    if restore_drops_the_abandoned_steps:
        assert problems == []
        assert ps._ledger.contained == {r: [(0, 3, 0), (4, 9, 1)] for r in (0, 1)}
    else:
        assert len(problems) == 1, problems
        assert "attempt 1, shard 0: 4 (step, rank) applied again" in problems[0]
        assert "{'0': [[4, 5, 1]], '1': [[4, 5, 1]]}" in problems[0]


async def test_a_missing_step_an_unknown_ledger_and_a_shard_that_reported_none_fail_the_check() -> None:
    ps, store = _shard()
    progress = _Progress(attempt=0)
    await _train(ps, store, progress, range(0, 9))
    assert ledger_problems(_view({0: progress.reported}), steps=9, ranks=2) == []
    problems = ledger_problems(_view({0: progress.reported}), steps=10, ranks=2)
    assert problems == [
        f"shard 0, rank {r}: holds steps [(0, 8)], expected 0..9 once each" for r in (0, 1)
    ]  # the last step never applied
    assert ledger_problems(_view({0: progress.reported}), steps=9, ranks=3) == [
        "shard 0, rank 2: holds steps [], expected 0..8 once each"
    ]
    unknown = GradientLedger.unknown(3)
    for step in range(4, 9):
        unknown.record(1, step, (0, 1))
    problems = ledger_problems(_view({0: progress.reported, 1: unknown.dumps()}), steps=9, ranks=2)
    assert "shard 0: restored from a checkpoint without a ledger (step 3)" in problems[0]
    assert ledger_problems(_view({0: progress.reported, 1: None}), steps=9, ranks=2) == [
        "shard 0: no ledger in attempt 1: what its state holds is unknown"
    ]
