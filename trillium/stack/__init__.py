"""The local stack: Kafka (KRaft), Redis and the services as supervised processes.

`up()` starts a detached supervisor process for a run directory (`supervisor.py`) and waits
until the stack is ready; `status()` probes every endpoint with its real protocol; `down()`
stops the supervisor, which stops everything in reverse order. `procs.py` holds a process's
spec, ports, pids and the run directory's files; `hosts.py` where each process runs (all on
loopback, or each on a host of its own); `tls.py` the certificates and passwords of a stack with
TLS; `broker.py` the local Kafka node's configuration and command line; `client.py` the
coordinator's REST client.

Kafka and Redis are started only when no external server is configured
(TRILLIUM_KAFKA_BOOTSTRAP / TRILLIUM_REDIS_URL). Ports are free ones chosen per run
directory, so several stacks (tests and a demo, say) run side by side.

Imports run one way: `trillium.config`, `trillium.wire` <- `procs` <- `tls` <- `broker` <- `supervisor`
and this front; `client` <- `warmup` <- this front. The CLI (`trillium.cli`) is the only entry point users
call.
"""

from __future__ import annotations

import asyncio
import os
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from trillium.config import (
    ENV_COORDINATOR_URL,
    ENV_KAFKA_BOOTSTRAP,
    ENV_REDIS_URL,
    ENV_RUN_DIR,
    ENV_SERVING_MODEL,
    StackTopology,
)
from trillium.job.record import ACTIVE
from trillium.wire.kafka import wait_for_kafka
from trillium.wire.state import wait_for_redis

from .broker import kafka_connection
from .client import CoordinatorClient
from .procs import REPO_ROOT, STATE_FILE, LauncherError, pid_alive, read_state, read_token, scope_env
from .tls import load as stack_tls_of
from .warmup import warm_up

__all__ = ["REPO_ROOT", "LauncherError", "down", "read_state", "read_token", "status", "up"]


def up(
    run_dir: Path,
    topology: StackTopology | None = None,
    *,
    services: bool = True,
    kafka_bootstrap: str | None = None,
    redis_url: str | None = None,
    timeout_s: float = 240.0,
    warm: bool = True,
    cluster: bool = False,
    link_delay: bool = False,
    clock_jumps: bool = False,
    object_store: bool = False,
    tls: bool = False,
    allow_paths: Sequence[str | Path] = (),
) -> dict[str, Any]:
    """Start the stack in `run_dir` (or find it running) and return its state. With `warm`, a
    tiny job is trained first (`warmup.py`): the user's first job costs what the next ones do.
    With `cluster`, every process runs on a host of its own (`hosts.py`; needs root), and with
    `link_delay` too, latency can be added to each host's links (`links.Network.delay`), and with
    `clock_jumps` each service's wall clock moved (`clocks.jump`). With
    `object_store`, an S3 store (`object_store.py`) serves `s3://trillium/...` to every process.
    With `tls`, every listener speaks TLS, and Redis and Kafka take passwords (`tls.py`). Jobs
    may read data and keep state under `allow_paths` too, beside the run directory and the
    shipped examples (unless TRILLIUM_ALLOWED_PATHS says where: trillium.job.trust)."""
    run_dir = run_dir.absolute()
    run_dir.mkdir(parents=True, exist_ok=True)
    current = read_state(run_dir)
    if current and pid_alive(current.get("supervisor_pid")) and current["phase"] in ("starting", "running"):
        raise LauncherError(
            f"a stack is already running in {run_dir} (supervisor pid {current['supervisor_pid']}); "
            "use `trillium status` or `trillium down`"
        )
    (run_dir / STATE_FILE).unlink(missing_ok=True)
    argv = [
        sys.executable,
        "-m",
        "trillium.stack.supervisor",
        "--run-dir",
        str(run_dir),
        "--topology",
        (topology or StackTopology()).model_dump_json(),
    ]
    if not services:
        argv.append("--no-services")
    if cluster:
        argv.append("--cluster")
    if link_delay:
        argv.append("--link-delay")
    if clock_jumps:
        argv.append("--clock-jumps")
    if object_store:
        argv.append("--object-store")
    if tls:
        argv.append("--tls")
    for path in allow_paths:
        argv += ["--allow-path", str(path)]
    env = dict(os.environ)
    env.pop(ENV_KAFKA_BOOTSTRAP, None)
    env.pop(ENV_REDIS_URL, None)
    kafka_bootstrap = kafka_bootstrap or os.environ.get(ENV_KAFKA_BOOTSTRAP)
    redis_url = redis_url or os.environ.get(ENV_REDIS_URL)
    if kafka_bootstrap:
        env[ENV_KAFKA_BOOTSTRAP] = kafka_bootstrap
    if redis_url:
        env[ENV_REDIS_URL] = redis_url
    (run_dir / "logs").mkdir(exist_ok=True)
    with open(run_dir / "logs" / "supervisor.log", "ab") as logfile:
        sup = subprocess.Popen(
            argv, stdout=logfile, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
        )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        st = read_state(run_dir)
        if st and st.get("supervisor_pid") == sup.pid and st["phase"] == "running":
            if services and warm:
                _warm_up(run_dir, topology or StackTopology())
            return st
        if sup.poll() is not None:
            st = read_state(run_dir) or {}
            raise LauncherError(
                f"the stack failed to start: {st.get('error') or 'supervisor exited'} (logs in {run_dir / 'logs'})"
            )
        time.sleep(0.2)
    down(run_dir)
    raise LauncherError(f"the stack was not ready in {timeout_s:.0f}s (logs in {run_dir / 'logs'})")


