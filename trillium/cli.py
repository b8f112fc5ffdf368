"""The `trillium` command line."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from trillium import launcher
from trillium.client import CoordinatorClient
from trillium.config import ENV_RUN_DIR, Topology, default_run_dir, describe_validation_error
from trillium.datagen import generate_criteo
from trillium.job import JobConfig, load_job

app = typer.Typer(help="Trillium: hybrid training of recommender models with huge embedding tables.",
                  no_args_is_help=True, pretty_exceptions_enable=False, add_completion=False)
console = Console()

RunDir = Annotated[Optional[Path], typer.Option("--run-dir", help=f"stack directory [default: ${ENV_RUN_DIR} or .trillium/run]")]


def _run_dir(run_dir: Path | None) -> Path:
    return (run_dir or default_run_dir()).absolute()


def _fail(message: str) -> None:
    console.print(f"[red]error:[/red] {message}", highlight=False)
    raise typer.Exit(1)


@app.command()
def up(run_dir: RunDir = None,
       ps_shards: Annotated[int, typer.Option(min=1, help="embedding PS shards")] = 2,
       embedding_workers: Annotated[int, typer.Option(min=1)] = 1,
       nn_ranks: Annotated[int, typer.Option(min=1, help="NN worker ranks")] = 2,
       data_loaders: Annotated[int, typer.Option(min=1)] = 1) -> None:
    """Start Kafka, Redis and the services in the background; returns once all are healthy.

    Set TRILLIUM_KAFKA_BOOTSTRAP / TRILLIUM_REDIS_URL to use external servers instead."""
    rd = _run_dir(run_dir)
    new_token = not (rd / "token").exists()
    topology = Topology(ps_shards=ps_shards, embedding_workers=embedding_workers, nn_ranks=nn_ranks,
                        data_loaders=data_loaders)
    with console.status("starting the stack…"):
        try:
            st = launcher.up(rd, topology)
        except launcher.LauncherError as err:
            _fail(str(err))
    console.print(f"[green]stack running[/green] in {rd}")
    console.print(f"  kafka     {st['kafka']['bootstrap']}\n  redis     {st['redis']['url']}\n"
                  f"  coordinator {st['coordinator_url']}")
    if new_token:
        console.print(f"  API token (written to {st['token_file']}, mode 600): {launcher.read_token(rd)}")


@app.command()
def status(run_dir: RunDir = None,
           as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False) -> None:
    """Show every endpoint and each part's health (exit code 1 unless all are healthy)."""
    st = launcher.status(_run_dir(run_dir))
    if as_json:
        print(json.dumps(st, indent=2))
        raise typer.Exit(0 if st["healthy"] else 1)
    if st["phase"] in ("not running", "dead"):
        console.print(f"no stack running in {st['run_dir']} ({st['phase']})")
        raise typer.Exit(1)
    console.print(f"stack in {st['run_dir']}: [bold]{st['phase']}[/bold]" + (f" — {st['error']}" if st.get("error") else ""))
    table = Table("part", "endpoint", "pid", "restarts", "health")
    ok = lambda good: "[green]ok[/green]" if good else "[red]down[/red]"  # noqa: E731
    table.add_row("kafka", st["kafka"]["bootstrap"], "external" if st["kafka"]["external"] else "", "", ok(st["kafka"]["ok"]))
    table.add_row("redis", st["redis"]["url"], "external" if st["redis"]["external"] else "", "", ok(st["redis"]["ok"]))
    for proc in st["processes"]:
        if proc.get("http_url"):
            endpoint = proc["http_url"] + (f"  grpc {proc['grpc_address']}" if proc.get("grpc_address") else "")
            table.add_row(proc["name"], endpoint, str(proc["pid"]), str(proc["restarts"]), ok(proc["health"]["ok"]))
    console.print(table)
    raise typer.Exit(0 if st["healthy"] else 1)


@app.command()
def down(run_dir: RunDir = None) -> None:
    """Stop the stack and everything it started."""
    rd = _run_dir(run_dir)
    with console.status("stopping the stack…"):
        stopped = launcher.down(rd)
    console.print("stack stopped" if stopped else f"no stack running in {rd}")


def _load_job(path: Path) -> JobConfig:
    try:
        return load_job(path)
    except ValidationError as err:
        console.print(f"[red]invalid job {path}:[/red]\n{describe_validation_error(err)}", highlight=False)
    except (OSError, ValueError) as err:
        console.print(f"[red]invalid job {path}:[/red] {err}", highlight=False)
    raise typer.Exit(2)


def _follow(client: CoordinatorClient, job_id: str) -> dict:
    """Follow a job with a live progress bar; returns its final view."""
    columns = [TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed:,.0f} samples"),
               TextColumn("{task.fields[rate]:>8,.0f}/s  loss {task.fields[loss]:.4f}  staleness "
                          "max {task.fields[smax]} (bound {task.fields[bound]})"), TimeElapsedColumn()]
    with Progress(*columns, console=console, transient=False) as bar:
        task = bar.add_task("starting", total=None, rate=0.0, loss=float("nan"), smax=0, bound="?")

        def update(view: dict) -> None:
            job, prog, stale = view["job"], view["progress"], view["staleness"].values()
            bound = next(iter(stale), {}).get("bound")
            bar.update(task, description=job["state"], completed=prog["samples"], rate=prog["samples_per_sec"],
                       loss=prog["last_loss"] if prog["last_loss"] is not None else float("nan"),
                       smax=max((s["max"] for s in stale), default=0), bound="∞" if bound is None else bound)

        return client.follow(job_id, update)


