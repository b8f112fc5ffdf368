"""The gRPC transport's floor: an empty `trillium.v1.Serving/Predict` call, server by server,
measured side by side in one run with the same client.

Each server runs in a process of its own and answers every call at once with an empty
`PredictResponse` (no model, no transform), so what is measured is the transport: Python's grpc
and its event loop or threads, on both ends. The servers:

- `aio`: grpc.aio with the project's interceptors (the token check, the malformed-request
  refusal), as `trillium.wire.rpc.serve` builds it for every service: what a replica runs today;
- `aio_bare`: grpc.aio without interceptors: what the two interceptors cost;
- `sync`: grpc's thread-pool server (`grpc.server`, a worker thread per core), the token checked
  in the handler.

Two clients call each server: the bench's Python one (`bench/serving.py`'s: grpc.aio, one
channel) and a Go one (`scripts/grpcload`, whose own cost a call is tens of microseconds), each an
open loop at `--rate` calls a second (latency p50/p99) and then `--clients` closed loops (calls a
second). What the Python client adds is the difference between the two.

    python bench/grpc_transport.py --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
from concurrent import futures
from typing import Any

import clients
import grpc
import numpy as np

from trillium.config import GrpcCredentials
from trillium.stack.procs import free_port
from trillium.wire import rpc
from trillium.wire.pb import serving_pb2 as pb
from trillium.wire.pb import serving_pb2_grpc as pb_grpc

TOKEN = "bench-token"
SERVERS = ("aio", "aio_bare", "sync")
EMPTY = pb.PredictResponse()


class _AioServicer(pb_grpc.ServingServicer):
    async def Predict(self, request: pb.PredictRequest, context: grpc.aio.ServicerContext) -> pb.PredictResponse:
        return EMPTY


class _SyncServicer(pb_grpc.ServingServicer):
    def Predict(self, request: pb.PredictRequest, context: grpc.ServicerContext) -> pb.PredictResponse:
        if dict(context.invocation_metadata()).get("authorization") != f"Bearer {TOKEN}":
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "a bearer token is required")
        return EMPTY


async def _serve_aio(port: int, interceptors: bool) -> None:
    if interceptors:
        server = await rpc.serve(
            "127.0.0.1",
            port,
            GrpcCredentials(token=TOKEN),
            lambda s: pb_grpc.add_ServingServicer_to_server(_AioServicer(), s),
        )
    else:
        server = grpc.aio.server(options=rpc.SERVER_OPTIONS)
        pb_grpc.add_ServingServicer_to_server(_AioServicer(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
    print("ready", flush=True)
    await server.wait_for_termination()


def _serve_sync(port: int) -> None:
    workers = len(os.sched_getaffinity(0))
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers), options=rpc.SERVER_OPTIONS)
    pb_grpc.add_ServingServicer_to_server(_SyncServicer(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    print("ready", flush=True)
    server.wait_for_termination()


def serve(kind: str, port: int) -> None:
    if kind == "sync":
        _serve_sync(port)
    else:
        asyncio.run(_serve_aio(port, interceptors=kind == "aio"))


def _ms(figures: dict[str, Any]) -> dict[str, float]:
    return {"p50_ms": figures["p50_ms"], "p99_ms": figures["p99_ms"]}


def measure(kind: str, args: argparse.Namespace) -> dict[str, Any]:
    port = free_port()
    argv = [sys.executable, __file__, "--serve", kind, "--port", str(port)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    try:
        if proc.stdout is None or proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"server {kind} did not start (exit {proc.wait()})")
        address, empty = f"127.0.0.1:{port}", [b"[]"]
        python = clients.Client(None, address, TOKEN, "m")
        paced = {"rate": args.rate, "seconds": args.seconds, "clients": 1}
        saturated = {"rate": None, "seconds": args.seconds, "clients": args.clients}
        runs = {
            "paced": asyncio.run(python.run("grpc", empty, **paced)),
            "saturated": asyncio.run(python.run("grpc", empty, **saturated)),
            "go_paced": clients.go_run(address, TOKEN, "m", empty, **paced),
            "go_saturated": clients.go_run(address, TOKEN, "m", empty, **saturated),
        }
        return {name: {"calls_per_sec": run["requests_per_sec"]} | _ms(run) for name, run in runs.items()}
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print only the JSON result on stdout")
    clients.add_load_arguments(parser)
    parser.add_argument("--rounds", type=int, default=2, help="every server this many times, interleaved")
    parser.add_argument("--serve", choices=SERVERS, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.port)
        return
    log = (lambda *a: None) if args.json else print
    runs: dict[str, list[dict[str, Any]]] = {kind: [] for kind in SERVERS}
    for r in range(args.rounds):  # interleaved: a drift in the machine's load hits every server alike
        for kind in SERVERS:
            log(f"round {r + 1}: {kind} ...")
            runs[kind].append(measure(kind, args))
    result: dict[str, Any] = {"offered_calls_per_sec": args.rate, "cores": len(os.sched_getaffinity(0))}
    for kind, rounds in runs.items():
        result[kind] = {}
        for client in ("", "go_"):
            paced, saturated = f"{client}paced", f"{client}saturated"
            result[kind] |= {
                f"{paced}_p50_ms": round(float(np.median([x[paced]["p50_ms"] for x in rounds])), 3),
                f"{paced}_p99_ms": round(float(np.median([x[paced]["p99_ms"] for x in rounds])), 3),
                f"{saturated}_calls_per_sec": round(
                    float(np.median([x[saturated]["calls_per_sec"] for x in rounds])), 1
                ),
            }
        result[kind]["rounds"] = rounds
    aio = result["aio"]
    result["over_aio"] = {
        kind: {
            "paced_p99": round(result[kind]["paced_p99_ms"] / aio["paced_p99_ms"], 3),
            "saturated_calls_per_sec": round(
                result[kind]["saturated_calls_per_sec"] / aio["saturated_calls_per_sec"], 3
            ),
        }
        for kind in SERVERS
    }
    print(json.dumps(result, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
