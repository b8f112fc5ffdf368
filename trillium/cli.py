"""The `trillium` command line."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from trillium import stack
from trillium.config import ENV_RUN_DIR, KafkaConnection, StackTopology, default_run_dir, describe_validation_error
from trillium.data import load_job
from trillium.data.sources.datagen import generate_criteo
from trillium.job import JobConfig, KafkaData
from trillium.stack.client import ApiError, CoordinatorClient, CoordinatorUnavailable
from trillium.wire import kafka

app = typer.Typer(
    help="Trillium: hybrid training of recommender models with huge embedding tables.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
# No markup in what we print: job errors, paths and server messages are remote or user text
# ("[/__w/...]" in an error once crashed the CLI). Our own emphasis is explicit styles.
console = Console(markup=False, highlight=False)

RunDir = Annotated[
    Optional[Path],
    typer.Option(
        "--run-dir", help=f"stack directory (default: ${ENV_RUN_DIR} or .trillium/run; the demo's own: .trillium/demo)"
    ),
]


def _run_dir(run_dir: Path | None) -> Path:
    return (run_dir or default_run_dir()).absolute()


def _fail(message: str) -> None:
    console.print(Text.assemble(("error: ", "red"), " ".join(message.split())), soft_wrap=True)  # one line
    raise typer.Exit(1)


@app.command()
def up(
    run_dir: RunDir = None,
    ps_shards: Annotated[int, typer.Option(min=1, help="embedding PS shards")] = 2,
    embedding_workers: Annotated[int, typer.Option(min=1)] = 1,
    nn_ranks: Annotated[int, typer.Option(min=1, help="NN worker ranks")] = 2,
    data_loaders: Annotated[int, typer.Option(min=1)] = 1,
) -> None:
    """Start Kafka, Redis and the services in the background; returns once all are healthy.

    Set TRILLIUM_KAFKA_BOOTSTRAP / TRILLIUM_REDIS_URL to use external servers instead."""
    rd = _run_dir(run_dir)
    new_token = not (rd / "token").exists()
    topology = StackTopology(
        ps_shards=ps_shards, embedding_workers=embedding_workers, nn_ranks=nn_ranks, data_loaders=data_loaders
    )
    with console.status("starting the stack…"):
        try:
            st = stack.up(rd, topology)
        except stack.LauncherError as err:
            _fail(str(err))
    console.print(Text.assemble(("stack running", "green"), f" in {rd}"))
    console.print(
        f"  kafka     {st['kafka']['bootstrap']}\n  redis     {st['redis']['url']}\n"
        f"  coordinator {st['coordinator_url']}"
    )
    if new_token:
        console.print(f"  API token (written to {st['token_file']}, mode 600): {stack.read_token(rd)}")


@app.command()
def status(
    run_dir: RunDir = None, as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False
) -> None:
    """Show every endpoint and each part's health (exit code 1 unless all are healthy)."""
    st = stack.status(_run_dir(run_dir))
    if as_json:
        print(json.dumps(st, indent=2))
        raise typer.Exit(0 if st["healthy"] else 1)
    if st["phase"] in ("not running", "dead"):
        console.print(f"no stack running in {st['run_dir']} ({st['phase']})")
        raise typer.Exit(1)
    console.print(
        Text.assemble(
            f"stack in {st['run_dir']}: ", (st["phase"], "bold"), f" — {st['error']}" if st.get("error") else ""
        )
    )
    table = Table("part", "endpoint", "pid", "restarts", "health")
    ok = lambda good: Text("ok", "green") if good else Text("down", "red")  # noqa: E731
    table.add_row(
        "kafka", st["kafka"]["bootstrap"], "external" if st["kafka"]["external"] else "", "", ok(st["kafka"]["ok"])
    )
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
        stopped = stack.down(rd)
    console.print("stack stopped" if stopped else f"no stack running in {rd}")


def _load_job(path: Path) -> JobConfig:
    try:
        return load_job(path)
    except ValidationError as err:
        console.print(Text.assemble((f"invalid job {path}:", "red"), "\n" + describe_validation_error(err)))
    except (OSError, ValueError) as err:
        console.print(Text.assemble((f"invalid job {path}:", "red"), f" {err}"))
    raise typer.Exit(2)


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


def mode_of(bound: int | None) -> str:
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
        "eval_samples": metrics.get("samples"),
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
        "progressive": {k: view["progressive"][k] for k in ("auc", "logloss", "samples", "scored", "delay_seconds")},
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
        "logloss",
        "samples_trained",
        "samples_per_sec",
        "max_staleness_observed",
        "mean_staleness_observed",
        "elapsed_s",
    ):
        value = report[key]
        table.add_row(key, f"{value:.4f}" if isinstance(value, float) else str(value))
    console.print(table)