def summarize(view: dict, mode: str | None, elapsed_s: float) -> dict:
    """The run's report: quality, speed and staleness, from the coordinator's final view."""
    job, results = view["job"], view["results"]
    stale = list(view["staleness"].values())
    samples = sum(r["samples"] for r in results.values())
    train_s = max((r["train_seconds"] for r in results.values()), default=0.0)
    lookups = sum(s["count"] for s in stale)
    metrics = job.get("metrics") or {}
    return {
        "job_id": job["id"], "state": job["state"], "error": job.get("error"),
        "mode": mode, "staleness_bound": job["config"]["training"]["staleness_bound"],
        "auc": metrics.get("auc"), "logloss": metrics.get("logloss"), "eval_samples": metrics.get("samples"),
        "samples_trained": samples, "samples_per_sec": samples / train_s if train_s else 0.0,
        "train_seconds": train_s, "steps": max((r["steps"] for r in results.values()), default=0),
        "max_staleness_observed": max((s["max"] for s in stale), default=0),
        "mean_staleness_observed": sum(s["mean"] * s["count"] for s in stale) / lookups if lookups else 0.0,
        "nn_ranks": job["config"]["topology"]["nn_ranks"], "ps_shards": job["config"]["topology"]["ps_shards"],
        "elapsed_s": elapsed_s,
    }


def _print_summary(report: dict) -> None:
    table = Table("", "", show_header=False, box=None)
    for key in ("job_id", "state", "mode", "staleness_bound", "auc", "logloss", "samples_trained",
                "samples_per_sec", "max_staleness_observed", "mean_staleness_observed", "elapsed_s"):
        value = report[key]
        table.add_row(key, f"{value:.4f}" if isinstance(value, float) else str(value))
    console.print(table)


def run_job(run_dir: Path, config: JobConfig, mode: str | None = None) -> dict:
    """Submit `config` to the stack in `run_dir`, follow it to the end, and report."""
    started = time.monotonic()
    client = CoordinatorClient.for_stack(run_dir)
    try:
        job = client.submit(config)
        console.print(f"job [bold]{job['id']}[/bold] submitted")
        view = _follow(client, job["id"])
    finally:
        client.close()
    return summarize(view, mode, time.monotonic() - started)


MODES = {"sync": 0, "async": None}


@app.command()
def train(job_file: Annotated[Path, typer.Argument(help="job YAML", exists=True, dir_okay=False)],
          run_dir: RunDir = None,
          report: Annotated[Optional[Path], typer.Option(help="write the JSON report here")] = None) -> None:
    """Submit a job to the running stack and follow it to the end."""
    config = _load_job(job_file)
    result = run_job(_run_dir(run_dir), config)
    _finish(result, report)


def _finish(result: dict, report: Path | None) -> None:
    _print_summary(result)
    if report:
        report.parent.mkdir(parents=True, exist_ok=True)
        report.write_text(json.dumps(result, indent=2))
        console.print(f"report written to {report}")
    if result["state"] != "finished":
        _fail(f"job {result['state']}: {result['error']}")


@app.command()
def demo(mode: Annotated[str, typer.Option(help="sync (k=0), hybrid (bounded k) or async (unbounded)")] = "hybrid",
         staleness: Annotated[Optional[int], typer.Option(min=0, help="the bound k in hybrid mode "
                                                          "[default: the job's]")] = None,
         job_file: Annotated[Path, typer.Option("--job", help="job YAML")] = launcher.REPO_ROOT / "examples/adult/job.yaml",
         report: Annotated[Optional[Path], typer.Option(help="write the JSON report here")] = Path("reports/demo.json"),
         run_dir: RunDir = None) -> None:
    """Bring the local stack up, train the Adult job for one epoch, evaluate on adult.test,
    print a summary, write the JSON report, and take the stack down."""
    if mode not in ("sync", "hybrid", "async"):
        _fail(f"--mode must be one of sync, hybrid, async (got {mode!r})")
    config = _load_job(job_file)
    bound = MODES.get(mode, staleness if staleness is not None else config.training.staleness_bound)
    if mode == "hybrid" and bound is None:
        _fail("hybrid mode needs a bound: pass --staleness K")
    config = config.model_copy(update={"training": config.training.model_copy(update={"staleness_bound": bound})})
    rd = _run_dir(run_dir) if run_dir else default_run_dir().with_name("demo")
    topo = config.topology
    up(run_dir=rd, ps_shards=topo.ps_shards, embedding_workers=topo.embedding_workers, nn_ranks=topo.nn_ranks,
       data_loaders=1)
    try:
        result = run_job(rd, config, mode)
    finally:
        down(run_dir=rd)
    _finish(result, report)


@app.command()
def datagen(path: Annotated[Path, typer.Argument(help="the TSV file to write")],
            rows: Annotated[int, typer.Option(min=1, help="rows to write")] = 100_000,
            seed: Annotated[int, typer.Option(help="seed of the planted model and the draws")] = 0) -> None:
    """Write Criteo-format TSV from a planted logistic model and print that model's own
    (Bayes-optimal) AUC: the ceiling a trained model can approach."""
    report = generate_criteo(path, rows, seed)
    console.print_json(json.dumps(dataclasses.asdict(report), default=str))


if __name__ == "__main__":
    app()
