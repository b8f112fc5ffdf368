"""A PS shard's native gRPC server (`trillium_native.ShardServer`) on loopback over a store a test
made, with the stack's limits: `shard_server(store, token, job)` yields it, serving `job` (its id
and attempt), and stops it."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import trillium_native
from trillium.wire import rpc


def _failed(error: str) -> None:
    raise AssertionError(f"the shard failed: {error}")


@contextlib.contextmanager
def shard_server(
    store: trillium_native.EmbeddingStore,
    token: str,
    job: tuple[str, int],
    *,
    shard: int = 0,
    on_failure: Callable[[str], object] = _failed,
    tls: tuple[bytes, bytes] | None = None,
) -> Iterator[trillium_native.ShardServer]:
    """`tls`: its certificate and key (PEM), to serve over TLS."""
    server = trillium_native.ShardServer(
        "127.0.0.1",
        0,
        token,
        name=f"embedding_ps-{shard}",
        shard=shard,
        on_failure=on_failure,
        **(rpc.native_server_options() | ({"tls_cert": tls[0], "tls_key": tls[1]} if tls else {})),
    )
    server.serve(store, job_id=job[0], attempt=job[1])
    try:
        yield server
    finally:
        server.stop()