@dataclasses.dataclass
class Outcome:
    report: dict
    view: dict
    series: list[dict]


def run_job(run_dir: Path, config: JobConfig) -> Outcome:
    """Submit `config` to the stack in `run_dir`, follow it to the end, and report."""
    started = time.monotonic()
    with _coordinator(run_dir) as client:
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
    config = _load_job(job_file)
    outcome = run_job(_run_dir(run_dir), config)
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
        _fail(f"job {result['state']}: {result['error']}")


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
        _fail(f"--mode must be one of sync, hybrid, async (got {mode!r})")
    config = _load_job(job_file)
    bound = MODES.get(mode, staleness if staleness is not None else config.training.staleness_bound)
    if mode == "hybrid" and bound is None:
        _fail("hybrid mode needs a bound: pass --staleness K")
    config = config.model_copy(update={"training": config.training.model_copy(update={"staleness_bound": bound})})
    rd = _run_dir(run_dir) if run_dir else default_run_dir().with_name("demo")
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


# ---- job control: clients of the coordinator's REST API ----------------------------------------

JobId = Annotated[str, typer.Argument(help="the job's id (see `trillium jobs`)")]
JsonOut = Annotated[bool, typer.Option("--json", help="machine-readable output")]


@contextlib.contextmanager
def _coordinator(run_dir: Path | None) -> Iterator[CoordinatorClient]:
    """A client of the stack's coordinator; API errors end the command with one line."""
    try:
        client = CoordinatorClient.for_stack(_run_dir(run_dir))
    except (stack.LauncherError, OSError) as err:
        _fail(str(err))
    try:
        yield client
    except (ApiError, CoordinatorUnavailable) as err:
        _fail(str(err))
    finally:
        client.close()


def _when(ts: float | None) -> str:
    return datetime.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M") if ts else ""


def _bound(bound: int | None) -> str:
    return "unbounded" if bound is None else str(bound)


@app.command("jobs")
def list_jobs(run_dir: RunDir = None, as_json: JsonOut = False) -> None:
    """List the stack's jobs, oldest first."""
    with _coordinator(run_dir) as client:
        jobs = client.jobs()
    if as_json:
        print(json.dumps(jobs, indent=2))
        return
    table = Table()
    table.add_column("id", no_wrap=True)  # whole, to be copied
    for column in ("state", "created", "finished", "error"):
        table.add_column(column)
    for job in jobs:
        table.add_row(
            job["id"], job["state"], _when(job["created_at"]), _when(job["finished_at"]), job.get("error") or ""
        )
    console.print(table if jobs else "no jobs")


@app.command("job")
def show_job(job_id: JobId, run_dir: RunDir = None, as_json: JsonOut = False) -> None:
    """Show a job: state, progress, staleness per rank, lost workers, evaluation."""
    with _coordinator(run_dir) as client:
        view = client.job(job_id)
    if as_json:
        print(json.dumps(view, indent=2))
        return
    job, prog = view["job"], view["progress"]
    recent = prog["recent_samples_per_sec"]
    rows: list[tuple[str, Any]] = [
        ("id", job["id"]),
        ("state", job["state"]),
        ("samples", f"{prog['samples']:,} (epoch {prog['epoch']}, {prog['steps']} steps)"),
        ("samples/s", f"{prog['samples_per_sec']:,.0f} mean" + (f", {recent:,.0f} now" if recent is not None else "")),
        ("loss", "" if prog["last_loss"] is None else f"{prog['last_loss']:.4f} last, {prog['mean_loss']:.4f} mean"),
    ]
    for rank, s in view["staleness"].items():
        rows.append(
            (
                f"staleness rank {rank}",
                f"max {s['max']}, mean {s['mean']:.2f} over {s['count']} lookups (bound {_bound(s['bound'])})",
            )
        )
    if view["lost_workers"]:
        rows.append(("lost workers", ", ".join(view["lost_workers"])))
    rows += _stream_rows(view)
    if job.get("metrics"):
        rows.append(
            (
                "eval",
                ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in job["metrics"].items()),
            )
        )
    if job.get("error"):
        rows.append(("error", job["error"]))
    if job.get("attempt"):
        rows.append(("attempt", str(job["attempt"])))
    for r in job.get("recoveries", []):
        rows.append((r["kind"], f"{_when(r['at'])} from step {r['checkpoint_step']}: {r['cause']}"))
    if view.get("last_checkpoint"):
        c = view["last_checkpoint"]
        rows.append(
            (
                "last checkpoint",
                f"step {c['step']} (epoch {c['epoch']}), {_when(c['created_at'])}, {c['bytes'] / 1e6:,.1f} MB",
            )
        )
    table = Table("", "", show_header=False, box=None)
    for key, value in rows:
        table.add_row(key, str(value))
    console.print(table)


