"""The serving benchmark's anchor: the served model as a plain torch module, in a process of its
own, behind the same gRPC service the replica answers (`trillium.v1.Serving/Predict`, the same
server options and token check, requests of a few instances on the event loop and larger ones on
a thread, as the replica does). `bench/serving.py` starts it, sends it the same request bodies
from the same clients, and reports the replica's figures over it.

What differs from the replica is what a hand-written server would leave out: the model is
`nn.EmbeddingBag` tables holding only the rows the bench's requests hold (found by a binary search
over their IDs), with no versions to follow, no metrics and no checks beyond the transform's. The
transform is the replica's own (`InstanceEncoder`): the anchor answers the same predictions.

    python bench/serving_anchor.py --run-dir RUN --job JOB.json --bodies BODIES.json --port PORT

It prints `ready` on stdout once it answers, and serves until it is terminated.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import torch

import trillium_native
from trillium.config import GrpcCredentials
from trillium.data.instances import InstanceEncoder
from trillium.job import JobConfig
from trillium.models import load_model, logits
from trillium.runtime.model_store import DENSE, ModelStore
from trillium.services.serving.server import INLINE_INSTANCES  # the replica's split, not a copy of it
from trillium.stack import read_token
from trillium.wire import rpc
from trillium.wire.pb import serving_pb2 as pb
from trillium.wire.pb import serving_pb2_grpc as pb_grpc


class PlainTorchModel:
    """The job's newest version as nn.EmbeddingBag tables and its dense module."""

    def __init__(self, run_dir: Path, job: JobConfig, bodies: list[bytes]) -> None:
        torch.set_num_threads(1)  # as the replica: a request's small ops gain nothing from a pool
        self.job = job
        store = ModelStore.of(job, run_dir)
        manifest = store.manifest(store.versions()[-1])
        self.version = manifest.version
        dims = {t: c.dim for t, c in job.tables.items()}
        tables = trillium_native.ServingTables(dims, job.topology.ps_shards, "fp16")
        with store.parts(manifest.parts).reading(DENSE) as dense:
            state = torch.load(dense, weights_only=True)["model"]
        for m in store.chain(manifest.version):
            tables.apply([(f.shard, str(Path(store.parts(m.parts).path) / f.name)) for f in m.values], m.version)
        self.encoder = InstanceEncoder(job, manifest.dense_stats)
        # Every ID the requests hold, and its row: the tables a plain module would hold.
        every = self.encoder.batch([x for body in bodies for x in json.loads(body)])
        self.bags: dict[str, dict[str, torch.nn.EmbeddingBag]] = {}
        self.index: dict[str, np.ndarray] = {}
        for table in job.tables:
            ids = np.unique(np.concatenate([every.ids.slot(s.name)[0] for s in job.slots if s.table == table]))
            (rows,), _, _ = tables.lookup([(table, ids)])
            self.index[table] = ids
            self.bags[table] = {
                mode: torch.nn.EmbeddingBag.from_pretrained(torch.from_numpy(rows), mode=mode, freeze=True)
                for mode in ("sum", "mean")
            }
        # One bag call per table and pooling over all its slots, as TorchRec's EmbeddingBagCollection
        # pools a table's features in one kernel: a call a slot would cost 26 dispatches a request.
        self.groups: dict[tuple[str, str], list[str]] = {}
        for slot in job.slots:
            if slot.pooling not in ("sum", "mean"):
                raise ValueError(f"slot {slot.name!r}: the anchor pools sum or mean, not {slot.pooling!r}")
            self.groups.setdefault((slot.table, slot.pooling), []).append(slot.name)
        self.model = load_model(job.model)
        self.model.load_state_dict(state)
        self.model.eval()

    def predict(self, instances: list[Any]) -> list[float]:
        batch = self.encoder.batch(instances)
        with torch.inference_mode():
            pooled: dict[str, torch.Tensor] = {}
            ids, b = batch.ids, len(instances)
            starts = np.concatenate([[0], np.cumsum(ids.lengths, dtype=np.int64)])  # of each (slot, sample)
            for (table, mode), names in self.groups.items():
                keys = [ids.keys.index(name) for name in names]
                values = np.concatenate([ids.values[starts[k * b] : starts[(k + 1) * b]] for k in keys])
                lengths = np.concatenate([ids.lengths[k * b : (k + 1) * b] for k in keys])
                rows = torch.from_numpy(np.searchsorted(self.index[table], values).astype(np.int64))
                offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64))
                bags = self.bags[table][mode](rows, offsets).view(len(names), b, -1)
                pooled |= {name: bags[k] for k, name in enumerate(names)}
            embeddings = [pooled[slot.name] for slot in self.job.slots]
            probs = torch.sigmoid(logits(self.model, torch.from_numpy(np.array(batch.dense)), embeddings))
        return probs.tolist()

    def answer_body(self, body: bytes) -> bytes:
        """One request in process, JSON in and JSON out: the anchor without its transport."""
        return json.dumps({"predictions": self.predict(json.loads(body))}).encode()


def in_process_rate(model: PlainTorchModel, bodies: list[bytes], seconds: float) -> float:
    """Requests a second answered in one sequential loop, no transport at all."""
    for body in bodies[:20]:
        model.answer_body(body)
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        model.answer_body(bodies[done % len(bodies)])
        done += 1
    return done / (time.perf_counter() - start)


class _Servicer(pb_grpc.ServingServicer):
    def __init__(self, model: PlainTorchModel, name: str) -> None:
        self.model, self.name = model, name

    async def Predict(self, request: pb.PredictRequest, context: grpc.aio.ServicerContext) -> pb.PredictResponse:
        instances = json.loads(request.instances)
        if len(instances) <= INLINE_INSTANCES:
            predictions = self.model.predict(instances)
        else:
            predictions = await asyncio.to_thread(self.model.predict, instances)
        return pb.PredictResponse(predictions=predictions, model=self.name, version=self.model.version)


async def serve(model: PlainTorchModel, name: str, port: int, token: str) -> None:
    creds = GrpcCredentials(token=token)
    server = await rpc.serve(
        "127.0.0.1", port, creds, lambda s: pb_grpc.add_ServingServicer_to_server(_Servicer(model, name), s)
    )
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    print("ready", flush=True)
    await stop.wait()
    await server.stop(grace=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-dir", type=Path, required=True, help="the stack's run directory (model store, token)")
    parser.add_argument("--job", type=Path, required=True, help="the job's config as JSON")
    parser.add_argument("--bodies", type=Path, required=True, help="a JSON list of the request bodies (strings)")
    parser.add_argument("--port", type=int, required=True, help="the gRPC port on 127.0.0.1")
    args = parser.parse_args()
    job = JobConfig.model_validate_json(args.job.read_text())
    bodies = [b.encode() for b in json.loads(args.bodies.read_text())]
    model = PlainTorchModel(args.run_dir, job, bodies)
    asyncio.run(serve(model, job.name, args.port, read_token(args.run_dir)))


if __name__ == "__main__":
    main()
