"""Serving: a replica in the foreground for one model (`serve`), and the stack's replicas' view of
the models they serve, with pinning and unpinning (`models`)."""

from __future__ import annotations

import json
import os
import ssl
import sys
import time
from typing import Annotated, Any, Optional

import httpx
import typer
from rich.text import Text

from trillium import stack
from trillium.config import ENV_SERVING_VERSION
from trillium.stack.procs import free_port

from .app import JsonOut, RunDir, app, console, fail, print_table, run_dir_of


def _stack(run_dir: RunDir) -> tuple[dict[str, Any], str]:
    rd = run_dir_of(run_dir)
    st = stack.read_state(rd)
    if not st or st.get("phase") != "running":
        fail(f"no stack running in {rd}: run `trillium up` first")
    return st, stack.read_token(rd)


@app.command()
def serve(
    model: Annotated[str, typer.Argument(help="the model: its job's name, or its publish.model")],
    version: Annotated[
        Optional[int], typer.Option(min=1, help="pin to this version (default: follow the newest)")
    ] = None,
    port: Annotated[int, typer.Option(min=0, max=65535, help="REST port (0: a free one)")] = 0,
    grpc_port: Annotated[int, typer.Option(min=0, max=65535, help="gRPC port (0: a free one)")] = 0,
    host: Annotated[str, typer.Option(help="address to bind")] = "127.0.0.1",
    run_dir: RunDir = None,
) -> None:
    """Serve MODEL in the foreground (Ctrl-C stops it), from the versions the stack's jobs publish:
    REST `POST /v1/models/MODEL:predict` and gRPC `Predict`, both with the stack's token."""
    _stack(run_dir)
    port, grpc_port = port or free_port(), grpc_port or free_port()
    env = dict(os.environ) | stack.serving_env(run_dir_of(run_dir), model)
    if version is not None:
        env[ENV_SERVING_VERSION] = str(version)
    console.print(f"serving {model} at http://{host}:{port} (grpc {host}:{grpc_port}); Ctrl-C stops it")
    argv = [
        sys.executable,
        "-m",
        "trillium.services.serving",
        "--index",
        str(port),
        "--host",
        host,
        "--http-port",
        str(port),
        "--grpc-port",
        str(grpc_port),
    ]
    os.execvpe(argv[0], argv, env)


def _replicas(st: dict[str, Any]) -> list[str]:
    """The serving processes: the serving shards, then the replicas (frontends, with shards). A pin
    goes to the shards and their frontends alike; between the two, a request is answered 503 (the
    frontend's version and the shards' differ), never from two versions."""
    processes = [p for p in st["processes"] if p["role"] in ("serving_shard", "serving")]
    urls = [p["http_url"] for p in sorted(processes, key=lambda p: p["role"] != "serving_shard")]
    if not any(p["role"] == "serving" for p in processes):
        fail("the stack runs no serving replica: start it with `trillium up --serving-replicas N`")
    return urls


def _ago(ts: float | None) -> str:
    return f"{time.time() - ts:.1f}s" if ts else ""


def _seconds(value: float | None) -> str:
    return f"{value:.1f}s" if value is not None else ""


@app.command()
def models(
    model: Annotated[Optional[str], typer.Argument(help="one model (default: all)")] = None,
    pin: Annotated[
        Optional[int], typer.Option(min=1, help="pin MODEL to this version on every replica and serving shard")
    ] = None,
    unpin: Annotated[bool, typer.Option("--unpin", help="make MODEL follow its newest version again")] = False,
    run_dir: RunDir = None,
    as_json: JsonOut = False,
) -> None:
    """The models the stack's serving replicas (and serving shards) serve: version, step,
    freshness, tables; with MODEL, --pin N rolls every one back (or forward) to version N, --unpin
    follows the newest."""
    st, token = _stack(run_dir)
    if (pin is not None or unpin) and model is None:
        fail("--pin and --unpin need a MODEL")
    views = []
    ca_file = (st.get("tls") or {}).get("ca_file")  # a stack with TLS: its replicas' certificates
    verify = ssl.create_default_context(cafile=ca_file) if ca_file else True
    with httpx.Client(timeout=120.0, headers={"Authorization": f"Bearer {token}"}, verify=verify) as client:
        for url in _replicas(st):
            if pin is not None:
                r = client.post(f"{url}/v1/models/{model}/rollback", json={"version": pin})
            elif unpin:
                r = client.post(f"{url}/v1/models/{model}/unpin")
            else:
                r = client.get(f"{url}/v1/models" + (f"/{model}" if model else ""))
            if r.status_code != 200:
                fail(f"{url}: HTTP {r.status_code}: {r.json().get('detail', r.text) if r.content else ''}")
            found = r.json()
            views += [dict(v, replica=url) for v in (found if isinstance(found, list) else [found])]
    if as_json:
        print(json.dumps(views, indent=2))
        return
    columns = ("replica", "model", "version", "step", "kind", "pinned", "age", "freshness lag", "watermark lag")
    rows = []
    for v in views:
        rows.append(
            (
                v["replica"],
                v["model"],
                str(v["version"] or v.get("error") or ""),
                str(v["step"] or ""),
                v["kind"] or "",
                str(v["pinned"] or ""),
                _ago(v["created_at"]),
                _seconds(v.get("freshness_lag_seconds")),
                _seconds(v.get("low_watermark_lag_seconds")),
                f"{sum(t['rows'] for t in v['tables'].values()):,}",
                f"{v['bytes']:,}",
            )
        )
        for refusal in v["refused"][-3:]:
            console.print(Text.assemble(("refused ", "red"), f"version {refusal['version']}: {refusal['reason']}"))
    print_table((*columns, "rows", "bytes"), rows)