def _stream_rows(view: dict[str, Any]) -> list[tuple[str, str]]:
    """Progressive validation, the input's lag and the joiner's counts (a stream's job)."""
    rows = []
    p = view.get("progressive")
    if p and p["samples"]:
        rows.append(
            (
                "progressive",
                f"AUC {p['auc']:.4f}, log loss {p['logloss']:.4f} over the last "
                f"{p['samples']:,} of {p['scored']:,} samples scored before training",
            )
        )
        if p.get("delay_seconds"):
            rows.append(
                ("click to trained", f"p50 {p['delay_seconds']['p50']:.1f} s, p99 {p['delay_seconds']['p99']:.1f} s")
            )
    stream = view.get("stream")
    if stream:
        for i in stream["inputs"]:
            behind = "" if i["lag_seconds"] is None else f", {i['lag_seconds']:.1f} s behind"
            rows.append((f"lag {i['topic']}/{i['partition']}", f"{i['lag_messages']:,} messages{behind}"))
        for field in ("joined", "dead_letters"):
            if stream[field]:
                rows.append((field.replace("_", " "), ", ".join(f"{k} {v:,}" for k, v in stream[field].items())))
    return rows


def _control(run_dir: Path | None, act: Callable[[CoordinatorClient], dict]) -> None:
    with _coordinator(run_dir) as client:
        job = act(client)
    console.print(f"job {job['id']}: {job['state']}")


@app.command()
def pause(job_id: JobId, run_dir: RunDir = None) -> None:
    """Pause a running job: its NN ranks hold before their next step."""
    _control(run_dir, lambda client: client.pause(job_id))


@app.command()
def resume(
    job_id: JobId,
    checkpoint: Annotated[
        Optional[int], typer.Option(min=0, help="the checkpoint's step (default: the newest)")
    ] = None,
    run_dir: RunDir = None,
) -> None:
    """Resume a paused job; or a stopped or failed one from a checkpoint (the job recovers from it
    in a new attempt and goes on)."""
    _control(run_dir, lambda client: client.resume(job_id, checkpoint))


@app.command()
def checkpoints(
    job_id: JobId,
    take: Annotated[bool, typer.Option("--take", help="ask for a checkpoint of the running job now")] = False,
    delete: Annotated[Optional[int], typer.Option(min=0, help="delete the checkpoint at this step")] = None,
    run_dir: RunDir = None,
    as_json: JsonOut = False,
) -> None:
    """List a job's complete checkpoints; --take asks for one now, --delete STEP removes one."""
    with _coordinator(run_dir) as client:
        if take:
            asked = client.request_checkpoint(job_id)
            console.print(f"job {job_id}: checkpoint {asked['seq']} requested")
            return
        if delete is not None:
            client.delete_checkpoint(job_id, delete)
            console.print(f"job {job_id}: checkpoint at step {delete} deleted")
            return
        listing = client.checkpoints(job_id)
    if as_json:
        print(json.dumps(listing, indent=2))
        return
    table = Table("step", "epoch", "attempt", "reason", "tables", "written", "MB", "s to write", "pause s", "eval auc")
    for c in listing:
        auc = (c.get("eval") or {}).get("auc")
        bases = sorted({f["delta_of"] for f in c["files"] if f.get("delta_of") is not None})
        tables = f"delta of {', '.join(map(str, bases))}" if bases else "full"
        table.add_row(
            str(c["step"]),
            str(c["epoch"]),
            str(c["attempt"]),
            c["reason"],
            tables,
            _when(c["created_at"]),
            f"{c['bytes'] / 1e6:,.1f}",
            f"{c['seconds_to_write']:.2f}",
            f"{c['pause_seconds']:.3f}",
            "" if auc is None else f"{auc:.4f}",
        )
    console.print(table if listing else f"job {job_id} has no complete checkpoint")


@app.command()
def stop(job_id: JobId, run_dir: RunDir = None) -> None:
    """Stop a job (it is `stopping` until its workers have ended their part)."""
    _control(run_dir, lambda client: client.stop(job_id))


