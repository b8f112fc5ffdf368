"""Serving as the end-to-end tests see it (test_serving.py, test_multitask.py, test_forget.py,
test_sharded_serving.py, test_sharded_multitask.py): the stack's serving replica over REST and
gRPC, the job's own evaluation of a version that its answers are held to, and the rows of a
delimited file as a client sends them."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import numpy as np
from waiting import wait_until

from trillium import stack
from trillium.config import GrpcCredentials
from trillium.job import JobConfig
from trillium.runtime.model_store import EVAL, ModelStore, VersionManifest
from trillium.wire import rpc
from trillium.wire.pb import serving_pb2 as pb
from trillium.wire.pb import serving_pb2_grpc as pb_grpc

SKEW = 1e-5  # serving's predictions against the job's evaluation of the same version


class Replica:
    """The stack's serving replica, over REST with the stack's token."""

    def __init__(self, run_dir: Path) -> None:
        st = stack.read_state(run_dir)
        self.url = next(p["http_url"] for p in st["processes"] if p["role"] == "serving")
        self.http = httpx.Client(
            base_url=self.url, timeout=60.0, headers={"Authorization": f"Bearer {stack.read_token(run_dir)}"}
        )

    def view(self, model: str) -> dict:
        r = self.http.get(f"/v1/models/{model}")
        return r.json() if r.status_code == 200 else {"version": None}

    def ready(self) -> bool:
        try:
            return self.http.get("/readyz").status_code == 200
        except httpx.HTTPError:
            return False

    def wait_for_any(self, model: str, timeout_s: float) -> int:
        return wait_until(lambda: self.view(model)["version"], f"a version of {model}", timeout_s)

    def wait_for_newer(self, model: str, version: int, timeout_s: float) -> int:
        """Until the replica serves `version` or a newer one; returns the one it serves."""
        return wait_until(
            lambda: (v := self.view(model)["version"]) is not None and v >= version and v,
            f"version {version} of {model}",
            timeout_s,
        )

    def wait_for(self, model: str, version: int, timeout_s: float = 60.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while (view := self.view(model))["version"] != version:
            assert time.monotonic() < deadline, f"the replica serves {view} of {model}, not version {version}"
            time.sleep(0.2)
        return view

    def predict(self, model: str, instances: list[dict], batch: int = 500) -> tuple[np.ndarray, set[int]]:
        """Predictions of every instance, in chunks; and the versions that answered."""
        out, versions = [], set()
        for start in range(0, len(instances), batch):
            r = self.http.post(f"/v1/models/{model}:predict", json={"instances": instances[start : start + batch]})
            assert r.status_code == 200, r.text
            out += r.json()["predictions"]
            versions.add(r.json()["version"])
        return np.asarray(out, np.float32), versions


async def grpc_predictions(address: str, credentials: GrpcCredentials, model: str, instances: list[dict]):
    """The serving frontend's gRPC answer at `address` to one Predict of `instances`."""
    async with rpc.channel(address, credentials) as channel:
        stub = pb_grpc.ServingStub(channel)
        return await stub.Predict(pb.PredictRequest(model=model, instances=json.dumps(instances).encode()))


def newest_version(run_dir: Path, job: JobConfig) -> VersionManifest:
    """The manifest of the newest version of the job's model in the stack's model store."""
    store = ModelStore.of(job, run_dir)
    assert store is not None
    return store.manifest(store.versions()[-1])


def evaluation(store: ModelStore, manifest: VersionManifest) -> np.ndarray:
    """The job's own evaluation of the version `manifest` names: its scores of the test split."""
    with store.parts(manifest.parts).reading(EVAL) as path:
        return np.load(path)


def stack_evaluation(run_dir: Path, job: JobConfig, manifest: VersionManifest) -> np.ndarray:
    """`evaluation` of a version in the job's model store on the stack at `run_dir`."""
    return evaluation(ModelStore.of(job, run_dir), manifest)


def delimited_rows(path: Path, columns: tuple[str, ...], delimiter: str, strip: bool = False) -> list[dict]:
    """The lines of `path` with every column, as instances by column name (cells stripped if `strip`)."""
    rows = []
    for line in path.read_text().splitlines():
        cells = [c.strip() if strip else c for c in line.split(delimiter)]
        if len(cells) == len(columns):
            rows.append(dict(zip(columns, cells, strict=True)))
    return rows
