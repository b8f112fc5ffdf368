"""Running a job on a test stack to the end."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trillium.cli import summarize
from trillium.job import JobConfig
from trillium.stack.client import CoordinatorClient

DATA = Path(__file__).resolve().parents[1] / "data"


def with_training(job: JobConfig, **changes: Any) -> JobConfig:
    return job.model_copy(update={"training": job.training.model_copy(update=changes)})


def run_to_end(run_dir: Path, job: JobConfig, timeout_s: float = 300) -> tuple[dict, dict]:
    """Submit, follow to the end; returns (the final job view, the report)."""
    client = CoordinatorClient.for_stack(run_dir)
    try:
        submitted = client.submit(job)
        view = client.follow(submitted["id"], timeout_s=timeout_s)
        return view, summarize(view, 0.0)
    finally:
        client.close()
