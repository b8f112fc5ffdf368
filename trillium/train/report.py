"""A job's report as a picture: the loss (and each task's, for several), the rolling
(progressive) AUC as training went on beside each task's test AUC, and the staleness of the
lookups — people would rather look than read (matplotlib, no display)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display, no GUI toolkit
import matplotlib.pyplot as plt

_COLORS = ("grey", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown")


def plot(view: dict[str, Any], series: list[dict[str, Any]], path: Path) -> Path:
    """Write the plot of a job's final view and series (GET /v1/jobs/{id}/series) to `path` (PNG)."""
    fig, (loss_ax, auc_ax, stale_ax) = plt.subplots(1, 3, figsize=(15, 4.2))
    job = view["job"]
    fig.suptitle(f"{job['id']} ({job['state']})")
    results = [r for r in view["results"].values() if r.get("loss_curve")]
    if results:
        curve = results[0]["loss_curve"]
        loss_ax.plot(range(len(curve)), curve, lw=0.8, label="step loss")
        for task, task_curve in (results[0].get("task_loss_curves") or {}).items():
            loss_ax.plot(range(len(task_curve)), task_curve, lw=0.6, label=f"{task} (weighted)")
        loss_ax.set_xlabel("step")
    else:
        points = [p for p in series if p["loss"] is not None]
        loss_ax.plot([p["samples"] for p in points], [p["loss"] for p in points], lw=0.8, label="step loss")
        loss_ax.set_xlabel("samples trained")
    loss_ax.set_title("training loss")
    loss_ax.legend()
    points = [p for p in series if p["auc"] is not None]
    auc_ax.plot([p["samples"] for p in points], [p["auc"] for p in points], lw=1.0)
    window = job["config"]["training"]["progressive_samples"]
    labels = job["config"].get("labels")  # a multi-task job's: progressive validation scores the first
    first = f" of {labels[0]['name']}" if labels else ""
    auc_ax.set_title(f"progressive AUC{first} (last {window:,} samples)")
    auc_ax.set_xlabel("samples trained")
    metrics = job.get("metrics") or {}
    tasks = metrics.get("tasks") or {}
    shown = tasks if len(tasks) > 1 else {"": metrics}  # a one-label job's: "test AUC"
    for (task, scores), color in zip(shown.items(), _COLORS, strict=False):
        if scores.get("auc") is not None:
            name = f"{task} test AUC" if task else "test AUC"
            auc_ax.axhline(scores["auc"], ls="--", color=color, label=f"{name} {scores['auc']:.4f}")
    if auc_ax.get_legend_handles_labels()[0]:
        auc_ax.legend()
    histogram = [sum(col) for col in zip(*(s["histogram"] for s in view["staleness"].values()), strict=True)]
    if histogram:
        stale_ax.bar(range(len(histogram)), histogram)
        stale_ax.set_xticks(range(len(histogram)), [str(i) for i in range(len(histogram) - 1)] + ["16+"], fontsize=7)
    stale_ax.set_title("lookups by staleness (steps)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
