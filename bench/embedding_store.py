#!/usr/bin/env python3
"""Benchmark of the native embedding store (trillium_native).

Measures, for a table of `--rows` rows (default 10M):

* lookup and update throughput (rows/s) for dim 16 and 64, batches of
  `--batch` (default 65,536) Zipf(1.1)-distributed ids (numpy's zipf, folded
  into [0, rows) with a modulo), with a single thread and with all threads
  (the store's `threads=` pool size);
* the limit: a numpy gather `np.take(dense, ids, axis=0)` of the same rows from
  a dense float32 array of the same shape, measured in the same worker process
  right after the single-threaded store measurement;
* memory: process RSS delta after inserting `rows` rows of dim 64, divided by
  `rows * 64` (bytes per stored value), for rowwise Adagrad, element-wise
  Adagrad and Adam, with fp32 and fp16 storage;
* the disk tier: the same table with a RAM budget of `--hot` (10%) of its rows and the rest in
  a spill file: RAM and disk bytes per value, and its lookup and update throughput against the
  all-in-RAM table's (`disk_tier_lookup_vs_ram`, `disk_tier_update_vs_ram`).

Every measurement runs in a fresh subprocess so runs do not contaminate each
other. `python bench/embedding_store.py --json` prints one JSON object.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time

TARGETS = {
    "lookup_vs_numpy_gather": (">=", 0.5),
    "bytes_per_value_fp32_rowwise_adagrad": ("<=", 4.6),
    "bytes_per_value_fp16_rowwise_adagrad": ("<=", 2.5),
}


def rss_bytes(field: str = "VmRSS") -> int:
    """This process's resident memory (`RssAnon`: without mapped files' pages, which are the
    page cache's, as a disk tier's spill files are)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not found")


def zipf_batches(rows: int, batch: int, count: int, seed: int):
    import numpy as np

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        z = rng.zipf(1.1, size=batch)
        out.append(((z - 1) % rows).astype(np.uint64))
    return out


def populate(store, table: str, rows: int, chunk: int = 1 << 16) -> float:
    import numpy as np

    t0 = time.perf_counter()
    for start in range(0, rows, chunk):
        ids = np.arange(start, min(rows, start + chunk), dtype=np.uint64)
        store.lookup(table, ids)
    return time.perf_counter() - t0


def timed_pass(fn, batches) -> float:
    t0 = time.perf_counter()
    for b in batches:
        fn(b)
    return time.perf_counter() - t0


def worker_throughput(spec: dict) -> dict:
    """Store lookup/update and (optionally) the numpy gather limit, measured in
    interleaved passes over the same batches (best pass of each is reported) so
    that both sides see the same machine conditions."""
    import numpy as np

    import trillium_native as tn

    rows, dim, threads, batch = spec["rows"], spec["dim"], spec["threads"], spec["batch"]
    nb, repeats = spec["batches"], spec["repeats"]
    store = tn.EmbeddingStore(threads=threads)
    store.create_table("t", dim, optimizer=spec["optimizer"], lr=0.01)
    populate_s = populate(store, "t", rows)
    batches = zipf_batches(rows, batch, nb, seed=1234 + dim)
    unique_frac = float(np.mean([len(np.unique(b)) / batch for b in batches]))
    grads = np.random.default_rng(7).standard_normal((batch, dim), dtype=np.float32) * 1e-3
    dense = np.full((rows, dim), 0.01, dtype=np.float32) if spec.get("numpy") else None

    def lookup(b):
        return store.lookup("t", b)

    def update(b):
        return store.update("t", b, grads)

    def gather(b):
        return np.take(dense, b, axis=0)

    for f in (lookup, update) + ((gather,) if dense is not None else ()):
        f(batches[0])  # warm-up
    best = {"lookup": float("inf"), "update": float("inf"), "gather": float("inf")}
    for _ in range(repeats):
        best["lookup"] = min(best["lookup"], timed_pass(lookup, batches))
        if dense is not None:
            best["gather"] = min(best["gather"], timed_pass(gather, batches))
        best["update"] = min(best["update"], timed_pass(update, batches))
    total = nb * batch
    res = {
        "dim": dim,
        "threads": threads,
        "optimizer": spec["optimizer"],
        "lookup_rows_per_s": total / best["lookup"],
        "update_rows_per_s": total / best["update"],
        "populate_rows_per_s": rows / populate_s,
        "unique_ids_per_batch_frac": unique_frac,
        "store_memory_bytes": store.memory_bytes(),
    }
    if dense is not None:
        res["numpy_gather_rows_per_s"] = total / best["gather"]
    return res


