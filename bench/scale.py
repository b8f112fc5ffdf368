"""Whole-stack scale run: a synthetic Criteo-layout job trained by the full local stack (2 PS
shards, 1 NN rank, 1 embedding worker, no serving replica) until its tables hold a target number
of materialized parameters, once with the disk tier and once all in RAM, and the same job at
1/100 of the size.

    python bench/scale.py --json                            # 1.3e8 parameters (a few minutes)
    python bench/scale.py --json --params 4.25e10 --ram-params 2.05e10 --dim 512 \
        --rows-per-id 1 --hot 0.05                          # 2.1e10 on disk, 1.0e10 in RAM (65 min)

The job: 26 slots, a table each, `--dim` (64) values a row in fp16 with row-wise Adagrad, the
fp16 wire, no checkpoints and no model versions (at these sizes a full checkpoint's second copy
of an all-in-RAM table does not fit, and each version would copy the rows a growing table
changed: all of them). Each slot's vocabulary is params / (26 × dim) IDs drawn by a power law of
exponent `--zipf` (0.5: the tail is reached, as a scale run needs, and popular IDs still repeat);
one epoch of `--rows-per-id` (2.5) × the vocabulary's rows materializes about 78% of it (49% at
1 row an ID; what the run reports is what the PS shards hold, not the target). The disk-tier run
keeps `--hot` (10%) of each shard's target rows in RAM (`tables.X.memory_budget_gb`) and spills
the rest under `--spill`. The small run and the disk-tier run share a stack; the all-in-RAM run
has one of its own.

Reported, per run: parameters materialized, the samples/s while the tables held 10%, 50% and
100% of what the run ended with (±5% of it), every PS shard's anonymous RSS (the spill files it
maps are page cache) and spill bytes, the looked-up IDs read from RAM and from disk, the most
the broker's data and the least the machine's available memory were, the run's wall time, and
the test AUC against the job at 1/100 of the disk-tier run's size (same model and rows per ID, so
it must not be worse). Keys the issue names: `max_params_ram`, `max_params_disk`,
`disk_vs_ram_samples_per_sec` (the disk run's samples/s at 10% of its size over the RAM run's).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from jobs import criteo_layout_job  # bench/jobs.py: the script's own folder is on sys.path

from trillium import stack
from trillium.config import GRPC_MAX_MESSAGE_BYTES, StackTopology
from trillium.job import JobConfig
from trillium.stack.broker import ENV_KAFKA_HEAP
from trillium.stack.client import CoordinatorClient

# One NN rank and no serving replica: at 10 B parameters in RAM the tables take all but about
# 3 GB of this 24 GB machine, and a second rank (0.8 GB) or a replica (0.6 GB) would not fit.
TOPOLOGY = StackTopology(nn_ranks=1, ps_shards=2, embedding_workers=1, serving_replicas=0)
# The broker's heap, pre-touched at start, is the stack's largest fixed cost after the NN rank:
# the default 768m mostly sits unused (swap took 626 MB of it in a run that needed swap), and
# its page cache, not its heap, holds the gradients it serves.
BROKER_HEAP = "384m"
SLOTS = 26


def ram_row_bytes(dim: int) -> int:
    """RAM of a resident fp16 row with row-wise Adagrad and a tier's LRU tick (native
    Layout::ram_row_bytes: id 8, weights, version 4, accumulator 4, tick 4, index 8)."""
    return 8 + -(-dim * 2 // 8) * 8 + 4 + 4 + 4 + 8


def scale_job(
    params: float, dim: int, zipf: float, rows_per_id: float, tier: dict[str, Any] | None, seed: int
) -> JobConfig:
    vocab = max(int(params / (SLOTS * dim)), 10)
    rows = int(vocab * rows_per_id)
    data = {
        "source": "synthetic",
        "rows": rows,
        "test_rows": max(rows // 10, 2000),
        "seed": seed,
        "vocab_sizes": [vocab] * SLOTS,
        "zipf_exponent": zipf,
    }
    table = {"dim": dim, "dtype": "fp16", "optimizer": {"name": "rowwise_adagrad", "lr": 0.05}, **(tier or {})}
    names = [f"c{i}" for i in range(1, SLOTS + 1)]
    tables = dict.fromkeys(names, table)
    # The evaluation's batches (fp32 embeddings) as large as a gRPC message allows, up to the usual 4,096.
    training = {"wire_dtype": "fp16", "eval_batch_size": min(4096, GRPC_MAX_MESSAGE_BYTES // (SLOTS * dim * 4))}
    # No checkpoints (a full one copies an all-in-RAM table: a second one would not fit) and no
    # model versions (each copies the rows changed since the last: in a growing table, all of
    # them). Without checkpoints the PS shards delete the gradients they applied.
    return criteo_layout_job("scale", data, tables, names, dim, TOPOLOGY, training, checkpoint=None, publish=None)


def _rss(run_dir: Path) -> dict[str, int]:
    """Each PS shard's anonymous RSS: its own memory, not the pages of the spill files it maps
    (page cache, given back under memory pressure)."""
    out = {}
    for proc in stack.read_state(run_dir)["processes"]:
        if proc["role"] == "embedding_ps" and proc.get("pid"):
            for line in Path(f"/proc/{proc['pid']}/status").read_text().splitlines():
                if line.startswith("RssAnon:"):
                    out[proc["name"]] = int(line.split()[1]) * 1024
    return out


def _du(path: Path) -> int:
    total = 0
    for f in path.rglob("*"):
        with contextlib.suppress(FileNotFoundError):  # a segment the broker deleted meanwhile
            total += f.stat().st_size if f.is_file() else 0
    return total


def _rate_at(points: list[tuple[float, int, int]], params: int, final: int) -> float | None:
    """Samples/s while the tables grew from `params` less 5% of `final` to `params` plus 5% of it
    (clipped to what they ended with): the speed at that size, start-up and the end's slow growth
    left out."""
    lo, hi = max(params - final // 20, 0), min(params + final // 20, final)
    inside = [p for p in points if lo <= p[2] <= hi]
    if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
        return None
    return (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])


@contextlib.contextmanager
def _stack(tmp: str, name: str) -> Iterator[Path]:
    run_dir = Path(tmp) / name
    stack.up(run_dir, TOPOLOGY)
    try:
        yield run_dir
    except BaseException:
        # The run took long and its directory goes with the bench's: keep the logs that say why.
        kept = Path(tempfile.gettempdir()) / f"trillium-scale-logs-{int(time.time())}"
        shutil.copytree(run_dir / "logs", kept, dirs_exist_ok=True)
        print(f"[scale] the stack's logs: {kept}", file=sys.stderr)
        raise
    finally:
        stack.down(run_dir)
        shutil.rmtree(run_dir, ignore_errors=True)


def _mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable")


def run(run_dir: Path, job: JobConfig) -> dict[str, Any]:
    """Train `job` to its end, reading the job view and its tables twice a second."""
    dim = next(iter(job.tables.values())).dim
    client = CoordinatorClient.for_stack(run_dir)
    points: list[tuple[float, int, int]] = []  # (seconds, samples trained, parameters held)
    last_tables: dict[str, Any] = {}
    rss_max: dict[str, int] = {}
    mem_available_min, broker_max = _mem_available(), 0
    started = time.monotonic()
    try:
        job_id = client.submit(job)["id"]
        while True:
            view = client.job(job_id)
            if view["job"]["state"] in ("finished", "failed", "cancelled"):
                break
            if view["job"]["state"] == "running":
                try:
                    last_tables = client.tables(job_id)
                except Exception:  # noqa: BLE001 (a shard still setting up: the next read will do)
                    pass
                else:
                    held = sum(t["rows"] for t in last_tables["tables"].values()) * dim
                    points.append((time.monotonic() - started, view["progress"]["samples"], held))
                for name, rss in _rss(run_dir).items():
                    rss_max[name] = max(rss_max.get(name, 0), rss)
                mem_available_min = min(mem_available_min, _mem_available())
                broker_max = max(broker_max, _du(run_dir / "kafka"))
            time.sleep(0.5)
        if view["job"]["state"] != "finished":
            raise RuntimeError(f"the {job.name} job {view['job']['state']}: {view['job']['error']}")
        # After training: evaluation reads the tables without changing them.
        tables = last_tables["tables"]
    finally:
        client.close()
    params = sum(t["rows"] for t in tables.values()) * dim
    lookups = sum(t["lookups"] for t in tables.values())
    from_disk = sum(t["disk_lookup_hits"] for t in tables.values())
    return {
        "params_materialized": params,
        "samples_trained": view["progress"]["samples"],
        "seconds": round(time.monotonic() - started, 1),
        "samples_per_sec_at": {
            f"{int(f * 100)}%": round(r) if (r := _rate_at(points, int(f * params), params)) is not None else None
            for f in (0.1, 0.5, 1.0)
        },
        "auc": view["job"]["metrics"].get("auc"),
        "ps_rss_anon_bytes_max": rss_max,
        "machine_mem_available_min_bytes": mem_available_min,
        "broker_data_bytes_max": broker_max,
        "ps_shards": [
            {
                "shard": s["shard"],
                "rows": sum(t["rows"] for t in s["tables"].values()),
                "resident_rows": sum(t["resident_rows"] for t in s["tables"].values()),
                "memory_bytes": sum(t["memory_bytes"] for t in s["tables"].values()),
                "disk_bytes": sum(t["disk_bytes"] for t in s["tables"].values()),
            }
            for s in last_tables["shards"]
        ],
        "lookups": lookups,
        "lookups_from_ram": lookups - from_disk,
        "lookups_from_disk": from_disk,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print only the JSON result on stdout")
    parser.add_argument("--params", type=float, default=1.3e8, help="target parameters of each run [1.3e8]")
    parser.add_argument("--ram-params", type=float, default=None, help="target of the all-in-RAM run [--params]")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--zipf", type=float, default=0.5, help="ID popularity exponent (0: uniform) [0.5]")
    parser.add_argument("--rows-per-id", type=float, default=2.5, help="train rows per ID of a slot's vocabulary [2.5]")
    parser.add_argument("--hot", type=float, default=0.1, help="share of a shard's rows the RAM budget holds [0.1]")
    parser.add_argument("--spill", type=Path, default=None, help="the disk tier's directory [a temporary one]")
    parser.add_argument(
        "--runs",
        default="disk,ram",
        help="the large runs to make, of disk and ram; the small one is always made [disk,ram]",
    )
    args = parser.parse_args()
    runs = set(args.runs.split(","))
    if not runs <= {"disk", "ram"}:
        parser.error(f"--runs: {args.runs!r} names a run other than disk and ram")
    rows_per_shard_table = args.params / (args.dim * SLOTS * TOPOLOGY.ps_shards)
    budget_gb = args.hot * rows_per_shard_table * ram_row_bytes(args.dim) / (1 << 30)
    ram_params = args.ram_params or args.params
    os.environ.setdefault(ENV_KAFKA_HEAP, BROKER_HEAP)  # read by each stack's launcher
    with tempfile.TemporaryDirectory(prefix="trillium-scale-") as tmp:
        spill = args.spill or Path(tmp) / "spill"
        tier = {"memory_budget_gb": budget_gb, "disk": str(spill)}
        shape = (args.dim, args.zipf, args.rows_per_id)
        result: dict[str, Any] = {
            "machine_cores": os.cpu_count(),
            "topology": TOPOLOGY.model_dump(),
            "target_params": args.params,
            "target_params_ram": ram_params,
            "dim": args.dim,
            "zipf_exponent": args.zipf,
            "rows_per_id": args.rows_per_id,
            "memory_budget_gb_per_table_and_shard": budget_gb,
        }
        # Each large run on a stack of its own: a PS process keeps its heap's high-water mark
        # from job to job, and one run's would be read as the next one's RSS (or not fit beside it).
        with _stack(tmp, "first") as run_dir:
            print("[scale] the job at 1/100 of the size", file=sys.stderr)
            result["small"] = _finished("small", run(run_dir, scale_job(args.params / 100, *shape, None, seed=3)))
            if "disk" in runs:
                print(f"[scale] {args.params:.3g} parameters with the disk tier", file=sys.stderr)
                try:
                    result["disk"] = _finished("disk", run(run_dir, scale_job(args.params, *shape, tier, seed=3)))
                finally:
                    shutil.rmtree(spill, ignore_errors=True)
        if "ram" in runs:
            with _stack(tmp, "ram") as run_dir:
                print(f"[scale] {ram_params:.3g} parameters all in RAM", file=sys.stderr)
                result["ram"] = _finished("ram", run(run_dir, scale_job(ram_params, *shape, None, seed=3)))
    _summarize(result)
    print(json.dumps(result, indent=None if args.json else 2))


def _finished(name: str, outcome: dict[str, Any]) -> dict[str, Any]:
    """A run's result on stderr as soon as it has one: a later run failing an hour on loses none."""
    print(f"[scale] {name}: {json.dumps(outcome)}", file=sys.stderr, flush=True)
    return outcome


