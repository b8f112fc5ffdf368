#!/usr/bin/env python3
"""Micro-benchmark of the embedding worker's per-batch CPU work around the PS lookups:
the native pooling (trillium/pooling.py over trillium_native) against the
numpy + torch implementation it replaced (tests/unit/pooling_reference.py), side by side
on the same batches in one process.

Per batch, each implementation does what the embedding worker does:

* `plan`: dedup IDs per table, route them to the PS shards;
* `lookup_io`: per shard, the IDs of each request, and the responses' rows put in place;
* `pool`: pool per slot, and each slot's array as it goes on the wire (contiguous, with
  the dtype asked for: the reference's `.numpy().astype(...)`);
* `scatter`: the per-slot gradients summed per unique ID, and each shard's message arrays
  (`ids`, `grads` per table).

Workloads: `criteo` (the job of issue 11: B=512, 26 one-ID slots of dim 16, each its own
table, 2 PS shards) and `mixed` (B=512: 20 one-ID slots, 4 multi-hot mean slots of up to
6 IDs sharing 2 tables, 2 sequence slots of max_len 8; dim 16; 4 shards). IDs are drawn
Zipf(1.1) from a 10^6 vocabulary per table, so batches repeat hot IDs. Times are CPU time of
the calling thread (`time.thread_time`: the development machine is shared, and wall time
counts waiting for a core), the best of `--repeats` passes over `--batches` batches; the
reference runs with one torch thread (as the worker did). `python bench/pooling.py --json` prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "unit"))
import pooling_reference as ref  # noqa: E402

from trillium import pooling  # noqa: E402
from trillium.job import FeatureSlot, TableConfig  # noqa: E402
from trillium.wire.batch import KeyedIds  # noqa: E402


def workload(name: str, batch: int, rng: np.random.Generator):
    if name == "criteo":
        slots = [FeatureSlot(name=f"C{i}", column=f"C{i}") for i in range(1, 27)]
        tables = {s.table: TableConfig(dim=16) for s in slots}
        shape = {s.name: 1 for s in slots}
        return slots, tables, shape, 2
    slots = [FeatureSlot(name=f"C{i}", column=f"C{i}") for i in range(20)]
    slots += [
        FeatureSlot(name=f"M{i}", column=f"M{i}", table=f"multi{i % 2}", pooling="mean", separator="|")
        for i in range(4)
    ]
    slots += [
        FeatureSlot(name=f"S{i}", column=f"S{i}", table=f"multi{i % 2}", pooling="none", max_len=8, separator="|")
        for i in range(2)
    ]
    tables = {s.table: TableConfig(dim=16) for s in slots}
    shape = {s.name: (1 if s.name.startswith("C") else 6 if s.name.startswith("M") else 8) for s in slots}
    return slots, tables, shape, 4


def make_batch(slots, shape, batch: int, rng: np.random.Generator) -> KeyedIds:
    keyed = {}
    for s in slots:
        longest = shape[s.name]
        lengths = np.ones(batch, np.int32) if longest == 1 else rng.integers(0, longest + 1, batch).astype(np.int32)
        values = ((rng.zipf(1.1, int(lengths.sum())) - 1) % 1_000_000).astype(np.uint64) * np.uint64(2654435761)
        keyed[s.name] = (values, lengths)
    return KeyedIds.from_slots(keyed)


# A shard's decoded response stands in as a view of one buffer (`codec.unpack_array`
# returns views too), so building it costs neither implementation anything.
RESPONSE = np.full((1 << 16, 16), 0.01, np.float32)


def fake_rows(ids: np.ndarray, dim: int) -> np.ndarray:
    return RESPONSE[: len(ids), :dim]


def run_reference(slots, tables, num_shards, ids: KeyedIds, fp16: bool, t: dict[str, float]) -> None:
    t0 = time.thread_time()
    p = ref.plan(ids, slots, num_shards)
    t1 = time.thread_time()
    rows = {tb: np.empty((len(tp.ids), tables[tb].dim), np.float32) for tb, tp in p.tables.items()}
    for shard in range(num_shards):
        for tb, tp in p.tables.items():
            request = tp.ids[tp.shard_rows[shard]]
            rows[tb][tp.shard_rows[shard]] = fake_rows(request, tables[tb].dim)
    t2 = time.thread_time()
    dtype = np.float16 if fp16 else np.float32
    wire = [(v.numpy().astype(dtype), None if m is None else m.numpy()) for v, m in ref.pool(p, rows)]
    t3 = time.thread_time()
    slot_grads = [np.ones(v.shape, np.float32) for v, _ in wire]  # what the NN worker sends back
    t3b = time.thread_time()
    grads = ref.scatter_gradients(p, slot_grads)
    messages = [
        {tb: (tp.ids[tp.shard_rows[s]], grads[tb][tp.shard_rows[s]]) for tb, tp in p.tables.items()}
        for s in range(num_shards)
    ]
    t4 = time.thread_time()
    assert len(messages) == num_shards
    for k, dt in zip(("plan", "lookup_io", "pool", "scatter"), (t1 - t0, t2 - t1, t3 - t2, t4 - t3b), strict=True):
        t[k] += dt


def run_native(layout, tables, num_shards, ids: KeyedIds, fp16: bool, t: dict[str, float]) -> None:
    t0 = time.thread_time()
    p = pooling.plan(layout, ids)
    t1 = time.thread_time()
    rows = {tb: np.empty((len(tp.ids), tables[tb].dim), np.float32) for tb, tp in p.tables.items()}
    for shard in range(num_shards):
        for tb, tp in p.tables.items():
            request = tp.shard_ids(shard)
            rows[tb][tp.shard_rows[shard]] = fake_rows(request, tables[tb].dim)
    t2 = time.thread_time()
    wire = [(np.ascontiguousarray(v), m) for v, m in pooling.pool(p, rows, fp16=fp16).slots()]
    t3 = time.thread_time()
    slot_grads = [np.ones(v.shape, np.float32) for v, _ in wire]
    t3b = time.thread_time()
    grads = pooling.scatter_gradients(p, slot_grads)
    messages = [
        {tb: (tp.ids[tp.shard_rows[s]], grads[tb][tp.shard_rows[s]]) for tb, tp in p.tables.items()}
        for s in range(num_shards)
    ]
    t4 = time.thread_time()
    assert len(messages) == num_shards
    for k, dt in zip(("plan", "lookup_io", "pool", "scatter"), (t1 - t0, t2 - t1, t3 - t2, t4 - t3b), strict=True):
        t[k] += dt


def bench(name: str, args) -> dict:
    rng = np.random.default_rng(0)
    slots, tables, shape, num_shards = workload(name, args.batch, rng)
    batches = [make_batch(slots, shape, args.batch, rng) for _ in range(args.batches)]
    layout = pooling.Layout(slots, tables, num_shards)
    phases = ("plan", "lookup_io", "pool", "scatter")
    best = {impl: dict.fromkeys(phases, float("inf")) for impl in ("reference", "native")}
    for rep in range(args.repeats + 1):  # the first pass warms up
        for impl in ("reference", "native"):
            t = dict.fromkeys(phases, 0.0)
            for ids in batches:
                if impl == "reference":
                    run_reference(slots, tables, num_shards, ids, args.fp16, t)
                else:
                    run_native(layout, tables, num_shards, ids, args.fp16, t)
            if rep:
                for k in phases:
                    best[impl][k] = min(best[impl][k], t[k])
    per_batch = {impl: {k: v / args.batches * 1e6 for k, v in b.items()} for impl, b in best.items()}
    for impl in per_batch:
        per_batch[impl]["total"] = sum(per_batch[impl][k] for k in phases)
    ids_per_batch = float(np.mean([len(b.values) for b in batches]))
    return {
        "batch": args.batch,
        "slots": len(slots),
        "tables": len(layout.tables),
        "shards": num_shards,
        "ids_per_batch": ids_per_batch,
        "us_per_batch": per_batch,
        "us_per_sample": {impl: v["total"] / args.batch for impl, v in per_batch.items()},
        "speedup": {k: per_batch["reference"][k] / per_batch["native"][k] for k in (*phases, "total")},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--batches", type=int, default=50, help="batches per timed pass")
    ap.add_argument("--repeats", type=int, default=5, help="timed passes; the best is reported")
    ap.add_argument("--fp16", action="store_true", help="float16 embeddings on the wire")
    args = ap.parse_args()
    torch.set_num_threads(1)
    res = {name: bench(name, args) for name in ("criteo", "mixed")}
    res["native_vs_reference_total"] = {name: res[name]["speedup"]["total"] for name in ("criteo", "mixed")}
    if args.json:
        print(json.dumps(res))
    else:
        print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
