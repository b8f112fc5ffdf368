"""Checkpoint benchmark: a 10M-row x dim-64 embedding table on 2 PS shards.

One run on one local stack (2 NN ranks, 2 PS shards) measures, side by side:

- seconds to write a checkpoint of the live job (cut to manifest; each PS shard's snapshot
  write; how long the NN ranks held for the cut) and bytes on disk per embedding value, for the
  full checkpoint (the job's first: `checkpoint.full_every` is 10) and for the deltas after it
  (only the rows trained since the checkpoint before);
- seconds to restore it: both PS snapshots loaded into native stores, and a whole recovery
  (a PS shard SIGKILLed: from `recovering` to `running` again);
- training throughput with a checkpoint every 30 s divided by throughput without (target
  >= 0.95): two warm-started jobs training the same stream for the same number of samples.

The table is seeded once: 10M rows created in native stores (split by `shard_of`, as the PS
shards own them) and written as a checkpoint of a seed job, which both jobs `init_from`. The jobs
train the synthetic data set's IDs on top of those rows, which they never touch: the cold tail of
a real table, written by a full checkpoint and by no delta.

    python bench/checkpoint.py --json
    python bench/checkpoint.py --rows 1000000 --samples 600000 --every-seconds 5    # a quicker run
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from jobs import criteo_layout_job  # bench/jobs.py: the script's own folder is on sys.path

import trillium_native
from trillium import stack
from trillium.config import StackTopology
from trillium.job import JobConfig
from trillium.job.trust import ENV_ALLOWED_PATHS
from trillium.models import build_dense_optimizer, build_model
from trillium.runtime.checkpoint import DENSE, JobCheckpoints, Manifest, PartFile, ps_file
from trillium.stack.client import CoordinatorClient

TOPOLOGY = StackTopology(nn_ranks=2, ps_shards=2, embedding_workers=1)
SLOTS = 8  # feature slots sharing the one big table


def job_config(name: str, samples: int, dim: int, **extra: Any) -> JobConfig:
    data = {"source": "synthetic", "rows": samples, "test_rows": 20_000, "seed": 5}
    items = {"dim": dim, "optimizer": {"name": "rowwise_adagrad", "lr": 0.05}}
    return criteo_layout_job(name, data, {"items": items}, ["items"] * SLOTS, dim, TOPOLOGY, **extra)


def seed_checkpoint(base: Path, config: JobConfig, rows: int) -> tuple[Manifest, float]:
    """Write a checkpoint of `config` whose table holds `rows` rows; returns it and the seconds
    both snapshots took to write."""
    store_dir = JobCheckpoints(str(base), "seed").dir(0)
    files = []
    ids = np.arange(1, rows + 1, dtype=np.uint64)
    owner = trillium_native.shard_of(ids, TOPOLOGY.ps_shards)
    write_s = 0.0
    table = config.tables["items"]
    for shard in range(TOPOLOGY.ps_shards):
        store = trillium_native.EmbeddingStore()
        store.create_table("items", **table.store_kwargs(config.training.seed))
        mine = ids[owner == shard]
        for start in range(0, len(mine), 1 << 20):
            store.lookup("items", mine[start : start + (1 << 20)])
        started = time.perf_counter()
        with store_dir.writing(ps_file(shard)) as path:
            size, sha = store.dump(path)
        write_s += time.perf_counter() - started
        files.append(
            PartFile(
                name=ps_file(shard),
                role="embedding_ps",
                index=shard,
                bytes=size,
                sha256=sha,
                seconds=time.perf_counter() - started,
            )
        )
        del store
    model = build_model(config)
    optimizer = build_dense_optimizer(config.training.dense_optimizer, model.parameters())
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    size, sha = store_dir.write_bytes(DENSE, buffer.getvalue())
    files.append(PartFile(name=DENSE, role="nn_worker", index=0, bytes=size, sha256=sha, seconds=0.0))
    manifest = Manifest(
        job_id="seed",
        attempt=0,
        step=0,
        epoch=0,
        reason="final",
        created_at=time.time(),
        pause_seconds=0.0,
        seconds_to_write=write_s,
        config=config,
        positions={},
        written={},
        lineage={},
        files=files,
    )
    store_dir.write_manifest(manifest)
    return manifest, write_s


def restore_seconds(manifest: Manifest, base: Path) -> float:
    """Both PS shards' snapshots loaded into native stores, as a recovery does."""
    store_dir = JobCheckpoints(str(base), manifest.job_id).dir(manifest.step)
    started = time.perf_counter()
    for shard in range(TOPOLOGY.ps_shards):
        store = trillium_native.EmbeddingStore()
        with store_dir.reading(ps_file(shard)) as path:
            store.load(path)
        del store
    return time.perf_counter() - started