def _warm_up(run_dir: Path, topology: StackTopology) -> None:
    client = CoordinatorClient.for_stack(run_dir)
    try:
        if any(job["state"] in ACTIVE for job in client.jobs()):
            return  # a job of an earlier start goes on (external Redis): it is warm enough
        warm_up(client, topology)
    except Exception as err:
        down(run_dir)
        raise LauncherError(
            f"the stack started but could not train its warm-up job: {err} (logs in {run_dir / 'logs'})"
        ) from None
    finally:
        client.close()


async def _probe(st: dict[str, Any]) -> dict[str, Any]:
    stack_tls = stack_tls_of(st)

    async def kafka() -> dict[str, Any]:
        try:
            conn = kafka_connection(st["kafka"]["bootstrap"], st["kafka"]["external"], stack_tls)
            return {"ok": True, "brokers": await wait_for_kafka(conn, timeout_s=5)}
        except Exception as exc:
            return {"ok": False, "error": str(exc)}

    async def redis() -> dict[str, Any]:
        try:
            url = st["redis"]["url"]
            await wait_for_redis(stack_tls.with_password(url) if stack_tls else url, timeout_s=3)
            return {"ok": True}
        except Exception as exc:
            return {"ok": False, "error": str(exc)}

    async def health(client: httpx.AsyncClient, proc: dict[str, Any]) -> dict[str, Any]:
        """Its /healthz, and what it says of itself behind the token (/status)."""
        try:
            up = await client.get(f"{proc['http_url']}/healthz")
            ok = up.status_code == 200 and up.json().get("status") == "ok"
            r = await client.get(f"{proc['http_url']}/status", headers=auth)
            return {"ok": ok, **(r.json() if r.status_code == 200 else {"error": f"/status: HTTP {r.status_code}"})}
        except (httpx.HTTPError, ValueError) as exc:
            return {"ok": False, "error": str(exc)}

    async def store(client: httpx.AsyncClient) -> dict[str, Any] | None:
        if not st.get("object_store"):
            return None
        try:  # any answer: S3 refuses an unsigned request
            await client.get(st["object_store"]["endpoint"])
            return {"ok": True}
        except httpx.HTTPError as exc:
            return {"ok": False, "error": str(exc)}

    services = [p for p in st["processes"] if p.get("http_port")]
    auth = {"Authorization": f"Bearer {read_token(Path(st['run_dir']))}"} if services else {}
    verify = ssl.create_default_context(cafile=str(stack_tls.ca_file)) if stack_tls else True
    async with httpx.AsyncClient(timeout=3.0, verify=verify) as client:
        k, r, o, *h = await asyncio.gather(kafka(), redis(), store(client), *(health(client, p) for p in services))
    return {
        "kafka": k,
        "redis": r,
        "object_store": o,
        "services": dict(zip((p["name"] for p in services), h, strict=True)),
    }


def serving_env(run_dir: Path, model: str) -> dict[str, str]:
    """What a serving process started beside a running stack needs to serve `model` from it (a
    replica of `trillium serve`, a serving shard, a frontend)."""
    st = read_state(run_dir)
    return {
        ENV_KAFKA_BOOTSTRAP: st["kafka"]["bootstrap"],
        ENV_REDIS_URL: st["redis"]["url"],
        ENV_COORDINATOR_URL: st["coordinator_url"],
        **scope_env(run_dir),
        ENV_RUN_DIR: st["run_dir"],
        ENV_SERVING_MODEL: model,
    }


def status(run_dir: Path) -> dict[str, Any]:
    """The stack's endpoints and each part's health, probed now with its own protocol."""
    run_dir = run_dir.absolute()
    st = read_state(run_dir)
    if st is None:
        return {"run_dir": str(run_dir), "phase": "not running", "healthy": False}
    if not pid_alive(st.get("supervisor_pid")):
        st["phase"] = "not running" if st["phase"] in ("stopped", "failed") else "dead"
        st["healthy"] = False
        return st
    probes = asyncio.run(_probe(st))
    st["kafka"].update(probes["kafka"])
    st["redis"].update(probes["redis"])
    if probes["object_store"] is not None:
        st["object_store"].update(probes["object_store"])
    for proc in st["processes"]:
        if proc["name"] in probes["services"]:
            proc["health"] = probes["services"][proc["name"]]
    # The serving replicas, where clients ask for predictions (REST and gRPC; the stack's token).
    st["serving"] = [
        {"name": p["name"], "url": p["http_url"], "grpc": p["grpc_address"]}
        for p in st["processes"]
        if p["role"] == "serving"
    ]
    st["healthy"] = (
        st["phase"] == "running"
        and probes["kafka"]["ok"]
        and probes["redis"]["ok"]
        and (probes["object_store"] or {"ok": True})["ok"]
        and all(h["ok"] for h in probes["services"].values())
    )
    return st


def down(run_dir: Path, timeout_s: float = 90.0) -> bool:
    """Stop the stack in `run_dir`; returns False if none was running."""
    run_dir = run_dir.absolute()
    st = read_state(run_dir)
    pid = st.get("supervisor_pid") if st else None
    if not pid_alive(pid):
        return False
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if pid_alive(pid):
        # Last resort: the supervisor hung; take down everything it recorded.
        for proc in (read_state(run_dir) or st)["processes"]:
            if pid_alive(proc.get("pid")):
                os.kill(proc["pid"], signal.SIGKILL)
        os.kill(pid, signal.SIGKILL)
    return True
