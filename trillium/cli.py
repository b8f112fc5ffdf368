"""The `trillium` command line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from trillium import launcher
from trillium.config import ENV_RUN_DIR, Topology, default_run_dir

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


@app.command()
def demo(run_dir: RunDir = None) -> None:
    """Bring the local stack up, show its status, and take it down again."""
    rd = _run_dir(run_dir) if run_dir else default_run_dir().with_name("demo")
    up(run_dir=rd)
    try:
        status(run_dir=rd)
    except typer.Exit as done:
        if done.exit_code:
            _fail("the stack is not healthy")
    finally:
        down(run_dir=rd)


if __name__ == "__main__":
    app()
