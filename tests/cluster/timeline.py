"""The cluster tests' job and what they measure of it: a synthetic job with checkpoints, its
exactly-once check, and a `Timeline` that watches a job from the operator's host through a
fault (the coordinator may be out of reach for a while) to tell when the fault was detected and
when training went on again."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from ledger import assert_exactly_once_at_the_ps

from trillium.data.features import BatchBuilder
from trillium.job import JobConfig
from trillium.stack.client import TERMINAL, ApiError, CoordinatorClient, CoordinatorUnavailable

ROWS = 2000
BATCH = 50  # per rank: 20 steps an epoch on 2 ranks
CHECKPOINT_EVERY_STEPS = 40


def cluster_job(
    epochs: int, staleness_bound: int | str = 0, name: str = "cluster", publish: dict[str, Any] | None = None
) -> JobConfig:
    """A synthetic Criteo-layout job, small enough that the network and not the cores decides its
    pace, with a checkpoint every 40 steps; `publish` replaces the default publishing (every 5 s,
    to the run directory). Synchronous by default: a rerun is deterministic."""
    slots = [{"name": f"c{i}", "column": f"C{i}", "table": "a" if i <= 13 else "b"} for i in range(1, 27)]
    return JobConfig.model_validate(
        {
            "name": name,
            "data": {
                "source": "synthetic",
                "rows": ROWS,
                "test_rows": 1000,
                "seed": 3,
                "vocab_sizes": [50] * 26,
            },
            "slots": slots,
            "tables": {
                "a": {"dim": 8, "optimizer": {"name": "adagrad", "lr": 0.2}},
                "b": {"dim": 8, "optimizer": {"name": "adagrad", "lr": 0.2}},
            },
            "dense": [{"column": f"I{i}", "normalization": "log1p"} for i in range(1, 14)],
            "label": {"column": "label", "positive": "1", "negative": "0"},
            "model": {
                "cls": "trillium.models:DNN",
                "kwargs": {"num_dense": 13, "embedding_dims": [8] * 26, "hidden": [16]},
            },
            "training": {
                "batch_size": BATCH,
                "epochs": epochs,
                "staleness_bound": staleness_bound,
                "dense_optimizer": {"name": "sgd", "lr": 0.1},
                "seed": 1,
                "eval_batch_size": 500,
            },
            "checkpoint": {"every_steps": CHECKPOINT_EVERY_STEPS, "every_seconds": None, "keep_last": 5},
            "topology": {"nn_ranks": 2, "ps_shards": 2, "embedding_workers": 1},
        }
        | ({"publish": publish} if publish is not None else {})
    )


def assert_exactly_once(view: dict[str, Any], job: JobConfig) -> None:
    """Every step's gradients in the final model exactly once, by the PS shards' ledgers, and
    every epoch trained each training row once, by the ranks' per-epoch counts."""
    assert_exactly_once_at_the_ps(view, job)
    split = BatchBuilder(job).split("train")
    results = view["results"].values()
    for epoch in range(job.training.epochs):
        assert sum(r["epochs"][epoch]["samples"] for r in results) == split.rows, f"epoch {epoch}"
        assert sum(r["epochs"][epoch]["label_sum"] for r in results) == pytest.approx(float(split.labels.sum()))


FAULT_EPOCHS = 30  # 600 steps: a fault begins after the first checkpoint (step 40), long before the end
HOLD_S = 30.0  # how long a healed partition lasts
AUC_TOLERANCE = 1e-3  # synchronous: a recovered run repeats an uninterrupted one's steps


def after_first_checkpoint(run_dir: Path) -> tuple[str, Timeline]:
    """A fault job submitted and followed until its first checkpoint."""
    client = CoordinatorClient.for_stack(run_dir)
    try:
        job_id = client.submit(cluster_job(FAULT_EPOCHS))["id"]
        timeline = Timeline(run_dir, job_id)
        deadline = time.monotonic() + 120
        while (view := client.job(job_id))["last_checkpoint"] is None:
            assert view["job"]["state"] in ("submitted", "starting", "running"), view["job"]
            assert time.monotonic() < deadline, "no first checkpoint in 120 s"
            time.sleep(0.05)
        assert view["progress"]["samples"] < FAULT_EPOCHS * ROWS // 3, "the job ran too far before the fault"
        return job_id, timeline
    finally:
        client.close()


def check(view: dict[str, Any], uninterrupted: dict[str, Any]) -> None:
    """A fault job finished, exactly once, with the model an uninterrupted run made."""
    assert view["job"]["state"] == "finished", view["job"]["error"]
    assert_exactly_once(view, cluster_job(FAULT_EPOCHS))
    assert abs(view["job"]["metrics"]["auc"] - uninterrupted["auc"]) <= AUC_TOLERANCE


@dataclass
class Point:
    at: float
    state: str | None  # None: the coordinator did not answer
    attempt: int | None = None
    samples: int | None = None


@dataclass
class Timeline:
    """Polls a job's view every 0.2 s from the operator's host, in a thread, until it ends."""

    run_dir: Path
    job_id: str
    points: list[Point] = field(default_factory=list)
    last_view: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        client = CoordinatorClient.for_stack(self.run_dir)
        client.http.timeout = 1.0  # a partitioned coordinator answers nothing: say so quickly
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                try:
                    view = client.job(self.job_id)
                except (CoordinatorUnavailable, ApiError):
                    self.points.append(Point(now, None))
                else:
                    job = view["job"]
                    self.last_view = view
                    self.points.append(Point(now, job["state"], job["attempt"], view["progress"]["samples"]))
                    if job["state"] in TERMINAL:
                        return
                self._stop.wait(0.2)
        finally:
            client.close()

    def wait(self, timeout_s: float) -> dict[str, Any]:
        """The job's final view."""
        self._thread.join(timeout_s)
        self._stop.set()
        assert not self._thread.is_alive(), f"job {self.job_id} did not end in {timeout_s:.0f}s"
        assert self.last_view is not None
        return self.last_view

    def attempt_before(self, t: float) -> int:
        return max((p.attempt for p in self.points if p.at <= t and p.attempt is not None), default=0)

    def new_attempt_at(self, after: float, attempt: int) -> float | None:
        """When the coordinator first showed an attempt newer than `attempt` (a recovery began)."""
        return next((p.at for p in self.points if p.at >= after and (p.attempt or 0) > attempt), None)

    def progress_at(self, after: float) -> float | None:
        """When the job was first seen training after `after`: running, its samples moving."""
        seen = [p for p in self.points if p.at >= after and p.state == "running" and p.samples is not None]
        return next((b.at for a, b in zip(seen, seen[1:], strict=False) if b.samples != a.samples), None)


# What each fault test measured, printed at the end of the run (conftest.pytest_terminal_summary).
FAULTS: list[dict[str, Any]] = []


def record_fault(
    fault: str, began: float, detected: float | None, healed: float, resumed: float | None, view: dict[str, Any]
) -> None:
    """Detect: from the fault to the coordinator's new attempt (None: the job rode it out in its
    attempt). Recover: from the heal to the job seen training again."""
    FAULTS.append(
        {
            "fault": fault,
            "detect_s": None if detected is None else round(detected - began, 1),
            "recover_s": None if resumed is None else round(resumed - healed, 1),
            "recoveries": len(view["job"]["recoveries"]),
            "auc": round(view["job"]["metrics"]["auc"], 5),
        }
    )
