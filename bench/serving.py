"""Serving benchmark: a trained model answering predictions, measured side by side in one run.

1. A stack (2 PS shards, 2 NN ranks, a serving replica) trains a synthetic Criteo-layout file job
   (26 slots in 2 tables of dim 64, served in fp16) to its end; its final version is the model.
2. **Latency** at a fixed offered load (open loop: `--rate` requests a second, for `--seconds`),
   p50 and p99, at batch 1 and batch 64, over REST and over gRPC; gRPC from two clients, the
   bench's Python one (`grpc`) and a Go one (`grpc_go`, `scripts/grpcload`), whose difference is
   the Python client's own cost.
3. **Saturation**: `--clients` requesters in a closed loop, batch 1 and batch 64, gRPC (both
   clients) and REST: requests and instances a second.
4. **A fair anchor: the same model as a plain torch module** (`bench/serving_anchor.py`): the
   version's dense weights and its rows in `nn.EmbeddingBag` tables (the rows the requests need),
   the same transform, in a process of its own behind the same gRPC service, answering the same
   request bodies from the same clients: its latency and saturation beside the replica's, and the
   ratios. The anchor in one sequential loop with no transport says which part is transport.
5. **Sharded serving** (`sharded`): `--serving-shards` serving shards (by default as many as
   the job's PS shards; any count serves any job) and a frontend over them, the same model, the same clients and loads: its
   latency and saturation, and the latency it adds over the one replica (target: ≤ 1 ms p50 at
   batch 1), with its predictions' largest difference from the replica's.
6. **Bytes per value** of the served tables (the replica's memory over rows × dim).
7. **Click-to-served freshness**: an online job (examples/online, a version every
   `publish.every_seconds`) on a replayed stream; a probe asks the replica for a prediction every
   20 ms. A click at event time t is served once a version whose newest trained event time is at
   least t answers a probe: freshness = that answer's time - t, over click times every 0.1 s of
   the run (a steady click stream), p50 and p99.

    python bench/serving.py --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import clients
import httpx
import numpy as np
from serving_anchor import PlainTorchModel, in_process_rate  # the script's own folder is on sys.path
from serving_sharded import over_replica, sharded

from trillium import stack
from trillium.config import GrpcCredentials, KafkaConnection, StackTopology
from trillium.data import load_job
from trillium.data.replay import replay
from trillium.data.sources.datagen import generate_criteo
from trillium.job import CRITEO_COLUMNS, JobConfig
from trillium.stack.client import CoordinatorClient
from trillium.stack.procs import free_port
from trillium.wire import rpc
from trillium.wire.pb import serving_pb2 as pb
from trillium.wire.pb import serving_pb2_grpc as pb_grpc

TOPOLOGY = StackTopology(nn_ranks=2, ps_shards=2, embedding_workers=1, data_loaders=1, serving_replicas=1)
VOCAB = 1_000_000  # IDs a slot: ~1M rows materialized over the 26 slots by 240k rows


def file_job(rows: int) -> JobConfig:
    raw = load_job(stack.REPO_ROOT / "tests/data/tiny_job.yaml").model_dump(mode="json")
    raw["name"] = "bench-serving"
    raw["data"] = {"source": "synthetic", "rows": rows, "test_rows": 2000, "seed": 3, "vocab_sizes": [VOCAB] * 26}
    raw["tables"] = {t: {"dim": 64, "optimizer": {"name": "adagrad", "lr": 0.05}} for t in ("a", "b")}
    raw["model"]["kwargs"] |= {"embedding_dims": [64] * 26, "hidden": [128, 64]}
    raw["training"] |= {"batch_size": 512, "epochs": 1, "staleness_bound": 4, "eval_batch_size": 2048}
    raw["checkpoint"] = None
    return JobConfig.model_validate(raw)


def instances(job: JobConfig, n: int) -> list[dict[str, str]]:
    """Requests' instances: rows of the job's planted data, as a CSV row of the file would be."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rows.tsv"
        generate_criteo(path, n, seed=11, vocab_sizes=[VOCAB] * 26)
        lines = path.read_text().splitlines()
    return [dict(zip(CRITEO_COLUMNS[1:], line.split("\t")[1:], strict=True)) for line in lines]


