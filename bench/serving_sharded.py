"""Sharded serving beside one replica, for bench/serving.py: serving shards and a frontend for one
model of a running stack, as processes of their own (what `trillium up --serving-shards` starts),
and the frontend's figures over the replica's."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import clients
import httpx

from trillium import stack
from trillium.config import ENV_SERVING_SHARD, ENV_SERVING_SHARDS
from trillium.stack.procs import free_port

READY_S = 300.0  # a shard loads its slice of a million-row model


@contextmanager
def sharded(run_dir: Path, model: str, shards: int, probe: bytes) -> Iterator[clients.Client]:
    """`shards` serving shards and a frontend over them, serving `model`; yields the frontend once
    it answers `probe` (a request body's instances: a JSON array)."""
    env = dict(os.environ) | stack.serving_env(run_dir, model)
    with ExitStack() as processes:
        addresses = []
        for shard in range(shards):
            http, grpc = free_port(), free_port()
            env_shard = env | {ENV_SERVING_SHARD: f"{shard}/{shards}"}
            processes.enter_context(_process("trillium.services.serving.shard", shard, http, grpc, env_shard))
            addresses.append(f"127.0.0.1:{grpc}")
        http, grpc = free_port(), free_port()
        env_frontend = env | {ENV_SERVING_SHARDS: ",".join(addresses)}
        processes.enter_context(_process("trillium.services.serving", 0, http, grpc, env_frontend))
        frontend = clients.Client(f"http://127.0.0.1:{http}", f"127.0.0.1:{grpc}", stack.read_token(run_dir), model)
        _wait_serving(frontend, probe)
        yield frontend


@contextmanager
def _process(module: str, index: int, http: int, grpc: int, env: dict[str, str]) -> Iterator[None]:
    argv = [sys.executable, "-m", module, "--index", str(index), "--http-port", str(http), "--grpc-port", str(grpc)]
    proc = subprocess.Popen(argv, env=env, cwd=stack.REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _wait_serving(frontend: clients.Client, probe: bytes) -> None:
    """Until the frontend answers `probe` (every shard it needs has loaded the model)."""
    headers = {"Authorization": f"Bearer {frontend.token}"}
    deadline = time.monotonic() + READY_S
    while True:
        try:
            r = httpx.post(
                f"{frontend.url}/v1/models/{frontend.model}:predict",
                content=b'{"instances": ' + probe + b"}",
                headers=headers | {"Content-Type": "application/json"},
            )
            if r.status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"the sharded frontend did not answer within {READY_S:.0f} s")
        time.sleep(0.5)


def over_replica(sharded_: dict[str, Any], replica: dict[str, Any]) -> dict[str, Any]:
    """Per client and batch size: the frontend's p50 and p99 less the replica's (ms, the latency
    sharding adds) and its requests a second over the replica's."""
    figures = {}
    for key, mine in sharded_["latency"].items():
        theirs = replica["latency"][key]
        figures[key] = {
            "added_p50_ms": round(mine["p50_ms"] - theirs["p50_ms"], 3),
            "added_p99_ms": round(mine["p99_ms"] - theirs["p99_ms"], 3),
            "requests_per_sec": round(
                sharded_["saturation"][key]["requests_per_sec"] / replica["saturation"][key]["requests_per_sec"], 3
            ),
        }
    return figures
