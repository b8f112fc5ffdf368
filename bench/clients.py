"""The serving benches' two clients (bench/serving.py, bench/grpc_transport.py): a Python one
(grpc.aio or httpx, in the bench's process: `Client`) and a Go one (scripts/grpcload, built on
first use: `go_run`), whose own cost a call is tens of microseconds, so that a figure beside the
Python client's says how much of a call's latency is the client's."""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from trillium import stack
from trillium.config import GrpcCredentials
from trillium.wire import rpc
from trillium.wire.pb import serving_pb2 as pb
from trillium.wire.pb import serving_pb2_grpc as pb_grpc

BINARY = stack.REPO_ROOT / ".cache/bin/grpcload"


class Client:
    """Requests to one Serving endpoint: a replica of the stack (`of_replica`) or the anchor."""

    def __init__(self, url: str | None, grpc_address: str, token: str, model: str) -> None:
        self.url, self.grpc_address, self.token, self.model = url, grpc_address, token, model

    @classmethod
    def of_replica(cls, run_dir: Path, model: str) -> Client:
        st = stack.read_state(run_dir)
        replica = next(p for p in st["processes"] if p["role"] == "serving")
        return cls(replica["http_url"], replica["grpc_address"], stack.read_token(run_dir), model)

    async def run(
        self, protocol: str, bodies: list[bytes], *, rate: float | None, seconds: float, clients: int
    ) -> dict[str, Any]:
        """Requests for `seconds`: open loop at `rate` a second, or `clients` closed loops."""
        latencies: list[float] = []
        headers = {"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"}
        async with httpx.AsyncClient(base_url=self.url or "http://unused", headers=headers, timeout=30) as http:
            channel = rpc.channel(self.grpc_address, GrpcCredentials(token=self.token))
            stub = pb_grpc.ServingStub(channel)

            async def one(body: bytes) -> None:
                started = time.perf_counter()
                if protocol == "rest":
                    r = await http.post(f"/v1/models/{self.model}:predict", content=b'{"instances": ' + body + b"}")
                    r.raise_for_status()
                else:
                    await stub.Predict(pb.PredictRequest(model=self.model, instances=body))
                latencies.append(time.perf_counter() - started)

            for body in bodies[:20]:  # warm both ends
                await one(body)
            latencies.clear()
            start = time.perf_counter()
            if rate is not None:
                pending = []
                for i in range(int(rate * seconds)):
                    await asyncio.sleep(max(0.0, start + i / rate - time.perf_counter()))
                    pending.append(asyncio.create_task(one(bodies[i % len(bodies)])))
                await asyncio.gather(*pending)
            else:

                async def loop(k: int) -> None:
                    i = k
                    while time.perf_counter() - start < seconds:
                        await one(bodies[i % len(bodies)])
                        i += clients

                await asyncio.gather(*(loop(k) for k in range(clients)))
            elapsed = time.perf_counter() - start
            await channel.close()
        ms = np.asarray(latencies) * 1000
        return {
            "requests": len(ms),
            "requests_per_sec": round(len(ms) / elapsed, 1),
            "p50_ms": round(float(np.percentile(ms, 50)), 3),
            "p99_ms": round(float(np.percentile(ms, 99)), 3),
        }


def add_load_arguments(parser: argparse.ArgumentParser) -> None:
    """The load options the serving benches share: `--rate`, `--seconds`, `--clients`."""
    parser.add_argument("--rate", type=float, default=50.0, help="offered requests a second (latency)")
    parser.add_argument("--seconds", type=float, default=15.0, help="each latency and saturation run")
    parser.add_argument("--clients", type=int, default=8, help="closed-loop requesters (saturation)")


def build() -> Path:
    """The tool, built by `make` when missing or older than its sources."""
    subprocess.run(["make", "-s", str(BINARY.relative_to(stack.REPO_ROOT))], cwd=stack.REPO_ROOT, check=True)
    return BINARY


def go_run(
    address: str,
    token: str,
    model: str,
    bodies: list[bytes],
    *,
    rate: float | None,
    seconds: float,
    clients: int,
) -> dict[str, Any]:
    """Calls for `seconds`: an open loop at `rate` a second, or `clients` closed loops; the
    figures as `bench/serving.py`'s Python client reports them. A failed call fails the run."""
    with tempfile.TemporaryDirectory(prefix="grpcload-") as tmp:
        token_file, bodies_file = Path(tmp) / "token", Path(tmp) / "bodies.json"
        token_file.write_text(token)
        bodies_file.write_text(json.dumps([b.decode() for b in bodies]))
        argv = [str(build()), "-addr", address, "-token-file", str(token_file), "-model", model]
        argv += ["-bodies", str(bodies_file), "-seconds", str(seconds)]
        argv += ["-rate", str(rate)] if rate is not None else ["-clients", str(clients)]
        out = json.loads(subprocess.run(argv, check=True, capture_output=True, text=True).stdout)
    if out["errors"]:
        raise RuntimeError(f"grpcload: {out['errors']} calls failed, the first: {out['first_error']}")
    return {
        k: round(out[k], 3) if isinstance(out[k], float) else out[k]
        for k in ("requests", "requests_per_sec", "p50_ms", "p99_ms")
    }