def _summarize(result: dict[str, Any]) -> None:
    """The keys the issue names, and each target's verdict, from the runs that were made."""
    targets = {}
    for name in ("disk", "ram"):
        if name in result:
            outcome = result[name]
            result[f"max_params_{name}"] = outcome["params_materialized"]
            result[f"{name}_auc_minus_small_auc"] = outcome["auc"] - result["small"]["auc"]
            targets[f"{name}: AUC at full size >= AUC at 1/100"] = result[f"{name}_auc_minus_small_auc"] >= 0
    if "disk" in result:
        result["disk_spill_bytes"] = sum(s["disk_bytes"] for s in result["disk"]["ps_shards"])
        targets["max_params_disk >= 2e10"] = result["max_params_disk"] >= 2e10
    if "ram" in result:
        targets["max_params_ram >= 1e10"] = result["max_params_ram"] >= 1e10
    if "disk" in result and "ram" in result:
        disk_rate, ram_rate = (result[name]["samples_per_sec_at"]["10%"] for name in ("disk", "ram"))
        if disk_rate and ram_rate:
            result["disk_vs_ram_samples_per_sec"] = disk_rate / ram_rate
        targets["disk_vs_ram_samples_per_sec >= 0.5"] = result.get("disk_vs_ram_samples_per_sec", 0) >= 0.5
    result["targets"] = targets


if __name__ == "__main__":
    main()
