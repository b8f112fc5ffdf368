"""A real gRPC server of one servicer, on loopback, on an event loop of its own in a daemon thread
(the fuzz tests call it from plain threads): `serve_in_thread(register, token)` returns its port
once it listens, `channel_to(register, token)` a channel to it. The server goes with the test process: a stop scheduled onto its loop from another
thread never completed."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator

import grpc

from trillium.config import GrpcCredentials
from trillium.stack.procs import free_port
from trillium.wire import rpc


def serve_in_thread(register: Callable[[grpc.aio.Server], None], token: str) -> int:
    port, ready = free_port(), threading.Event()
    loop = asyncio.new_event_loop()

    async def run() -> None:
        server = await rpc.serve("127.0.0.1", port, GrpcCredentials(token=token), register)
        ready.set()
        await server.wait_for_termination()

    threading.Thread(target=loop.run_until_complete, args=(run(),), daemon=True).start()
    assert ready.wait(30), "the gRPC server did not start"
    return port


@contextlib.contextmanager
def channel_to(register: Callable[[grpc.aio.Server], None], token: str) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(f"127.0.0.1:{serve_in_thread(register, token)}") as channel:
        yield channel