@contextmanager
def anchor(run_dir: Path, job: JobConfig, bodies: dict[int, list[bytes]]) -> Iterator[str]:
    """The anchor process (bench/serving_anchor.py) serving the job's newest version; yields its
    gRPC address."""
    work = Path(tempfile.mkdtemp(prefix="anchor-", dir=run_dir))
    job_file, bodies_file = work / "job.json", work / "bodies.json"
    job_file.write_text(job.model_dump_json())
    bodies_file.write_text(json.dumps([b.decode() for bs in bodies.values() for b in bs]))
    port = free_port()
    argv = [sys.executable, str(Path(__file__).with_name("serving_anchor.py")), "--run-dir", str(run_dir)]
    argv += ["--job", str(job_file), "--bodies", str(bodies_file), "--port", str(port)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, cwd=stack.REPO_ROOT)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        if line.strip() != "ready":
            raise RuntimeError(f"the anchor did not start (exit {proc.wait()})")
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def in_process(run_dir: Path, job: JobConfig, bodies: list[bytes], seconds: float) -> dict[str, Any]:
    """The anchor's model answering in this process, one request at a time, with no transport."""
    model = PlainTorchModel(run_dir, job, bodies)
    return {"requests_per_sec": round(in_process_rate(model, bodies, seconds), 1)}


async def predictions(client: clients.Client, bodies: list[bytes]) -> np.ndarray:
    """An endpoint's predictions for `bodies`, over gRPC, in order."""
    async with rpc.channel(client.grpc_address, GrpcCredentials(token=client.token)) as channel:
        stub = pb_grpc.ServingStub(channel)
        answers = [await stub.Predict(pb.PredictRequest(model=client.model, instances=body)) for body in bodies]
    return np.concatenate([np.asarray(a.predictions) for a in answers])


def measure(client: clients.Client, protocols: tuple[str, ...], bodies: dict[int, list[bytes]], args) -> dict[str, Any]:
    """Latency at the offered rate and saturation with `args.clients`, at batch 1 and 64; over
    `grpc_go` the same gRPC calls come from the Go client (bench/clients.py)."""
    latency, saturation = {}, {}
    for protocol in protocols:
        for b in (1, 64):
            for rate, figures in ((args.rate, latency), (None, saturation)):
                loops = 1 if rate is not None else args.clients
                if protocol == "grpc_go":
                    run = clients.go_run(
                        client.grpc_address,
                        client.token,
                        client.model,
                        bodies[b],
                        rate=rate,
                        seconds=args.seconds,
                        clients=loops,
                    )
                else:
                    run = asyncio.run(client.run(protocol, bodies[b], rate=rate, seconds=args.seconds, clients=loops))
                figures[f"{protocol}_batch{b}"] = (
                    run if rate is not None else run | {"instances_per_sec": round(run["requests_per_sec"] * b)}
                )
    return {"latency": latency, "saturation": saturation}


def over_anchor(ours: dict[str, Any], anchor_: dict[str, Any]) -> dict[str, Any]:
    """The replica's figures over the anchor's, per client and batch size: > 1 for latency is
    slower, < 1 for requests a second is fewer."""
    ratios = {}
    for key in anchor_["latency"]:
        mine, theirs = ours["latency"][key], anchor_["latency"][key]
        ratios[key] = {
            "p50": round(mine["p50_ms"] / theirs["p50_ms"], 3),
            "p99": round(mine["p99_ms"] / theirs["p99_ms"], 3),
            "requests_per_sec": round(
                ours["saturation"][key]["requests_per_sec"] / anchor_["saturation"][key]["requests_per_sec"], 3
            ),
        }
    return ratios


