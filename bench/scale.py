"""Whole-stack scale run: a synthetic Criteo-layout job trained by the full local stack (2 PS
shards, 1 NN rank, 1 embedding worker, no serving replica) until its tables hold a target number
of materialized parameters, once with the disk tier and once all in RAM, at the same size, and
the same job at 1/100 of the size.

    python bench/scale.py --json                            # 2e8 parameters, most rows on disk (~5 min)
    python bench/scale.py --json --params 4.25e10 --ram-params 2.05e10 --dim 512 \
        --rows-per-id 1 --hot 0.05                          # 2.1e10 on disk, 1.0e10 in RAM (65 min)

The job: 26 slots, a table each, `--dim` (64) values a row in fp16 with row-wise Adagrad, the
fp16 wire, no checkpoints and no model versions (at these sizes a full checkpoint's second copy
of an all-in-RAM table does not fit, and each version would copy the rows a growing table
changed: all of them). Each slot's vocabulary is params / (26 × dim) IDs drawn by a power law of
exponent `--zipf` (0.5: the tail is reached, as a scale run needs, and popular IDs still repeat);
one epoch of `--rows-per-id` (2.5) × the vocabulary's rows materializes about 78% of it (49% at
1 row an ID; what the run reports is what the PS shards hold, not the target). The disk-tier run
keeps `--hot` (10%) of each shard's target rows in RAM (`tables.X.memory_budget_gb`: the hot
set, the most recently looked-up rows) and spills the rest under `--spill`. The small run and
the disk-tier run share a stack; the all-in-RAM run has one of its own.

**Disk vs RAM at the same size** (`disk_vs_ram_same_size`): both runs train the same samples
(one seed), so after n samples their tables hold the same rows. The window starts at the first
sample count at which the disk run held most of its rows on disk (`disk_share_of_rows` >= 0.5)
and ends with training; the ratio is the disk run's samples/s over that window to the RAM run's
over the same samples. Beside it, over the same window, what limits the tier: the hot set's hit
rate (looked-up IDs answered from RAM / all looked up), IDs read back from the spill files per
step, and read amplification (bytes the PS processes read from the block device, per
/proc/PID/io, over the bytes of the records they needed: 0 when the spill files sat in the page
cache, as they do at the default size, up to a 4 KiB page a record, 144 bytes at dim 64, when they did not).
`curve`: each run's samples/s, rows held, share on disk and hit rate in each tenth of its
samples. Training ends, for all of these, at the last reading before the final sample count.

Reported too, per run: every PS shard's anonymous RSS (the spill files it maps are page cache)
and spill bytes, the most the broker's data and the least the machine's available memory were,
the load average, the run's wall time, and the test AUC against the job at 1/100 of the size
(same model and rows per ID, so it must not be worse). Keys the issue names: `max_params_ram`,
`max_params_disk`, `disk_vs_ram_same_size` with `disk_share_of_rows`.
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
from typing import Any, NamedTuple

from jobs import criteo_layout_job  # bench/jobs.py: the script's own folder is on sys.path

from trillium import stack
from trillium.config import GRPC_MAX_MESSAGE_BYTES, StackTopology
from trillium.job import JobConfig
from trillium.job.trust import ENV_ALLOWED_PATHS
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


def spill_record_bytes(dim: int) -> int:
    """Bytes of a spilled fp16 row with row-wise Adagrad (native tier.rs `record_bytes`: id 8,
    weights, accumulator 4, LRU tick 4): what a lookup of a row on disk needs to read."""
    return 8 + dim * 2 + 4 + 4


def _ps_pids(run_dir: Path) -> dict[str, int]:
    return {
        proc["name"]: proc["pid"]
        for proc in stack.read_state(run_dir)["processes"]
        if proc["role"] == "embedding_ps" and proc.get("pid")
    }


def _rss(pids: dict[str, int]) -> dict[str, int]:
    """Each PS shard's anonymous RSS: its own memory, not the pages of the spill files it maps
    (page cache, given back under memory pressure)."""
    out = {}
    for name, pid in pids.items():
        with contextlib.suppress(OSError):  # a process restarting
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("RssAnon:"):
                    out[name] = int(line.split()[1]) * 1024
    return out


def _device_reads(pids: dict[str, int]) -> int:
    """The PS processes' bytes read from the block device (/proc/PID/io `read_bytes`: a fault on
    a mapped spill file that the page cache could not answer counts here, a cached one does not;
    major faults would not do, as the first touch of a file's newly allocated blocks is one)."""
    read_bytes = 0
    for pid in pids.values():
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/io").read_text().splitlines():
                if line.startswith("read_bytes:"):
                    read_bytes += int(line.split()[1])
    return read_bytes


