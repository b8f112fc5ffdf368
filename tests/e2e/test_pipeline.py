"""The hybrid pipeline end to end through real Kafka, gRPC and Redis."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
from pipeline_helpers import DATA, run_to_end, with_training

from trillium import stack
from trillium.data import load_job
from trillium.data.features import BatchBuilder
from trillium.job import EvaluationConfig
from trillium.train.reference import train_reference


def _train_split(job):
    split = BatchBuilder(job).split("train")
    return split.rows, float(split.labels.sum())


@pytest.mark.parametrize("bound", [0, 2, None], ids=["sync", "hybrid-k2", "async"])
def test_every_sample_trained_once_per_epoch_within_the_bound(training_stack, tiny_job, bound) -> None:
    job = with_training(tiny_job, staleness_bound=bound)
    view, report = run_to_end(training_stack, job)
    assert view["job"]["state"] == "finished", view["job"]["error"]
    rows, label_sum = _train_split(job)
    results = view["results"]
    assert sorted(results) == ["0", "1"] or sorted(results) == [0, 1]
    for epoch in range(job.training.epochs):
        assert sum(r["epochs"][epoch]["samples"] for r in results.values()) == rows
        assert sum(r["epochs"][epoch]["label_sum"] for r in results.values()) == pytest.approx(label_sum)
    assert report["samples_trained"] == rows * job.training.epochs
    # Ranks step in lock-step: the same number of steps each.
    assert len({r["steps"] for r in results.values()}) == 1
    stale = view["staleness"].values()
    assert sum(s["count"] for s in stale) == sum(r["steps"] for r in results.values())
    if bound is not None:
        assert report["max_staleness_observed"] <= bound
    assert report["auc"] > 0.6


def test_two_loaders_feed_every_sample_once_per_epoch(training_stack, tiny_job, tmp_path) -> None:
    """Two data loaders read disjoint shares of the input (here: a file each, of 600 and 400 rows),
    each feeding its own rank; the epochs are padded to the same steps on both ranks, and every
    row is trained once per epoch."""
    lines = (DATA / "tiny" / "train.tsv").read_text().splitlines(keepends=True)
    (tmp_path / "part-0.tsv").write_text("".join(lines[:600]))
    (tmp_path / "part-1.tsv").write_text("".join(lines[600:]))
    job = with_training(tiny_job, epochs=3, staleness_bound=2)
    job = job.model_copy(
        update={
            "topology": job.topology.model_copy(update={"data_loaders": 2}),
            "data": job.data.model_copy(update={"train": [tmp_path / "part-0.tsv", tmp_path / "part-1.tsv"]}),
        }
    )
    view, report = run_to_end(training_stack, job)
    assert view["job"]["state"] == "finished", view["job"]["error"]
    rows, label_sum = _train_split(job)
    results = view["results"]
    for epoch in range(job.training.epochs):
        assert sum(r["epochs"][epoch]["samples"] for r in results.values()) == rows
        assert sum(r["epochs"][epoch]["label_sum"] for r in results.values()) == pytest.approx(label_sum)
    assert len({r["steps"] for r in results.values()}) == 1
    # Each rank trained the share of its own loader.
    assert sorted(r["samples"] for r in results.values()) == [400 * 3, 600 * 3]
    assert report["eval_samples"] == 300


def test_one_rank_synchronous_run_matches_single_process_reference(training_stack, tiny_job) -> None:
    """Golden equivalence: with 1 NN rank, k = 0 and a fixed order and seed, the distributed
    system's loss curve and test AUC are those of plain single-process PyTorch. Exact only with
    fp32 on the wire (the default, fp16, rounds: the next test). Its GAUC too, grouped by slot c2."""
    job = tiny_job.model_copy(
        update={
            "topology": tiny_job.topology.model_copy(update={"nn_ranks": 1}),
            "evaluation": EvaluationConfig(group_by="c2"),
        }
    )
    job = with_training(job, staleness_bound=0, wire_dtype="fp32")
    reference = train_reference(job)
    view, report = run_to_end(training_stack, job)
    assert view["job"]["state"] == "finished", view["job"]["error"]
    distributed = next(iter(view["results"].values()))["loss_curve"]
    assert len(distributed) == len(reference.losses)
    np.testing.assert_allclose(distributed, reference.losses, rtol=1e-4, atol=1e-5)
    assert report["auc"] == pytest.approx(reference.test_auc, abs=1e-4)
    assert report["logloss"] == pytest.approx(reference.test_logloss, abs=1e-4)
    assert reference.test_gauc is not None and report["gauc"] == pytest.approx(reference.test_gauc, abs=1e-4)
    # Every sample trained was scored first, and the rank reported its last scores: they go out once
    # a second, and a job trained within a second of its last report showed the ones before.
    assert report["progressive"]["scored"] == report["samples_trained"]
    assert 0.5 < report["progressive"]["gauc"] < 1.0  # the rolling one, over the train split's last samples
    # And it is not trivially so: training moved the loss.
    assert np.mean(distributed[-10:]) < np.mean(distributed[:10])


def test_an_fp16_wire_trains_as_the_fp32_reference_within_fp16_rounding(training_stack, tiny_job) -> None:
    """training.wire_dtype fp16 (the default): embeddings and gradients cross every wire at half
    the bytes (the gradients scaled per message), and the loss curve stays within fp16 rounding
    of the fp32 single-process reference's — no gradient lost to underflow."""
    job = tiny_job.model_copy(update={"topology": tiny_job.topology.model_copy(update={"nn_ranks": 1})})
    job = with_training(job, staleness_bound=0)
    assert job.training.wire_dtype == "fp16"
    reference = train_reference(job)
    view, report = run_to_end(training_stack, job)
    assert view["job"]["state"] == "finished", view["job"]["error"]
    distributed = next(iter(view["results"].values()))["loss_curve"]
    assert distributed != reference.losses  # the wire did round
    # Rounding compounds as the weights part (a chaotic path, not a bias): the first epoch's
    # losses are within fp16 rounding, and the trained model scores as the fp32 one does.
    steps_per_epoch = len(reference.losses) // job.training.epochs
    np.testing.assert_allclose(distributed[:steps_per_epoch], reference.losses[:steps_per_epoch], rtol=1e-3)
    assert report["auc"] == pytest.approx(reference.test_auc, abs=1e-3)
    assert report["logloss"] == pytest.approx(reference.test_logloss, abs=1e-3)


