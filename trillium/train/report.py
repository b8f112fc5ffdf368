"""A job's report as a picture: the loss, the rolling (progressive) AUC as training went on, and
the staleness of the lookups — people would rather look than read (matplotlib, no display)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display, no GUI toolkit
import matplotlib.pyplot as plt


def plot(view: dict[str, Any], series: list[dict[str, Any]], path: Path) -> Path:
    """Write the plot of a job's final view and series (GET /v1/jobs/{id}/series) to `path` (PNG)."""
    fig, (loss_ax, auc_ax, stale_ax) = plt.subplots(1, 3, figsize=(15, 4.2))
    job = view["job"]
    fig.suptitle(f"{job['id']} ({job['state']})")
    curves = [r["loss_curve"] for r in view["results"].values() if r.get("loss_curve")]
    if curves:
        loss_ax.plot(range(len(curves[0])), curves[0], lw=0.8, label="step loss (rank 0)")
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
    auc_ax.set_title(f"progressive AUC (last {window:,} samples)")
    auc_ax.set_xlabel("samples trained")
    metrics = job.get("metrics") or {}
    if metrics.get("auc") is not None:
        auc_ax.axhline(metrics["auc"], ls="--", color="grey", label=f"test AUC {metrics['auc']:.4f}")
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
