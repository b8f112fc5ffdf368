"""gRPC helpers: every server and channel of the project with the same limits."""

from __future__ import annotations

from collections.abc import Callable

import grpc

# A batch's embeddings or a shard's rows can be tens of MiB.
OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]


async def serve(host: str, port: int, register: Callable[[grpc.aio.Server], None]) -> grpc.aio.Server:
    """Start a server on host:port with the servicers `register` adds."""
    server = grpc.aio.server(options=OPTIONS)
    register(server)
    server.add_insecure_port(f"{host}:{port}")
    await server.start()
    return server


def channel(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=OPTIONS)