def worker_memory(spec: dict) -> dict:
    import numpy as np

    import trillium_native as tn

    rows, dim = spec["rows"], spec["dim"]
    store = tn.EmbeddingStore()
    # Warm up allocator / numpy paths so the baseline includes them.
    store.create_table("warm", 4)
    store.lookup("warm", np.arange(1000, dtype=np.uint64))
    store.drop_table("warm")
    gc.collect()
    before = rss_bytes()
    store.create_table("t", dim, dtype=spec["dtype"], optimizer=spec["optimizer"])
    t0 = time.perf_counter()
    populate(store, "t", rows)
    elapsed = time.perf_counter() - t0
    gc.collect()
    after = rss_bytes()
    assert store.num_rows("t") == rows
    values = rows * dim
    return {
        "dtype": spec["dtype"],
        "optimizer": spec["optimizer"],
        "rows": rows,
        "dim": dim,
        "rss_delta_bytes": after - before,
        "bytes_per_value": (after - before) / values,
        "memory_bytes_reported": store.memory_bytes("t"),
        "reported_bytes_per_value": store.memory_bytes("t") / values,
        "insert_rows_per_s": rows / elapsed,
    }


def worker_tier(spec: dict) -> dict:
    """The disk tier: a table of `rows` rows whose RAM budget holds `hot` of them, the rest in a
    spill file. RAM bytes per value (anonymous RSS: the mapped spill files are page cache), spill bytes per value, and lookup
    and update throughput on the Zipf batches of `worker_throughput` (best of interleaved passes)."""
    import tempfile

    import numpy as np

    import trillium_native as tn

    rows, dim, batch = spec["rows"], spec["dim"], spec["batch"]
    # RAM a resident row takes with a tier (native Layout::ram_row_bytes): id 8, fp32 weights,
    # version 4, row-wise accumulator 4, LRU tick 4, index 8.
    row_bytes = 8 + 4 * dim + 4 + 4 + 4 + 8
    with tempfile.TemporaryDirectory(prefix="trillium-tier-", dir=spec.get("spill")) as spill:
        store = tn.EmbeddingStore(threads=spec["threads"])
        store.create_table("warm", 4)
        store.lookup("warm", np.arange(1000, dtype=np.uint64))
        store.drop_table("warm")
        gc.collect()
        before = rss_bytes("RssAnon")  # the spill files are mapped: their pages are the page cache's
        budget = int(spec["hot"] * rows * row_bytes)
        store.create_table("t", dim, optimizer=spec["optimizer"], lr=0.01, memory_budget_bytes=budget, disk=spill)
        populate_s = populate(store, "t", rows)
        gc.collect()
        after = rss_bytes("RssAnon")
        batches = zipf_batches(rows, batch, spec["batches"], seed=1234 + dim)
        grads = np.random.default_rng(7).standard_normal((batch, dim), dtype=np.float32) * 1e-3
        store.lookup("t", batches[0])
        hits_before, lookups_before = store.stats("t")["disk_lookup_hits"], store.stats("t")["lookups"]
        best = {"lookup": float("inf"), "update": float("inf")}
        for _ in range(spec["repeats"]):
            best["lookup"] = min(best["lookup"], timed_pass(lambda b: store.lookup("t", b), batches))
            best["update"] = min(best["update"], timed_pass(lambda b: store.update("t", b, grads), batches))
        st = store.stats("t")
    values = rows * dim
    total = spec["batches"] * batch
    return {
        "rows": rows,
        "dim": dim,
        "hot": spec["hot"],
        "threads": spec["threads"],
        "resident_rows": st["resident_rows"],
        "ram_bytes_per_value": (after - before) / values,
        "disk_bytes_per_value": st["disk_bytes"] / values,
        "lookup_rows_per_s": total / best["lookup"],
        "update_rows_per_s": total / best["update"],
        "populate_rows_per_s": rows / populate_s,
        "lookups_from_disk_frac": (st["disk_lookup_hits"] - hits_before) / max(st["lookups"] - lookups_before, 1),
    }