def _du(path: Path) -> int:
    total = 0
    for f in path.rglob("*"):
        with contextlib.suppress(FileNotFoundError):  # a segment the broker deleted meanwhile
            total += f.stat().st_size if f.is_file() else 0
    return total


class Point(NamedTuple):
    """One reading of a run, twice a second: the job's samples and its tables summed over shards."""

    seconds: float
    samples: int
    rows: int
    resident_rows: int
    disk_rows: int
    lookups: int
    disk_lookup_hits: int  # looked-up IDs read back from the spill files
    device_read_bytes: int  # the PS processes', from /proc/PID/io


def _at(points: list[Point], samples: float) -> Point:
    """The reading at `samples` trained, each field interpolated linearly between the readings
    either side (the first reading at or past it when the samples stood still)."""
    after = next(i for i, p in enumerate(points) if p.samples >= samples)
    if after == 0 or points[after].samples == samples:
        return points[after]
    p, q = points[after - 1], points[after]
    f = (samples - p.samples) / (q.samples - p.samples)
    return Point(*(a + (b - a) * f for a, b in zip(p, q, strict=True)))


def _trained(points: list[Point]) -> list[Point]:
    """The readings before the first with the run's final sample count: training, and none of
    the evaluation after it (which looks up the test split's IDs, most of them on disk), however
    late the final count was reported."""
    final = points[-1].samples
    return points[: max(next(i for i, p in enumerate(points) if p.samples == final), 2)]


def _span(points: list[Point], lo: float, hi: float, step_samples: int, dim: int) -> dict[str, Any]:
    """What a run did between `lo` and `hi` samples trained."""
    a, b = _at(points, lo), _at(points, hi)
    lookups, from_disk = b.lookups - a.lookups, b.disk_lookup_hits - a.disk_lookup_hits
    steps = (b.samples - a.samples) / step_samples
    needed = from_disk * spill_record_bytes(dim)
    return {
        "samples_per_sec": round((b.samples - a.samples) / (b.seconds - a.seconds)) if b.seconds > a.seconds else None,
        "params_held": int(b.rows) * dim,
        "disk_share_of_rows": round(b.disk_rows / b.rows, 4) if b.rows else 0.0,
        "hit_rate": round(1 - from_disk / lookups, 4) if lookups else None,
        "disk_reads_per_step": round(from_disk / steps, 1) if steps else None,
        "read_amplification": round((b.device_read_bytes - a.device_read_bytes) / needed, 3) if needed else None,
    }


def _curve(points: list[Point], step_samples: int, dim: int) -> list[dict[str, Any]]:
    """The run in tenths of its samples: each tenth's samples/s, and what the tables held at its end."""
    points = _trained(points)
    final = points[-1].samples
    return [
        {"samples": int(final * (i + 1) / 10), **_span(points, final * i / 10, final * (i + 1) / 10, step_samples, dim)}
        for i in range(10)
    ]


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


