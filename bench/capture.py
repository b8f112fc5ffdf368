#!/usr/bin/env python3
"""Benchmark of checkpointing one PS shard: `EmbeddingStore.capture()` then
`StoreCapture.write()`, against `EmbeddingStore.dump()`.

The table is one shard of the checkpoint benchmark (issue 8: 10M rows x dim 64 on 2
shards): `--rows` (default 5M) rows of dim `--dim` (64), fp32, rowwise Adagrad,
every row updated once so its accumulator is set. Reported, best of `--repeats`:

* `capture_s`: the pause a checkpoint costs training (the PS applies no update meanwhile);
* `*_cpu_s`: CPU seconds of the process (all threads, kernel included) for the same calls,
  which matter on a machine the checkpoint shares with training;
* `capture_rss_bytes`: process RSS growth while a capture is held, and the capture's own
  `memory_bytes`, both also relative to the store's `memory_bytes()`; what of it
  `release()` did not give back (`rss_kept_after_release_bytes`);
* `write_s` / `write_mb_per_s`: `StoreCapture.write` (gather, checksums, SHA-256,
  fsync, rename), which runs while training goes on; likewise `dump_s` for `dump()`;
* `load_s`: loading the file into a fresh store (a restore).

Files go to `--dir` (default: a temporary directory under /tmp) and are deleted.
`python bench/capture.py --json` prints one JSON object.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time

import numpy as np

import trillium_native as tn


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("VmRSS not found")


def timed(fn, cpu: list[float]):
    """Wall seconds and result of fn(); appends the process's CPU seconds (all threads) to cpu."""
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    cpu.append(time.process_time() - c0)
    return time.perf_counter() - t0, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--rows", type=int, default=5_000_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="store pool size (default: all cores)")
    ap.add_argument("--dir", default=None, help="where to write the files")
    args = ap.parse_args()

    store = tn.EmbeddingStore(threads=args.threads)
    store.create_table("t", args.dim, optimizer="rowwise_adagrad", lr=0.01)
    chunk = 1 << 16
    grads = np.random.default_rng(0).standard_normal((chunk, args.dim), dtype=np.float32) * 1e-3
    for start in range(0, args.rows, chunk):
        ids = np.arange(start, min(args.rows, start + chunk), dtype=np.uint64)
        store.lookup("t", ids)
        store.update("t", ids, grads[: len(ids)])
    store_bytes = store.memory_bytes()
    res = {
        "rows": args.rows,
        "dim": args.dim,
        "optimizer": "rowwise_adagrad",
        "dtype": "fp32",
        "threads": store.threads,
        "store_memory_bytes": store_bytes,
    }

    with tempfile.TemporaryDirectory(prefix="native-capture-", dir=args.dir or "/tmp") as d:
        cap_path, dump_path = os.path.join(d, "capture.snap"), os.path.join(d, "dump.snap")
        captures, writes, dumps = [], [], []
        cpu: dict[str, list[float]] = {"capture": [], "write": [], "dump": [], "load": []}
        for _ in range(args.repeats):
            gc.collect()
            before = rss_bytes()
            t, cap = timed(store.capture, cpu["capture"])
            captures.append(t)
            res["capture_rss_bytes"] = rss_bytes() - before
            res["capture_memory_bytes"] = cap.memory_bytes
            t, (nbytes, sha) = timed(lambda cap=cap: cap.write(cap_path), cpu["write"])
            writes.append(t)
            cap.release()
            res["rss_kept_after_release_bytes"] = rss_bytes() - before
            t, (dump_bytes, dump_sha) = timed(lambda: store.dump(dump_path), cpu["dump"])
            dumps.append(t)
        assert dump_bytes == nbytes
        fresh = tn.EmbeddingStore(threads=args.threads)
        load_s, _ = timed(lambda: fresh.load(cap_path), cpu["load"])
        assert fresh.num_rows("t") == args.rows
    mb = nbytes / 1e6
    res.update(
        {
            "file_bytes": nbytes,
            "capture_s": min(captures),
            "capture_rss_vs_store": res["capture_rss_bytes"] / store_bytes,
            "capture_memory_vs_store": res["capture_memory_bytes"] / store_bytes,
            "write_s": min(writes),
            "write_mb_per_s": mb / min(writes),
            "dump_s": min(dumps),
            "dump_mb_per_s": mb / min(dumps),
            "load_s": load_s,
            **{f"{k}_cpu_s": min(v) for k, v in cpu.items()},
            "all_capture_s": captures,
            "all_write_s": writes,
            "all_dump_s": dumps,
        }
    )
    if args.json:
        print(json.dumps(res))
    else:
        for k, v in res.items():
            print(f"{k:>24}: {v}")


if __name__ == "__main__":
    main()