def test_malformed_rows_are_counted_quarantined_and_skipped(training_stack, tiny_job, tmp_path) -> None:
    train = tmp_path / "train.tsv"
    lines = (DATA / "tiny" / "train.tsv").read_text().splitlines(keepends=True)
    bad = {
        5: "only\tthree\tfields\n",
        17: lines[17].replace("\t", "\tnot-a-number\t", 1).split("\t", 1)[0] + "\tx" * 39 + "\n",
    }
    for line_no, text in bad.items():
        lines[line_no - 1] = text
    train.write_text("".join(lines))
    shutil.copy(DATA / "tiny" / "test.tsv", tmp_path / "test.tsv")
    job = tiny_job.model_copy(
        update={"data": tiny_job.data.model_copy(update={"train": train, "test": tmp_path / "test.tsv"})}
    )
    job = with_training(job, epochs=1, staleness_bound=None)
    view, report = run_to_end(training_stack, job)
    assert view["job"]["state"] == "finished", view["job"]["error"]
    assert report["samples_trained"] == 1000 - len(bad)
    quarantine = training_stack / "quarantine" / f"{view['job']['id']}.jsonl"
    entries = [json.loads(line) for line in quarantine.read_text().splitlines()]
    assert sorted(e["line"] for e in entries) == sorted(bad)
    assert all(e["file"] == str(train) and e["reason"] and e["raw"] for e in entries)


def test_bad_config_fails_before_any_service_starts(tmp_path) -> None:
    text = (DATA / "tiny_job.yaml").read_text().replace("column: C7,", "column: C99,")
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    shutil.copytree(DATA / "tiny", tmp_path / "tiny")
    run_dir = tmp_path / "stack"
    out = subprocess.run(
        [sys.executable, "-m", "trillium.cli", "demo", "--job", str(bad), "--run-dir", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert "slots[6] 'c7': unknown column 'C99'" in out.stdout
    assert "known columns: label, I1" in out.stdout
    assert stack.read_state(run_dir) is None  # nothing was started
    with pytest.raises(ValueError, match="C99"):
        load_job(bad)