def run(run_dir: Path, job: JobConfig) -> tuple[dict[str, Any], list[Point]]:
    """Train `job` to its end, reading the job view and its tables twice a second; the outcome
    and the readings."""
    dim = next(iter(job.tables.values())).dim
    client = CoordinatorClient.for_stack(run_dir)
    pids = _ps_pids(run_dir)
    points: list[Point] = []
    last_tables: dict[str, Any] = {}
    rss_max: dict[str, int] = {}
    mem_available_min, broker_max = _mem_available(), 0
    load = [os.getloadavg()[0]]
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
                    t = last_tables["tables"].values()
                    points.append(
                        Point(
                            time.monotonic() - started,
                            view["progress"]["samples"],
                            *(sum(x[k] for x in t) for k in ("rows", "resident_rows", "disk_rows", "lookups")),
                            sum(x["disk_lookup_hits"] for x in t),
                            _device_reads(pids),
                        )
                    )
                for name, rss in _rss(pids).items():
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
    load.append(os.getloadavg()[0])
    params = sum(t["rows"] for t in tables.values()) * dim
    lookups = sum(t["lookups"] for t in tables.values())
    from_disk = sum(t["disk_lookup_hits"] for t in tables.values())
    step_samples = job.training.batch_size * job.topology.nn_ranks
    outcome = {
        "params_materialized": params,
        "samples_trained": view["progress"]["samples"],
        "seconds": round(time.monotonic() - started, 1),
        "training_seconds": round(_trained(points)[-1].seconds - points[0].seconds, 1),
        "auc": view["job"]["metrics"].get("auc"),
        "load_average_1min_at_start_and_end": [round(x, 2) for x in load],
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
        "curve": _curve(points, step_samples, dim),
    }
    return outcome, points


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print only the JSON result on stdout")
    parser.add_argument("--params", type=float, default=2e8, help="target parameters of each run [2e8]")
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
        os.environ.setdefault(ENV_ALLOWED_PATHS, f"{tmp},{spill}")  # the stacks' run directories and the spill
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
        points: dict[str, list[Point]] = {}

        def measure(name: str, run_dir: Path, job: JobConfig) -> None:
            result[name], points[name] = run(run_dir, job)
            if name == "small":
                del result[name]["curve"]  # a second or two: too few readings for tenths
            print(
                f"[scale] {name}: {json.dumps(result[name])}", file=sys.stderr, flush=True
            )  # a later failure loses none

        with _stack(tmp, "first") as run_dir:
            print("[scale] the job at 1/100 of the size", file=sys.stderr)
            measure("small", run_dir, scale_job(args.params / 100, *shape, None, seed=3))
            if "disk" in runs:
                print(f"[scale] {args.params:.3g} parameters with the disk tier", file=sys.stderr)
                try:
                    measure("disk", run_dir, scale_job(args.params, *shape, tier, seed=3))
                finally:
                    shutil.rmtree(spill, ignore_errors=True)
        if "ram" in runs:
            with _stack(tmp, "ram") as run_dir:
                print(f"[scale] {ram_params:.3g} parameters all in RAM", file=sys.stderr)
                measure("ram", run_dir, scale_job(ram_params, *shape, None, seed=3))
        if "disk" in points and "ram" in points:
            if ram_params == args.params:
                step_samples = scale_job(args.params, *shape, None, seed=3).training.batch_size * TOPOLOGY.nn_ranks
                result.update(_same_size(points["disk"], points["ram"], step_samples, args.dim))
            else:  # another vocabulary: other rows, not the same tables at the same sample count
                result["disk_vs_ram_same_size"] = None
                result["same_size_window"] = {"why": "--ram-params differs from --params: not the same tables"}
    _summarize(result)
    print(json.dumps(result, indent=None if args.json else 2))


def _same_size(disk: list[Point], ram: list[Point], step_samples: int, dim: int) -> dict[str, Any]:
    """Disk vs RAM over the same samples (so the same tables), from the first at which the disk
    run held most of its rows on disk to the end of training; and what limited the disk run there."""
    disk, ram = _trained(disk), _trained(ram)
    end = min(disk[-1].samples, ram[-1].samples)  # equal: one epoch of the same samples
    start = next((p.samples for p in disk if p.rows and p.disk_rows >= p.rows / 2), None)
    if start is None or start >= end:
        return {"disk_vs_ram_same_size": None, "same_size_window": {"why": "most rows were never on disk"}}
    d, r = _span(disk, start, end, step_samples, dim), _span(ram, start, end, step_samples, dim)
    at_start, last = _at(disk, start), disk[-1]
    return {
        "disk_vs_ram_same_size": round(d["samples_per_sec"] / r["samples_per_sec"], 3),
        "disk_share_of_rows": d["disk_share_of_rows"],  # at the end of training
        "hot_set_share_of_rows": round(last.resident_rows / last.rows, 4),
        "hot_set_hit_rate": d["hit_rate"],
        "disk_reads_per_step": d["disk_reads_per_step"],
        "read_amplification": d["read_amplification"],
        "same_size_window": {
            "from_samples": int(start),
            "to_samples": int(end),
            "share_of_training": round((end - start) / end, 3),
            "disk_share_of_rows_at_start": round(at_start.disk_rows / at_start.rows, 4),
            "params_held_at_end": int(last.rows) * dim,
            "disk_samples_per_sec": d["samples_per_sec"],
            "ram_samples_per_sec": r["samples_per_sec"],
            "bytes_needed_per_disk_read": spill_record_bytes(dim),
            "device_read_bytes": int(_at(disk, end).device_read_bytes - at_start.device_read_bytes),
        },
    }


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
    if (ratio := result.get("disk_vs_ram_same_size")) is not None:
        most_on_disk = result["disk_share_of_rows"] >= 0.5
        targets["disk_vs_ram_same_size >= 0.5 with most rows on disk"] = most_on_disk and ratio >= 0.5
    result["targets"] = targets


if __name__ == "__main__":
    main()
