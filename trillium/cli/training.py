"""`trillium train` and `trillium demo`: submit a job, follow it with a progress bar, report it."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from trillium import stack
from trillium.config import default_run_dir
from trillium.job import JobConfig
from trillium.stack.client import CoordinatorClient

from .app import RunDir, app, console, coordinator, fail, load_job_or_exit, run_dir_of
from .local import down, up


def _follow(client: CoordinatorClient, job_id: str) -> dict:
    """Follow a job with a live progress bar; returns its final view."""
    columns = [
        TextColumn("{task.description}", style="bold", markup=False),
        BarColumn(),
        TextColumn("{task.completed:,.0f} samples"),
        TextColumn(
            "{task.fields[rate]:>8,.0f}/s  loss {task.fields[loss]:.4f}  staleness "
            "max {task.fields[smax]} (bound {task.fields[bound]})"
        ),
        TimeElapsedColumn(),
    ]
    with Progress(*columns, console=console, transient=False) as bar:
        task = bar.add_task("starting", total=None, rate=0.0, loss=float("nan"), smax=0, bound="?")

        def update(view: dict) -> None:
            job, prog, stale = view["job"], view["progress"], view["staleness"].values()
            bound = next(iter(stale), {}).get("bound")
            bar.update(
                task,
                description=job["state"],
                completed=prog["samples"],
                rate=prog["samples_per_sec"],
                loss=prog["last_loss"] if prog["last_loss"] is not None else float("nan"),
                smax=max((s["max"] for s in stale), default=0),
                bound="∞" if bound is None else bound,
            )

        return client.follow(job_id, update)


def mode_of(bound: int | str | None) -> str:
    """The training mode a staleness bound means."""
    return "async" if bound is None else "sync" if bound == 0 else "hybrid"


def summarize(view: dict, elapsed_s: float) -> dict:
    """The run's report: quality, speed and staleness, from the coordinator's final view."""
    job, results = view["job"], view["results"]
    stale = list(view["staleness"].values())
    samples = sum(r["samples"] for r in results.values())
    train_s = max((r["train_seconds"] for r in results.values()), default=0.0)
    steps = max((r["steps"] for r in results.values()), default=0)
    if not results:  # stopped (a continuous job ends so): the ranks' last progress
        prog = view["progress"]
        samples, steps = prog["samples"], prog["steps"]
        train_s = samples / prog["samples_per_sec"] if prog["samples_per_sec"] else 0.0
    lookups = sum(s["count"] for s in stale)
    metrics = job.get("metrics") or {}
    return {
        "job_id": job["id"],
        "state": job["state"],
        "error": job.get("error"),
        "mode": mode_of(job["config"]["training"]["staleness_bound"]),
        "staleness_bound": job["config"]["training"]["staleness_bound"],
        "auc": metrics.get("auc"),
        "logloss": metrics.get("logloss"),
        "gauc": metrics.get("gauc"),  # with evaluation.group_by
        "gauc_samples": metrics.get("gauc_samples"),
        "eval_samples": metrics.get("samples"),
        # Every task's test metrics by name (auc, gauc, logloss; mse, mae): `auc` and the rest above
        # are the first task's.
        "tasks": metrics.get("tasks"),
        "samples_trained": samples,
        "samples_per_sec": samples / train_s if train_s else 0.0,
        "train_seconds": train_s,
        "steps": steps,
        "max_staleness_observed": max((s["max"] for s in stale), default=0),
        "mean_staleness_observed": sum(s["mean"] * s["count"] for s in stale) / lookups if lookups else 0.0,
        "nn_ranks": job["config"]["topology"]["nn_ranks"],
        "ps_shards": job["config"]["topology"]["ps_shards"],
        "elapsed_s": elapsed_s,
        "attempt": job.get("attempt", 0),
        "recoveries": [
            {"attempt": r["attempt"], "cause": r["cause"], "checkpoint_step": r["checkpoint_step"]}
            for r in job.get("recoveries", [])
        ],
        "last_checkpoint_step": (view.get("last_checkpoint") or {}).get("step"),
        "progressive": {
            k: view["progressive"].get(k)
            for k in ("auc", "gauc", "logloss", "samples", "scored", "delay_seconds", "tasks")
        },
        "stream": view.get("stream"),
    }


def _print_summary(report: dict) -> None:
    table = Table("", "", show_header=False, box=None)
    for key in (
        "job_id",
        "state",
        "mode",
        "staleness_bound",
        "auc",
        "gauc",
        "logloss",
        "samples_trained",
        "samples_per_sec",
        "max_staleness_observed",
        "mean_staleness_observed",
        "elapsed_s",
    ):
        value = report[key]
        if key == "gauc" and value is None:  # a job without evaluation.group_by
            continue
        table.add_row(key, f"{value:.4f}" if isinstance(value, float) else str(value))
    tasks = report["tasks"] or {}
    if len(tasks) > 1:  # a multi-task job: each task's test metrics too
        for task, metrics in tasks.items():
            shown = [
                f"{name} {metrics[name]:.4f}" for name in ("auc", "gauc", "logloss", "mse", "mae") if name in metrics
            ]
            table.add_row(f"task {task}", "  ".join(shown))
    console.print(table)


@dataclasses.dataclass
class Outcome:
    report: dict
    view: dict
    series: list[dict]


def run_job(run_dir: Path, config: JobConfig) -> Outcome:
    """Submit `config` to the stack in `run_dir`, follow it to the end, and report."""
    started = time.monotonic()
    with coordinator(run_dir) as client:
        job = client.submit(config)
        console.print(Text.assemble("job ", (job["id"], "bold"), " submitted"))
        view = _follow(client, job["id"])
        series = client.series(job["id"])
    return Outcome(summarize(view, time.monotonic() - started), view, series)


MODES = {"sync": 0, "async": None}


@app.command()
def train(
    job_file: Annotated[Path, typer.Argument(help="job YAML", exists=True, dir_okay=False)],
    run_dir: RunDir = None,
    report: Annotated[Optional[Path], typer.Option(help="write the JSON report here")] = None,
) -> None:
    """Submit a job to the running stack and follow it to the end."""
    config = load_job_or_exit(job_file)
    outcome = run_job(run_dir_of(run_dir), config)
    _finish(outcome, report)


def _finish(outcome: Outcome, report: Path | None) -> None:
    result = outcome.report
    _print_summary(result)
    if report:
        from trillium.train.report import plot  # matplotlib: loaded only when a report is written

        result["plot"] = str(plot(outcome.view, outcome.series, report.with_suffix(".png")))
        report.parent.mkdir(parents=True, exist_ok=True)
        report.write_text(json.dumps(result, indent=2))
        console.print(f"report written to {report} (plot: {result['plot']})")
    continuous = outcome.view["job"]["config"]["training"]["epochs"] is None
    if result["state"] != ("stopped" if continuous else "finished"):  # a continuous job ends when stopped
        fail(f"job {result['state']}: {result['error']}")


@app.command()
def demo(
    mode: Annotated[str, typer.Option(help="sync (k=0), hybrid (bounded k) or async (unbounded)")] = "hybrid",
    staleness: Annotated[
        Optional[int], typer.Option(min=0, help="the bound k in hybrid mode (default: the job's bound)")
    ] = None,
    job_file: Annotated[Path, typer.Option("--job", help="job YAML")] = stack.REPO_ROOT / "examples/adult/job.yaml",
    report: Annotated[Optional[Path], typer.Option(help="write the JSON report here")] = Path("reports/demo.json"),
    run_dir: RunDir = None,
) -> None:
    """Bring the local stack up, train the Adult job for one epoch, evaluate on adult.test,
    print a summary, write the JSON report, and take the stack down."""
    if mode not in ("sync", "hybrid", "async"):
        fail(f"--mode must be one of sync, hybrid, async (got {mode!r})")
    config = load_job_or_exit(job_file)
    bound = MODES.get(mode, staleness if staleness is not None else config.training.staleness_bound)
    if mode == "hybrid" and bound is None:
        fail("hybrid mode needs a bound: pass --staleness K")
    config = config.model_copy(update={"training": config.training.model_copy(update={"staleness_bound": bound})})
    rd = run_dir_of(run_dir) if run_dir else default_run_dir().with_name("demo")
    topo = config.topology
    up(
        run_dir=rd,
        ps_shards=topo.ps_shards,
        embedding_workers=topo.embedding_workers,
        nn_ranks=topo.nn_ranks,
        data_loaders=1,
    )
    try:
        outcome = run_job(rd, config)
    finally:
        down(run_dir=rd)
    _finish(outcome, report)