@app.command()
def staleness(
    job_id: JobId,
    set_bound: Annotated[Optional[int], typer.Option("--set", min=0, help="the new bound K")] = None,
    unbounded: Annotated[bool, typer.Option("--unbounded", help="remove the bound, live")] = False,
    run_dir: RunDir = None,
    as_json: JsonOut = False,
) -> None:
    """Show a job's staleness bound and the staleness observed per NN rank; change the bound
    of a running job with --set K or --unbounded."""
    if set_bound is not None and unbounded:
        _fail("give --set K or --unbounded, not both")
    with _coordinator(run_dir) as client:
        report = (
            client.set_staleness(job_id, set_bound) if set_bound is not None or unbounded else client.staleness(job_id)
        )
    if as_json:
        print(json.dumps(report, indent=2))
        return
    console.print(f"job {report['job_id']}: staleness bound {_bound(report['bound'])}")
    table = Table("rank", "lookups", "max", "mean", "histogram (0, 1, ..., 16+)")
    for rank, s in report["ranks"].items():
        table.add_row(rank, str(s["count"]), str(s["max"]), f"{s['mean']:.2f}", " ".join(map(str, s["histogram"])))
    console.print(table)


def _input_kafka(config: JobConfig, run_dir: Path | None) -> KafkaConnection:
    """The Kafka a stream job reads: its data.bootstrap, else the stack's."""
    bootstrap = getattr(config.data, "bootstrap", None)
    if not bootstrap:
        st = stack.read_state(_run_dir(run_dir))
        if not st:
            _fail(f"no stack in {_run_dir(run_dir)} and no data.bootstrap in the job: where is Kafka?")
        bootstrap = st["kafka"]["bootstrap"]
    return KafkaConnection.from_env(bootstrap)


@app.command()
def topics(
    job_file: Annotated[
        Path, typer.Option("--job", help="the online job whose input topics to create", exists=True, dir_okay=False)
    ],
    partitions: Annotated[
        int, typer.Option(min=1, help="partitions of each (the same for all: a join needs co-partitioned topics)")
    ] = 4,
    run_dir: RunDir = None,
) -> None:
    """Create a stream job's input topics (those missing) for producers of your own, such as kcat."""
    config = _load_job(job_file)
    if not isinstance(config.data, KafkaData):
        _fail(f"the job's data.source is {config.data.source!r}: it reads no topics")
    names = config.data.input_topics
    asyncio.run(kafka.ensure_topics(_input_kafka(config, run_dir), {name: partitions for name in names}))
    console.print(f"topics {', '.join(names)}: ready")


@app.command()
def replay(
    file: Annotated[
        Path,
        typer.Argument(
            help="the data set (a criteo TSV, e.g. `trillium datagen` output, or an adult CSV)",
            exists=True,
            dir_okay=False,
        ),
    ],
    job_file: Annotated[
        Path, typer.Option("--job", help="the online job whose topics to feed", exists=True, dir_okay=False)
    ],
    rate: Annotated[float, typer.Option(min=0, help="impressions a second (0: as fast as it can)")] = 1000.0,
    fmt: Annotated[str, typer.Option("--format", help="criteo or adult")] = "criteo",
    limit: Annotated[Optional[int], typer.Option(min=1, help="rows to replay (default: all)")] = None,
    late_fraction: Annotated[float, typer.Option(min=0, max=1, help="clicks sent after the window")] = 0.0,
    malformed_fraction: Annotated[float, typer.Option(min=0, max=1, help="messages replaced by garbage")] = 0.0,
    seed: Annotated[int, typer.Option(help="of the delays and the choices")] = 0,
    run_dir: RunDir = None,
) -> None:
    """Turn a data set into a live stream: timestamped impression events, and a click event 0..W
    seconds later for each positive row (W: the job's attribution window), on the job's topics."""
    from trillium.data.replay import replay as run_replay

    config = _load_job(job_file)
    conn = _input_kafka(config, run_dir)
    try:
        result = asyncio.run(
            run_replay(
                file,
                config,
                conn,
                fmt=fmt,
                rate=rate,
                limit=limit,
                late_fraction=late_fraction,
                malformed_fraction=malformed_fraction,
                seed=seed,
            )
        )
    except ValueError as err:
        _fail(str(err))
    console.print_json(json.dumps(dataclasses.asdict(result) | {"events_per_sec": round(result.events_per_sec, 1)}))


@app.command()
def datagen(
    path: Annotated[Path, typer.Argument(help="the TSV file to write")],
    rows: Annotated[int, typer.Option(min=1, help="rows to write")] = 100_000,
    seed: Annotated[int, typer.Option(help="seed of the planted model and the draws")] = 0,
    vocab_size: Annotated[
        Optional[int], typer.Option(min=1, help="IDs per categorical slot (default: 10^3..10^6, varying by slot)")
    ] = None,
) -> None:
    """Write Criteo-format TSV from a planted logistic model and print that model's own
    (Bayes-optimal) AUC: the ceiling a trained model can approach."""
    report = generate_criteo(path, rows, seed, vocab_sizes=[vocab_size] * 26 if vocab_size else None)
    console.print_json(json.dumps(dataclasses.asdict(report), default=str))


if __name__ == "__main__":
    app()