def train(run_dir: Path, config: JobConfig, kill_ps_after_checkpoint: bool = False) -> dict[str, Any]:
    client = CoordinatorClient.for_stack(run_dir)
    try:
        job_id = client.submit(config)["id"]
        recovery_s = None
        if kill_ps_after_checkpoint:
            while client.job(job_id)["last_checkpoint"] is None:
                time.sleep(0.2)
            pid = next(p["pid"] for p in stack.read_state(run_dir)["processes"] if p["name"] == "embedding_ps-1")
            os.kill(pid, signal.SIGKILL)
            while (state := client.job(job_id)["job"]["state"]) != "recovering":
                if state in ("finished", "failed"):  # it ended before the kill landed: nothing to time
                    raise RuntimeError(f"job {job_id} {state} before its PS shard was killed: raise --samples")
                time.sleep(0.05)
            started = time.monotonic()
            while client.job(job_id)["job"]["state"] == "recovering":
                time.sleep(0.05)
            recovery_s = time.monotonic() - started
        view = client.follow(job_id, timeout_s=7200)
        checkpoints = client.checkpoints(job_id)
    finally:
        client.close()
    if view["job"]["state"] != "finished":
        raise RuntimeError(f"job {job_id} {view['job']['state']}: {view['job']['error']}")
    results = view["results"].values()
    samples = sum(r["samples"] for r in results)
    seconds = max(r["train_seconds"] for r in results)
    return {
        "job_id": job_id,
        "samples": samples,
        "train_seconds": seconds,
        "samples_per_sec": samples / seconds,
        "auc": view["job"]["metrics"]["auc"],
        "checkpoints": checkpoints,
        "recovery_seconds": recovery_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print only the JSON result on stdout")
    parser.add_argument("--rows", type=int, default=10_000_000, help="rows of the seeded table")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument(
        "--samples",
        type=int,
        default=6_000_000,
        help="samples each training job trains: enough for several --every-seconds",
    )
    parser.add_argument("--every-seconds", type=float, default=30.0)
    args = parser.parse_args()
    tmp = tempfile.mkdtemp(prefix="trillium-bench-ckpt-")  # kept when the run fails: its stack's logs say why
    print(f"working in {tmp}", file=sys.stderr)
    base = Path(tmp) / "checkpoints"
    seed = job_config("seed", args.samples, args.dim)
    print(f"seeding a {args.rows:,}-row table", file=sys.stderr)
    manifest, seed_write_s = seed_checkpoint(base, seed, args.rows)
    restore_s = restore_seconds(manifest, base)
    warm = {"job": "seed", "step": 0, "dir": str(base)}
    without = job_config("without-checkpoints", args.samples, args.dim, init_from=warm, checkpoint=None)
    with_ckpt = job_config(
        "with-checkpoints",
        args.samples,
        args.dim,
        init_from=warm,
        checkpoint={"every_seconds": args.every_seconds, "keep_last": 10, "dir": str(base)},
    )  # all: counted
    recovered = job_config(
        "recovered",
        args.samples,
        args.dim,
        init_from=warm,
        checkpoint={"every_seconds": 10.0, "keep_last": 1, "dir": str(base)},
    )
    run_dir = Path(tmp) / "stack"
    os.environ.setdefault(ENV_ALLOWED_PATHS, tmp)  # its checkpoints live beside the stack, not in it
    stack.up(run_dir, TOPOLOGY)
    try:
        print("training without checkpoints", file=sys.stderr)
        plain = train(run_dir, without)
        print(f"training with a checkpoint every {args.every_seconds:.0f} s", file=sys.stderr)
        durable = train(run_dir, with_ckpt)
        print("a recovery", file=sys.stderr)
        recovery = train(run_dir, recovered, kill_ps_after_checkpoint=True)
    finally:
        stack.down(run_dir)
    shutil.rmtree(tmp)  # a failure above leaves it (and its path was said)
    taken = [c for c in durable["checkpoints"] if c["reason"] != "final"]
    if len(taken) < 3:  # the ratio would measure (almost) no checkpoint
        raise SystemExit(
            f"{len(taken)} scheduled checkpoints in {durable['train_seconds']:.0f} s of training: raise --samples"
        )

    def ps_files(c: dict[str, Any]) -> list[dict[str, Any]]:
        return [f for f in c["files"] if f["role"] == "embedding_ps"]

    full = [c for c in taken if all(f["delta_of"] is None for f in ps_files(c))]
    deltas = [c for c in taken if c not in full]
    if not full:
        raise SystemExit("no full checkpoint among those taken: the job's first should be one")
    rows_in_table = args.rows  # the training adds some; bytes per value counts the seeded ones

    def summary(cs: list[dict[str, Any]]) -> dict[str, Any] | None:
        if not cs:
            return None
        return {
            "count": len(cs),
            "seconds_to_write": round(float(np.mean([c["seconds_to_write"] for c in cs])), 3),
            "ps_snapshot_write_seconds": round(float(np.mean([f["seconds"] for c in cs for f in ps_files(c)])), 3),
            "pause_seconds": round(float(np.mean([c["pause_seconds"] for c in cs])), 3),
            "ps_bytes": int(np.mean([sum(f["bytes"] for f in ps_files(c)) for c in cs])),
        }

    result = {
        "rows": args.rows,
        "dim": args.dim,
        "ps_shards": TOPOLOGY.ps_shards,
        "machine_cores": os.cpu_count(),
        "seed_snapshots_write_seconds": round(seed_write_s, 3),
        "checkpoints_taken": len(taken),  # on the schedule, while training
        "full_checkpoints": summary(full),
        "delta_checkpoints": summary(deltas),
        "seconds_to_restore_ps_snapshots": round(restore_s, 3),
        "recovery_seconds": round(recovery["recovery_seconds"], 3),
        "bytes_on_disk_per_value": round(summary(full)["ps_bytes"] / (rows_in_table * args.dim), 3),
        "samples_per_sec_without_checkpoints": round(plain["samples_per_sec"], 1),
        "samples_per_sec_with_checkpoints": round(durable["samples_per_sec"], 1),
        "throughput_with_vs_without_checkpoints": round(durable["samples_per_sec"] / plain["samples_per_sec"], 4),
        "auc_with_vs_without": [round(durable["auc"], 4), round(plain["auc"], 4)],
    }
    result["targets"] = {
        "throughput_with_vs_without_checkpoints >= 0.95": result["throughput_with_vs_without_checkpoints"] >= 0.95
    }
    print(json.dumps(result, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
