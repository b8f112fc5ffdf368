"""`trillium up`, `status`, `down`: the local stack."""

from __future__ import annotations

import json
from typing import Annotated, Optional

import typer
from rich.table import Table
from rich.text import Text

from trillium import stack
from trillium.config import StackTopology, redact

from .app import RunDir, app, console, fail, run_dir_of


@app.command()
def up(
    run_dir: RunDir = None,
    ps_shards: Annotated[
        int, typer.Option(min=1, help="embedding PS shards: the most a job can run, or be resharded, on")
    ] = 2,
    embedding_workers: Annotated[int, typer.Option(min=1)] = 1,
    nn_ranks: Annotated[int, typer.Option(min=1, help="NN worker ranks")] = 2,
    data_loaders: Annotated[int, typer.Option(min=1)] = 1,
    serving_replicas: Annotated[int, typer.Option(min=0, help="replicas serving the published models")] = 1,
    serving_shards: Annotated[
        int,
        typer.Option(
            min=0,
            help="serving shards, each holding a slice of every model's tables; the replicas then run the "
            "networks over their rows (0: each replica holds whole models)",
        ),
    ] = 0,
    serving_shard_replicas: Annotated[
        int, typer.Option(min=1, help="processes holding each serving shard: one may be lost without a failed request")
    ] = 1,
    cluster: Annotated[
        bool,
        typer.Option(
            help="each process on a host of its own: a network namespace with its own address on a bridge "
            "(needs root; see docs/operations.md, Running across hosts)"
        ),
    ] = False,
    object_store: Annotated[
        bool,
        typer.Option(
            help="an S3 object store (versitygw, `make .cache/bin/versitygw`) for jobs that name "
            "s3://trillium/... as their publish.dir or checkpoint.dir"
        ),
    ] = False,
    tls: Annotated[
        bool,
        typer.Option(
            help="TLS on every listener (a CA and a certificate per host, made in <run-dir>/tls), Redis over "
            "TLS with a password, Kafka with SCRAM over TLS: for a stack whose hosts talk across a network"
        ),
    ] = False,
    allow_path: Annotated[
        Optional[list[str]],
        typer.Option(
            metavar="PATH",
            help="a directory or URL prefix (s3://bucket/prefix) jobs may also read data from and keep state "
            "under, beside the run directory and the shipped examples (repeatable; TRILLIUM_ALLOWED_PATHS, "
            "when set, replaces them all)",
        ),
    ] = None,
) -> None:
    """Start Kafka, Redis and the services in the background; returns once all are healthy.

    Set TRILLIUM_KAFKA_BOOTSTRAP / TRILLIUM_REDIS_URL to use external servers instead."""
    rd = run_dir_of(run_dir)
    new_token = not (rd / "token").exists()
    topology = StackTopology(
        ps_shards=ps_shards,
        embedding_workers=embedding_workers,
        nn_ranks=nn_ranks,
        data_loaders=data_loaders,
        serving_replicas=serving_replicas,
        serving_shards=serving_shards,
        serving_shard_replicas=serving_shard_replicas,
    )
    with console.status("starting the stack…"):
        try:
            st = stack.up(
                rd, topology, cluster=cluster, object_store=object_store, tls=tls, allow_paths=allow_path or ()
            )
        except stack.LauncherError as err:
            fail(str(err))
    console.print(Text.assemble(("stack running", "green"), f" in {rd}"))
    console.print(
        f"  kafka     {st['kafka']['bootstrap']}\n  redis     {redact(st['redis']['url'])}\n"
        f"  coordinator {st['coordinator_url']}"
    )
    if store := st.get("object_store"):
        console.print(f"  store     {store['url']} at {store['endpoint']} (keys: {rd / 'store' / 'credentials.json'})")
    if st.get("tls"):
        console.print(f"  tls       CA {st['tls']['ca_file']} (passwords: {rd / 'tls' / 'passwords.json'})")
    for replica in stack.status(rd).get("serving", []):
        console.print(f"  serving   {replica['url']}  grpc {replica['grpc']}")
    if new_token:
        files = st["token_files"]
        console.print(f"  API token (an operator's; written to {files['operate']}, mode 600): {stack.read_token(rd)}")
        console.print(f"  prediction clients' token in {files['predict']}, metrics scrapers' in {files['observe']}")


@app.command()
def status(
    run_dir: RunDir = None, as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False
) -> None:
    """Show every endpoint and each part's health (exit code 1 unless all are healthy)."""
    st = stack.status(run_dir_of(run_dir))
    if as_json:
        print(redact(json.dumps(st, indent=2)))
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
    table.add_row(
        "redis", redact(st["redis"]["url"]), "external" if st["redis"]["external"] else "", "", ok(st["redis"]["ok"])
    )
    if store := st.get("object_store"):
        table.add_row("object store", f"{store['url']} at {store['endpoint']}", "", "", ok(store["ok"]))
    for proc in st["processes"]:
        if proc.get("http_url"):
            endpoint = proc["http_url"] + (f"  grpc {proc['grpc_address']}" if proc.get("grpc_address") else "")
            health = Text("backoff", "yellow") if proc.get("state") == "backoff" else ok(proc["health"]["ok"])
            table.add_row(proc["name"], endpoint, str(proc["pid"]), str(proc["restarts"]), health)
    console.print(table)
    raise typer.Exit(0 if st["healthy"] else 1)


@app.command()
def down(run_dir: RunDir = None) -> None:
    """Stop the stack and everything it started."""
    rd = run_dir_of(run_dir)
    with console.status("stopping the stack…"):
        stopped = stack.down(rd)
    console.print("stack stopped" if stopped else f"no stack running in {rd}")
