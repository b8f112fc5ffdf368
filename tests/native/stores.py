"""Stores holding one table of each kind, trained the way PS shards are (ids routed by
shard_of), their full row state, and damaged copies of a snapshot file: shared by the
snapshot and capture tests."""

from __future__ import annotations

import struct

import numpy as np

import trillium_native as tn

# A table's event counters, as `EmbeddingStore.stats` names them.
COUNTERS = [
    "admitted",
    "not_admitted",
    "evicted",
    "expired",
    "nan_grads_skipped",
    "lookups",
    "updates",
    "dropped_grads",
]

TABLES = [
    ("emb_adam", dict(dim=6, optimizer="adam", lr=0.01, dtype="fp16", ttl_updates=1000)),
    (
        "emb_rw",
        dict(
            dim=4,
            optimizer="rowwise_adagrad",
            lr=0.1,
            admission="threshold",
            admission_threshold=1,
            admission_sketch_width=1024,
        ),
    ),
    ("emb_ftrl", dict(dim=3, optimizer="ftrl", ftrl_alpha=0.1, ftrl_l1=0.001, capacity=100000)),
    ("emb_ada", dict(dim=5, optimizer="adagrad", lr=0.05, dtype="bf16", initializer="normal", seed=4)),
]


def make_store(**kw):
    s = tn.EmbeddingStore(**kw)
    for name, cfg in TABLES:
        cfg = dict(cfg)
        dim = cfg.pop("dim")
        s.create_table(name, dim, **cfg)
    return s


def train(stores_by_shard, steps, seed, num_shards, ids_universe=400):
    """Route every batch by shard_of (like the embedding worker) and train."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        for name, cfg in TABLES:
            ids = rng.integers(0, ids_universe, size=64).astype(np.uint64)
            grads = (rng.standard_normal((64, cfg["dim"])) * 0.1).astype(np.float32)
            owner = tn.shard_of(ids, num_shards)
            for sh, store in enumerate(stores_by_shard):
                m = owner == sh
                if m.any():
                    store.lookup(name, ids[m])
                    store.update(name, ids[m], grads[m])


def all_state(store, name, ids):
    return {int(i): store.get_row_state(name, int(i)) for i in ids if store.get_row_state(name, int(i)) is not None}


def assert_state_equal(a, b, skip=("update_time",)):
    """Row states exactly equal field by field (but the fields in `skip`: the wall
    clock of the last update changes when training continues)."""
    assert a.keys() == b.keys()
    for k in a:
        va, vb = a[k], b[k]
        assert va.keys() == vb.keys(), (va.keys(), vb.keys())
        for f in va:
            if f in skip:
                continue
            np.testing.assert_array_equal(np.asarray(va[f]), np.asarray(vb[f]), err_msg=f"{k}.{f}")


def corrupt_variants(good: bytes):
    yield "bad magic", b"XXXXXXXX" + good[8:]
    yield "bad version", good[:8] + struct.pack("<I", 99) + good[12:]
    yield "empty", b""
    yield "header only", good[:40]
    for frac in (0.3, 0.5, 0.9, 0.999):
        yield f"truncated {frac}", good[: int(len(good) * frac)]
    rng = np.random.default_rng(0)
    for pos in rng.integers(40, len(good), size=25):
        b = bytearray(good)
        b[pos] ^= 0x5A
        yield f"flip {pos}", bytes(b)
    yield "trailing garbage", good + b"\x00"
