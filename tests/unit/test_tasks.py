"""Multi-task jobs (`labels:`): the schema's checks, a block's labels (NaN where a row has none,
malformed rows quarantined with their reason), the objective's loss against the losses written
out in numpy, and one rank's step against a plain torch computation of that loss."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from nn_step_shapes import NUM_DENSE, SHAPES
from pydantic import ValidationError

from trillium.data.features import BatchBuilder, Encoder, TextCells
from trillium.data.sources.events import FIELD_SEP, EventReader, EventRows
from trillium.job import JobConfig, TaskConfig
from trillium.models import MMoE, Objective
from trillium.services.nn_worker.embeddings import SlotEmbeddings
from trillium.services.nn_worker.step import Trainer
from trillium.wire.batch import Batch, KeyedIds

pytestmark = pytest.mark.usefixtures("one_rank_group")  # conftest.py's 1-rank gloo group, for every test

TASKS = [
    {"name": "click", "column": "click", "negative": "0"},
    {"name": "watch", "column": "watch", "kind": "regression", "transform": "log", "weight": 0.5},
    {"name": "buy", "column": "buy", "mask": "clicked", "weight": 2.0},
]


def job_of(train: Path | str = "train.csv", labels: list[dict[str, Any]] | None = None, **data: Any) -> JobConfig:
    return JobConfig.model_validate(
        {
            "name": "mt",
            "data": {"source": "csv", "train": str(train), **data},
            "slots": [{"name": "user", "column": "user"}],
            "tables": {"user": {"dim": 2}},
            "labels": TASKS if labels is None else labels,
            "model": {"cls": "trillium.models:MMoE", "kwargs": {"num_dense": 0, "embedding_dims": [2], "tasks": 3}},
            "training": {"batch_size": 4, "staleness_bound": 0, "dense_optimizer": {"name": "sgd"}},
        }
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"label": {"column": "click", "positive": "1"}}, "give `label` (one task) or `labels` (several)"),
        ({"labels": [TASKS[0], {**TASKS[1], "name": "click"}]}, "labels[1]: duplicate task name 'click'"),
        ({"labels": [TASKS[0], {**TASKS[1], "column": "click"}]}, "column 'click' is another task's label"),
        ({"labels": [{**TASKS[0], "weight": 0}]}, "every task has weight 0"),
        ({"labels": [{**TASKS[1], "loss": "bce"}]}, "a regression task's loss is mse or huber"),
        ({"labels": [{**TASKS[0], "transform": "log"}]}, "transform is for regression tasks"),
        ({"labels": [{**TASKS[1], "positive": "1"}]}, "positive/negative are for binary tasks"),
        ({"labels": [{**TASKS[0], "name": "bad name"}]}, "String should match pattern"),
        ({"labels": [{**TASKS[0], "column": "user"}]}, "labels: task 'click': column 'user' is also used as a feature"),
        ({"labels": [{**TASKS[2], "mask": "user"}]}, "labels: task 'buy': column 'user' is also used as a feature"),
    ],
)
def test_a_bad_task_fails_naming_it(change: dict[str, Any], message: str) -> None:
    raw = job_of().model_dump(exclude_none=True)
    raw.update(change)
    with pytest.raises(ValidationError, match=".*".join(map(_escaped, message.split("*")))):
        JobConfig.model_validate(raw)


def _escaped(text: str) -> str:
    import re

    return re.escape(text)


def test_the_label_shorthand_is_one_binary_task() -> None:
    raw = job_of().model_dump(exclude_none=True)
    del raw["labels"]
    raw["label"] = {"column": "click", "positive": ["yes"], "negative": "no"}
    job = JobConfig.model_validate(raw)
    assert not job.multitask
    assert job.tasks == [TaskConfig(name="label", column="click", positive=["yes"], negative=["no"])]
    assert job_of().multitask and [t.name for t in job_of().tasks] == ["click", "watch", "buy"]


def test_a_blocks_labels_are_each_tasks_and_malformed_rows_are_quarantined(tmp_path: Path) -> None:
    rows = [
        ("u1", "1", "12.5", "1", "1"),  # every task labelled
        ("u2", "", "3", "0", "1"),  # no click label
        ("u3", "0", "", "1", "0"),  # no watch; buy masked off
        ("u4", "0", "2", "1", ""),  # an empty mask is off
        ("u5", "2", "1", "0", "1"),  # click: neither 1 nor 0
        ("u6", "1", "abc", "0", "1"),  # watch: no number
        ("u7", "1", "0", "0", "1"),  # watch: log(0)
        ("u8", "1", "1", "0", "maybe"),  # mask: neither on nor off
        ("u9", "", "", "1", "0"),  # nothing labelled
        ("u10", "0", "7", "", "true"),  # buy empty: no label
    ]
    train = tmp_path / "train.csv"
    train.write_text("user,click,watch,buy,clicked\n" + "".join(",".join(r) + "\n" for r in rows))
    quarantine = tmp_path / "bad.jsonl"
    builder = BatchBuilder(job_of(train), quarantine=quarantine)
    labels = builder.split("train").labels
    nan = math.nan
    want = [
        [1, math.log(12.5), 1],
        [nan, math.log(3), 0],
        [0, nan, nan],
        [0, math.log(2), nan],
        [0, math.log(7), nan],
    ]
    np.testing.assert_allclose(labels, np.array(want, np.float32), rtol=1e-7)
    assert labels.dtype == np.float32 and labels.shape == (5, 3)
    bad = [json.loads(line) for line in quarantine.read_text().splitlines()]
    assert [r["line"] for r in bad] == [6, 7, 8, 9, 10]
    reasons = [r["reason"] for r in bad]
    assert "click: unknown label '2'" in reasons[0]
    assert "watch: non-numeric value 'abc'" in reasons[1]
    assert "watch: 0.0 is outside log's domain (> 0)" in reasons[2]
    assert "clicked: unknown mask value 'maybe'" in reasons[3]
    assert "no label for any task" in reasons[4]
    batch = next(builder.batches("train", 0))
    assert batch.labels.shape == (4, 3)


def bce(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    return np.maximum(x, 0) - x * y + np.log1p(np.exp(-np.abs(x)))


def huber(d: np.ndarray, delta: float) -> np.ndarray:
    return np.where(np.abs(d) <= delta, 0.5 * d * d, delta * (np.abs(d) - 0.5 * delta))


def test_the_loss_is_each_tasks_weighted_over_its_labelled_samples() -> None:
    rng = np.random.default_rng(3)
    tasks = [
        TaskConfig(name="a", column="a", weight=0.7),
        TaskConfig(name="b", column="b", kind="regression"),
        TaskConfig(name="c", column="c", kind="regression", loss="huber", huber_delta=0.5, weight=3.0),
    ]
    out = rng.normal(size=(50, 3)) * 2
    labels = np.stack([rng.random(50) < 0.4, rng.normal(size=50), rng.normal(size=50) * 2], axis=1).astype(float)
    labels[rng.random((50, 3)) < 0.3] = np.nan
    has = ~np.isnan(labels)
    y = np.where(has, labels, 0.0)
    want = (
        0.7 * bce(out[:, 0], y[:, 0])[has[:, 0]].sum()
        + ((out[:, 1] - y[:, 1]) ** 2)[has[:, 1]].sum()
        + 3.0 * huber(out[:, 2] - y[:, 2], 0.5)[has[:, 2]].sum()
    )
    x = torch.tensor(out, requires_grad=True)
    loss = Objective(tasks, multitask=True).loss_sum(x, torch.tensor(labels))
    assert loss.item() == pytest.approx(want, rel=1e-12)
    loss.backward()
    assert torch.all(x.grad[torch.from_numpy(~has)] == 0)  # an unlabelled sample teaches its task nothing
    assert torch.all(x.grad[torch.from_numpy(has)] != 0)


def test_outputs_of_the_wrong_shape_fail_naming_the_tasks() -> None:
    objective = Objective.of(job_of())
    assert objective.outputs(torch.zeros(4, 3)).shape == (4, 3)
    with pytest.raises(ValueError, match=r"returned \(4,\); this job's 3 tasks \['click', 'watch', 'buy'\] need"):
        objective.outputs(torch.zeros(4))
    with pytest.raises(ValueError, match="a one-label job needs"):
        Objective.one_label().outputs(torch.zeros(4, 2))
    one = Objective([TaskConfig(name="x", column="x")], multitask=True)
    assert objective.answers(np.array([[0.5, 0.0, 0.5]]))[0, 1] == 1.0  # log undone: served in seconds
    assert one.outputs(torch.zeros(4)).shape == (4, 1)


def test_a_multitask_step_is_the_plain_computation_of_its_loss() -> None:
    """One rank's step (CPU, and the CUDA path's host side) against the tasks' losses written out in
    torch ops per sample, their gradients divided by the batch's samples, SGD on them."""
    tasks = [TaskConfig(**t) for t in TASKS]
    rng = np.random.default_rng(11)
    for staged in (False, True):
        torch.manual_seed(0)
        model = MMoE(NUM_DENSE, [s[-1] for s in SHAPES], tasks=3, num_experts=2, expert_hidden=(8,), tower_hidden=(4,))
        plain = [p.detach().clone() for p in model.parameters()]
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        trainer = Trainer(
            __import__("concurrent.futures").futures.ThreadPoolExecutor(1),
            ddp,
            torch.optim.SGD(ddp.parameters(), lr=0.1),
            torch.device("cpu"),
            1,
            0,
            None,
            staged=staged,
            objective=Objective(tasks, multitask=True),
        )
        size = 24
        dense = rng.normal(size=(size, NUM_DENSE)).astype(np.float32)
        labels = np.stack([rng.random(size) < 0.3, rng.normal(size=size), rng.random(size) < 0.5], axis=1)
        labels = labels.astype(np.float32)
        labels[rng.random((size, 3)) < 0.25] = np.nan
        embeddings = [rng.normal(size=(size, *shape)).astype(np.float32) for shape in SHAPES]
        ids = KeyedIds.from_slots(
            {f"s{i}": (np.arange(size, dtype=np.uint64), np.ones(size, np.int32)) for i in range(len(SHAPES))}
        )
        batch = Batch(batch_id=0, epoch=0, rank=0, ids=ids, dense=dense, labels=labels)
        result = trainer.step(batch, SlotEmbeddings.of([e.copy() for e in embeddings]))

        twin = MMoE(NUM_DENSE, [s[-1] for s in SHAPES], tasks=3, num_experts=2, expert_hidden=(8,), tower_hidden=(4,))
        with torch.no_grad():
            for p, value in zip(twin.parameters(), plain, strict=True):
                p.copy_(value)
        embs = [torch.from_numpy(e).requires_grad_() for e in embeddings]
        out = twin(torch.from_numpy(dense), embs)
        y = torch.from_numpy(np.nan_to_num(labels))
        has = torch.from_numpy(~np.isnan(labels)).double()
        per_sample = torch.stack(
            [
                torch.nn.functional.softplus(out[:, 0]) - out[:, 0] * y[:, 0],  # BCE with logits
                0.5 * (out[:, 1] - y[:, 1]) ** 2,  # weight 0.5, squared error
                2.0 * (torch.nn.functional.softplus(out[:, 2]) - out[:, 2] * y[:, 2]),
            ],
            dim=1,
        )
        want_loss = (per_sample * has).sum()
        want_loss.backward()
        assert result.loss_sum == pytest.approx(want_loss.item(), rel=1e-5)
        # One rank: the step's per-task sums (which the all-reduce carries) are this batch's.
        np.testing.assert_allclose(result.step_loss_sums, (per_sample * has).sum(0).detach().numpy(), rtol=1e-5)
        for got, emb in zip(result.grads.slots(), embs, strict=True):
            np.testing.assert_allclose(got, emb.grad.numpy() / size, rtol=1e-4, atol=1e-7)
        for p, before, theirs in zip(trainer.model.parameters(), plain, twin.parameters(), strict=True):
            torch.testing.assert_close(p.detach(), before - 0.1 * theirs.grad / size, rtol=1e-4, atol=1e-6)
        scores = result.probs
        assert scores.shape == (size, 3)
        torch.testing.assert_close(torch.from_numpy(scores[:, 1]), out[:, 1].detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(
            torch.from_numpy(scores[:, 0]), torch.sigmoid(out[:, 0]).detach(), rtol=1e-5, atol=1e-6
        )


def test_a_streams_events_carry_every_tasks_label_and_are_checked_as_a_blocks_rows() -> None:
    """A multi-task job reading events that carry their labels (data.topics): the native decoder
    and the reference read each task's field and mask once (null: no label; a field missing is a
    bad event, as for any field); a step's rows then get the labels a file's block of the same
    cells gets (NaN where none), malformed ones named."""
    raw = job_of().model_dump(exclude_none=True)
    raw["data"] = {"source": "kafka", "topics": ["events"], "key": "id", "event_time": "ts"}
    raw["training"]["epochs"] = None
    job = JobConfig.model_validate(raw)
    reader = EventReader(job)
    assert reader.paths == ["user", "click", "watch", "buy", "clicked"]
    events = [
        {"id": "a", "ts": 1.0, "user": "u1", "click": 1, "watch": 12.5, "buy": 1, "clicked": 1},
        {"id": "b", "ts": 2.0, "user": "u2", "click": None, "watch": 3, "buy": 0, "clicked": 1},  # no click label
        {"id": "c", "ts": 3.0, "user": "u3", "click": 0, "watch": None, "buy": 1, "clicked": 0},  # buy masked off
        {"id": "d", "ts": 4.0, "user": "u4", "click": 1, "watch": -2, "buy": None, "clicked": 1},  # log(-2)
    ]
    raws = [json.dumps(e).encode() for e in events]
    decoded = reader.events(raws)
    assert decoded == [reader.event(r) for r in raws]  # the native decoder as the reference
    rows = EventRows(job)
    for event in decoded:
        rows.add(event)
    encoder = Encoder(job, {})  # no dense column: no statistics to have
    cells = TextCells.of_rows(job, [e.values for e in rows.events], FIELD_SEP, rows.paths, rows.labels)
    checked = encoder.check_cells(cells, lambda i: (i, ""), file="kafka")
    assert checked.keep.tolist() == [True, True, True, False]
    assert [b.reason for b in checked.bad] == ["watch: -2.0 is outside log's domain (> 0)"]
    labels = encoder.encode_cells(cells, checked).labels
    want = [[1, math.log(12.5), 1], [math.nan, math.log(3), 0], [0, math.nan, math.nan]]
    np.testing.assert_allclose(labels, np.array(want, np.float32), rtol=1e-7)
