"""An embedding worker's native plane (`trillium_native.WorkerServer`) on loopback, serving the tiny
job over real PS shards (native stores behind their native servers) with the stack's limits:
`worker_plane(record, shards)` yields it serving, with every complete step's gradient messages
recorded (and, unless told otherwise, durable at once), and stops it."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import trillium_native
from trillium import pooling
from trillium.config import GRPC_MAX_MESSAGE_BYTES
from trillium.job.record import JobRecord
from trillium.timeouts import GRPC_KEEPALIVE_S, GRPC_KEEPALIVE_TIMEOUT_S
from trillium.wire import rpc

TOKEN = "the-stack-token-0123456789"
METADATA = (("authorization", f"Bearer {TOKEN}"),)


@dataclass
class Plane:
    server: trillium_native.WorkerServer
    durable: bool  # steps answered as sent as soon as they come
    steps: list[tuple[int, int, int, bool, int, list[bytes]]] = field(default_factory=list)
    arrived: threading.Condition = field(default_factory=threading.Condition)

    def on_step(self, *step) -> None:  # from the plane's thread
        with self.arrived:
            self.steps.append(step)
            self.arrived.notify_all()
        if self.durable:
            attempt, number, *_, frames = step
            self.server.step_sent(attempt, number, len(frames))

    def wait_steps(self, n: int, timeout_s: float = 20.0) -> list:
        with self.arrived:
            assert self.arrived.wait_for(lambda: len(self.steps) >= n, timeout_s), f"{len(self.steps)} steps, not {n}"
            return list(self.steps)


def tiny_shards(seed: int = 7) -> list[trillium_native.EmbeddingStore]:
    """The tiny job's tables on each of its two PS shards."""
    from tiny_record import tiny_record

    stores = []
    for _ in range(2):
        store = trillium_native.EmbeddingStore(threads=1)
        for name, table in tiny_record().config.tables.items():
            store.create_table(name, table.dim, seed=seed)
        stores.append(store)
    return stores


@contextlib.contextmanager
def shard_servers(
    stores: list[trillium_native.EmbeddingStore], record: JobRecord, tls: tuple[bytes, bytes] | None = None
) -> Iterator[list[int]]:
    """A native PS server for each store, serving `record`'s attempt (over TLS with `tls`, a
    certificate and key): their ports."""
    from shard_server import shard_server

    job = (record.id, record.attempt)
    with contextlib.ExitStack() as servers:
        yield [servers.enter_context(shard_server(s, TOKEN, job, shard=i, tls=tls)).port for i, s in enumerate(stores)]


def start_job(
    server: trillium_native.WorkerServer,
    record: JobRecord,
    ports: list[int],
    *,
    ranks: list[int] | None = None,
    gate: tuple[int, int | None] | None = (0, None),
    ps_tls_ca: bytes | None = None,
) -> None:
    """Serve `record` over the shards at `ports` (over TLS by `ps_tls_ca`, their certificates'
    CA); `gate`: (steps applied, bound) told at once (None: not yet)."""
    config, topology = record.config, record.config.topology
    server.start_job(
        job_id=record.id,
        attempt=record.attempt,
        nn_ranks=topology.nn_ranks,
        ranks=list(range(topology.nn_ranks)) if ranks is None else ranks,
        layout=pooling.Layout(config.slots, config.tables, topology.ps_shards).native,
        shards=[f"127.0.0.1:{port}" for port in ports],
        served_fp16=config.publish is not None and config.publish.dtype == "fp16",
        gradients_fp16=config.training.wire_dtype == "fp16",
        forgotten=[(m.through_batch, dict(m.tables)) for m in record.forgotten],
        ps_token=TOKEN,
        ps_tls_ca=ps_tls_ca,
        max_message_bytes=GRPC_MAX_MESSAGE_BYTES,
        keepalive_s=GRPC_KEEPALIVE_S,
        keepalive_timeout_s=GRPC_KEEPALIVE_TIMEOUT_S,
    )
    if gate is not None:
        server.set_watermark(record.attempt, gate[0], gate[1], True)


@contextlib.contextmanager
def worker_plane(
    record: JobRecord | None = None,
    ports: list[int] | None = None,
    *,
    durable: bool = True,
    tls: tuple[bytes, bytes] | None = None,
    **job,
) -> Iterator[Plane]:
    """The plane, serving `record` over the shards at `ports` when given (else no job yet); over
    TLS with `tls`, its certificate and key."""
    holder: list[Plane] = []
    server = trillium_native.WorkerServer(
        "127.0.0.1",
        0,
        TOKEN,
        name="embedding_worker-0",
        on_step=lambda *step: holder[0].on_step(*step),
        **(rpc.native_server_options() | ({"tls_cert": tls[0], "tls_key": tls[1]} if tls else {})),
    )
    plane = Plane(server, durable)
    holder.append(plane)
    try:
        if record is not None:
            start_job(server, record, ports or [], **job)
        yield plane
    finally:
        server.stop()