def run_worker(kind: str, spec: dict) -> dict:
    env = dict(os.environ)
    cmd = [sys.executable, os.path.abspath(__file__), "--_worker", kind, json.dumps(spec)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        raise RuntimeError(f"worker {kind} {spec} failed:\n{p.stderr}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--batch", type=int, default=65_536)
    ap.add_argument("--batches", type=int, default=20, help="timed batches per pass")
    ap.add_argument("--repeats", type=int, default=7, help="interleaved passes; the best is reported")
    ap.add_argument("--dims", default="16,64")
    ap.add_argument("--threads", default=None, help="comma list (default: 1,<all cores>)")
    ap.add_argument("--optimizer", default="rowwise_adagrad", help="optimizer of the throughput tables")
    ap.add_argument("--skip-memory", action="store_true")
    ap.add_argument("--skip-tier", action="store_true", help="leave out the disk tier's measurement")
    ap.add_argument("--hot", type=float, default=0.1, help="share of the rows the disk tier's RAM budget holds")
    ap.add_argument("--spill", default=None, help="the disk tier's directory [a temporary one]")
    ap.add_argument("--_worker", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args._worker:
        kind, spec = args._worker[0], json.loads(args._worker[1])
        workers = {"throughput": worker_throughput, "memory": worker_memory, "tier": worker_tier}
        res = workers[kind](spec)
        print(json.dumps(res))
        return

    ncpu = os.cpu_count() or 1
    threads = [int(x) for x in args.threads.split(",")] if args.threads else sorted({1, ncpu})
    dims = [int(x) for x in args.dims.split(",")]
    t_start = time.perf_counter()
    details = []
    for dim in dims:
        for th in threads:
            spec = {
                "rows": args.rows,
                "dim": dim,
                "threads": th,
                "batch": args.batch,
                "batches": args.batches,
                "repeats": args.repeats,
                "optimizer": args.optimizer,
                "numpy": th == 1,
            }
            details.append(run_worker("throughput", spec))
            if not args.json:
                print(json.dumps(details[-1]), file=sys.stderr)

    out: dict = {
        "rows": args.rows,
        "batch": args.batch,
        "zipf_a": 1.1,
        "cpu_count": ncpu,
        "threads_measured": threads,
    }

    def pick(dim: int, th: int) -> dict | None:
        for d in details:
            if d["dim"] == dim and d["threads"] == th:
                return d
        return None

    for d in details:
        key = f"dim{d['dim']}_threads{d['threads']}"
        out[f"lookup_rows_per_s_{key}"] = round(d["lookup_rows_per_s"])
        out[f"update_rows_per_s_{key}"] = round(d["update_rows_per_s"])
        if "numpy_gather_rows_per_s" in d:
            out[f"numpy_gather_rows_per_s_dim{d['dim']}"] = round(d["numpy_gather_rows_per_s"])
            out[f"lookup_vs_numpy_gather_dim{d['dim']}"] = round(
                d["lookup_rows_per_s"] / d["numpy_gather_rows_per_s"], 3
            )
    main_dim = 64 if 64 in dims else dims[-1]
    single = pick(main_dim, 1) or pick(main_dim, threads[0])
    allth = pick(main_dim, threads[-1])
    if single and "numpy_gather_rows_per_s" in single:
        out["lookup_vs_numpy_gather"] = round(single["lookup_rows_per_s"] / single["numpy_gather_rows_per_s"], 3)
    if allth:
        out["lookup_rows_per_s"] = round(allth["lookup_rows_per_s"])
        out["update_rows_per_s"] = round(allth["update_rows_per_s"])
    if single:
        out["lookup_rows_per_s_single_thread"] = round(single["lookup_rows_per_s"])
        out["update_rows_per_s_single_thread"] = round(single["update_rows_per_s"])

    if not args.skip_memory:
        mem = []
        for opt in ["rowwise_adagrad", "adagrad", "adam"]:
            for dtype in ["fp32", "fp16"]:
                r = run_worker("memory", {"rows": args.rows, "dim": 64, "dtype": dtype, "optimizer": opt})
                mem.append(r)
                out[f"bytes_per_value_{dtype}_{opt}"] = round(r["bytes_per_value"], 3)
                out[f"reported_bytes_per_value_{dtype}_{opt}"] = round(r["reported_bytes_per_value"], 3)
                if not args.json:
                    print(json.dumps(r), file=sys.stderr)
        out["memory_details"] = mem

    if not args.skip_tier:
        # Beside the all-in-RAM table of the same dim, optimizer and thread count measured above.
        ram = pick(main_dim, 1) or pick(main_dim, threads[0])
        spec = {
            "rows": args.rows,
            "dim": main_dim,
            "threads": ram["threads"],
            "batch": args.batch,
            "batches": args.batches,
            "repeats": args.repeats,
            "optimizer": args.optimizer,
            "hot": args.hot,
            "spill": args.spill,
        }
        tier = run_worker("tier", spec)
        out["disk_tier"] = tier
        out["disk_tier_lookup_vs_ram"] = round(tier["lookup_rows_per_s"] / ram["lookup_rows_per_s"], 3)
        out["disk_tier_update_vs_ram"] = round(tier["update_rows_per_s"] / ram["update_rows_per_s"], 3)
        out["disk_tier_ram_bytes_per_value"] = round(tier["ram_bytes_per_value"], 3)
        out["disk_tier_disk_bytes_per_value"] = round(tier["disk_bytes_per_value"], 3)
        if not args.json:
            print(json.dumps(tier), file=sys.stderr)

    checks = {}
    for k, (op, target) in TARGETS.items():
        if k in out:
            v = out[k]
            checks[k] = {"value": v, "target": f"{op} {target}", "ok": v >= target if op == ">=" else v <= target}
    out["targets"] = checks
    out["details"] = details
    out["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    if args.json:
        print(json.dumps(out))
    else:
        print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