def freshness(run_dir: Path, conn: KafkaConnection, seconds: float, rate: float) -> dict[str, Any]:
    raw = load_job(stack.REPO_ROOT / "examples/online/job.yaml").model_dump(mode="json")
    raw["name"] = "bench-fresh"
    topic = f"bench-imps-{time.time_ns()}"
    raw["data"]["join"] |= {
        "impressions": topic,
        "labels": topic.replace("imps", "clicks"),
        "window_seconds": 5.0,
        "allowed_lateness_seconds": 0.5,
    }
    raw["checkpoint"] = None
    job = JobConfig.model_validate(raw)
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "stream.tsv"
        generate_criteo(data, int(rate * seconds) + 1000, seed=5)
        feed = threading.Thread(
            target=lambda: asyncio.run(
                replay(data, job, conn, fmt="criteo", rate=rate, limit=int(rate * seconds), seed=2)
            ),
            daemon=True,
        )
        feed.start()
        time.sleep(2)
        client = CoordinatorClient.for_stack(run_dir)
        job_id = client.submit(job)["id"]
        probe = clients.Client.of_replica(run_dir, job.name)
        answers: list[tuple[float, int]] = []  # (time answered, version)
        event_times: dict[int, float] = {}
        http = httpx.Client(base_url=probe.url, headers={"Authorization": f"Bearer {probe.token}"}, timeout=10)
        instance = {s.column: "x" for s in job.slots} | {d.column: 1.0 for d in job.dense}
        started = time.time()
        try:
            while feed.is_alive():
                r = http.post(f"/v1/models/{job.name}:predict", json={"instances": [instance]})
                if r.status_code == 200:
                    version = r.json()["version"]
                    answers.append((time.time(), version))
                    if version not in event_times:
                        event_times[version] = http.get(f"/v1/models/{job.name}").json()["event_time"]
                time.sleep(0.02)
        finally:
            client.stop(job_id)
            client.close()
            http.close()
    first = {}
    for at, version in answers:
        first.setdefault(version, at)
    served = sorted((event_times[v], at) for v, at in first.items() if event_times.get(v))
    lags = []
    for t in np.arange(started + 5, served[-1][0] if served else started, 0.1):
        at = next((at for et, at in served if et >= t), None)
        if at is not None:
            lags.append(at - t)
    return {
        "versions_served": len(first),
        "clicks_measured": len(lags),
        "click_to_served_p50_s": round(float(np.percentile(lags, 50)), 2) if lags else None,
        "click_to_served_p99_s": round(float(np.percentile(lags, 99)), 2) if lags else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print only the JSON result on stdout")
    parser.add_argument("--rows", type=int, default=240_000, help="training rows of the file job")
    clients.add_load_arguments(parser)
    parser.add_argument("--stream-seconds", type=float, default=60.0, help="the freshness run")
    parser.add_argument(
        "--serving-shards", type=int, default=TOPOLOGY.ps_shards, help="serving shards of the sharded run"
    )
    args = parser.parse_args()
    log = (lambda *a: None) if args.json else print
    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="trillium-bench-serving-") as tmp:
        run_dir = Path(tmp) / "run"
        st = stack.up(run_dir, TOPOLOGY)
        try:
            job = file_job(args.rows)
            log("training the model ...")
            client = CoordinatorClient.for_stack(run_dir)
            view = client.follow(client.submit(job)["id"], timeout_s=1800)
            assert view["job"]["state"] == "finished", view["job"]["error"]
            replica = clients.Client.of_replica(run_dir, job.name)
            http = httpx.Client(base_url=replica.url, headers={"Authorization": f"Bearer {replica.token}"}, timeout=30)
            while (model := http.get(f"/v1/models/{job.name}")).status_code != 200 or model.json()["version"] is None:
                time.sleep(0.5)
            model = model.json()
            rows = sum(t["rows"] for t in model["tables"].values())
            result["model"] = {"rows": rows, "dim": 64, "bytes": model["bytes"], "version": model["version"]}
            result["bytes_per_value"] = round(model["bytes"] / (rows * 64), 4)
            pool = instances(job, 2000)
            bodies = {
                b: [json.dumps(pool[i : i + b]).encode() for i in range(0, len(pool) - b + 1, b)] for b in (1, 64)
            }
            with anchor(run_dir, job, bodies) as anchor_address:
                log("the replica: latency and saturation ...")
                ours = measure(replica, ("grpc", "grpc_go", "rest"), bodies, args)
                plain = clients.Client(None, anchor_address, replica.token, job.name)
                answers = [asyncio.run(predictions(c, bodies[64][:20])) for c in (replica, plain)]
                log("the anchor: latency and saturation ...")
                theirs = measure(plain, ("grpc", "grpc_go"), bodies, args)
            result["offered_requests_per_sec"] = args.rate
            result |= ours
            log("the anchor in process ...")
            result["anchor"] = theirs | {
                "max_prediction_difference": float(np.max(np.abs(answers[0] - answers[1]))),
                "in_process": {f"batch{b}": in_process(run_dir, job, bodies[b], args.seconds) for b in (1, 64)},
            }
            result["serving_over_anchor"] = over_anchor(ours, theirs)
            log("sharded serving: latency and saturation ...")
            with sharded(run_dir, job.name, args.serving_shards, bodies[1][0]) as frontend:
                spread = measure(frontend, ("grpc", "grpc_go"), bodies, args)
                answers = [asyncio.run(predictions(c, bodies[64][:20])) for c in (replica, frontend)]
            result["sharded"] = spread | {
                "shards": args.serving_shards,
                "over_replica": over_replica(spread, ours),
                "max_prediction_difference": float(np.max(np.abs(answers[0] - answers[1]))),
            }
            log("freshness ...")
            conn = KafkaConnection(bootstrap=st["kafka"]["bootstrap"])
            result["freshness"] = freshness(run_dir, conn, args.stream_seconds, rate=2000.0)
            result["cores"] = len(os.sched_getaffinity(0))
        finally:
            stack.down(run_dir)
    print(json.dumps(result, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
