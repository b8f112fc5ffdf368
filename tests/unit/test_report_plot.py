"""A job's report plot (`trillium train --report`) is drawn for a one-label job and for a
multi-task one, from the views the coordinator gives: a PNG with each task's curve and test AUC."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import pytest

from trillium.train import report


def _view(tasks: list[str]) -> dict:
    config = {"training": {"progressive_samples": 1000}}
    metrics = {"auc": 0.7, "logloss": 0.5}
    result = {"loss_curve": [0.7, 0.6, 0.5]}
    if len(tasks) > 1:
        config["labels"] = [{"name": t} for t in tasks]
        metrics["tasks"] = {t: {"auc": 0.7 - i / 100} for i, t in enumerate(tasks)}
        result["task_loss_curves"] = {t: [0.3, 0.2, 0.1] for t in tasks}
    return {
        "job": {"id": "j", "state": "finished", "config": config, "metrics": metrics},
        "results": {"0": result},
        "staleness": {"0": {"histogram": [3] + [0] * 16}},
    }


@pytest.mark.parametrize("tasks", [["label"], ["click", "watch_time", "conversion"]], ids=["one", "several"])
def test_the_plot_shows_each_tasks_curve_and_test_auc(tmp_path: Path, tasks: list[str], monkeypatch) -> None:
    drawn = {}
    monkeypatch.setattr(plt, "close", lambda fig: drawn.setdefault("fig", fig))  # keep it to look at
    series = [{"samples": 100 * i, "auc": 0.6, "loss": 0.5} for i in range(3)]
    path = report.plot(_view(tasks), series, tmp_path / "r.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    loss_ax, auc_ax, _ = drawn["fig"].axes
    loss_labels = loss_ax.get_legend_handles_labels()[1]
    auc_labels = auc_ax.get_legend_handles_labels()[1]
    if len(tasks) == 1:
        assert loss_labels == ["step loss"] and auc_labels == ["test AUC 0.7000"]
    else:
        assert loss_labels == ["step loss"] + [f"{t} (weighted)" for t in tasks]
        assert auc_labels == ["click test AUC 0.7000", "watch_time test AUC 0.6900", "conversion test AUC 0.6800"]
        assert auc_ax.get_title() == "progressive AUC of click (last 1,000 samples)"
