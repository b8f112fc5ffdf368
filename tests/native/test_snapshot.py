"""Snapshots (round trip, resharding 2 -> 3, corruption) and delta export."""

from __future__ import annotations

import numpy as np
import pytest
from stores import TABLES, all_state, assert_state_equal, corrupt_variants, make_store, train

import trillium_native as tn


def test_round_trip(tmp_path):
    s = make_store(num_internal_shards=4)
    train([s], 5, seed=1, num_shards=1)
    p = tmp_path / "snap.bin"
    s.dump(p)
    t = tn.EmbeddingStore(num_internal_shards=7, threads=1)
    t.load(str(p))
    assert t.tables() == s.tables()
    for name, _ in TABLES:
        assert t.table_config(name) == s.table_config(name)
        assert t.num_rows(name) == s.num_rows(name)
        st_s, st_t = s.stats(name), t.stats(name)
        for k in ["admitted", "evicted", "expired", "nan_grads_skipped", "lookups", "updates", "update_batches"]:
            assert st_s[k] == st_t[k], k
        assert_state_equal(all_state(s, name, range(400)), all_state(t, name, range(400)))
    assert t.version == s.version
    # continuing training gives identical results
    train([s], 3, seed=2, num_shards=1)
    train([t], 3, seed=2, num_shards=1)
    for name, _ in TABLES:
        assert_state_equal(all_state(s, name, range(400)), all_state(t, name, range(400)))


def test_reshard_two_to_three(tmp_path):
    src = [make_store(num_internal_shards=4) for _ in range(2)]
    train(src, 6, seed=3, num_shards=2)
    paths = []
    for i, s in enumerate(src):
        p = tmp_path / f"ps{i}.bin"
        s.dump(p)
        paths.append(p)
    dst = [tn.EmbeddingStore(num_internal_shards=3) for _ in range(3)]
    for j, d in enumerate(dst):
        for p in paths:
            d.load(p, shard_index=j, num_shards=3)
    for name, _ in TABLES:
        merged = {}
        for s in src:
            merged.update(all_state(s, name, range(400)))
        total = sum(d.num_rows(name) for d in dst)
        assert total == sum(s.num_rows(name) for s in src) == len(merged)
        for i, state in merged.items():
            owner = int(tn.shard_of(np.array([i], np.uint64), 3)[0])
            for j, d in enumerate(dst):
                got = d.get_row_state(name, i)
                if j == owner:
                    assert got is not None
                    assert_state_equal({i: state}, {i: got})
                else:
                    assert got is None
    # Continue training identically: 2-shard sources vs 3-shard targets.
    train(src, 4, seed=4, num_shards=2)
    train(dst, 4, seed=4, num_shards=3)
    for name, _ in TABLES:
        a, b = {}, {}
        for s in src:
            a.update(all_state(s, name, range(400)))
        for d in dst:
            b.update(all_state(d, name, range(400)))
        # ttl/lru stamps are relative to each store's own batch counters
        for v in list(a.values()) + list(b.values()):
            v.pop("update_batch", None)
            v.pop("version", None)
        assert_state_equal(a, b)


def test_corrupted_snapshot_raises_value_error(tmp_path):
    s = make_store()
    train([s], 2, seed=5, num_shards=1)
    p = tmp_path / "good.bin"
    s.dump(p)
    good = p.read_bytes()
    q = tmp_path / "bad.bin"
    for what, data in corrupt_variants(good):
        q.write_bytes(data)
        t = tn.EmbeddingStore()
        with pytest.raises(ValueError):
            t.load(q)
        assert t.tables() == [], f"{what}: store modified by a failed load"
    with pytest.raises(FileNotFoundError):
        tn.EmbeddingStore().load(tmp_path / "missing.bin")


def test_load_into_incompatible_table_raises(tmp_path):
    s = tn.EmbeddingStore()
    s.create_table("t", 4)
    s.lookup("t", np.arange(10, dtype=np.uint64))
    s.dump(tmp_path / "a.bin")
    t = tn.EmbeddingStore()
    t.create_table("t", 8)
    with pytest.raises(ValueError, match="incompatible"):
        t.load(tmp_path / "a.bin")
    assert t.num_rows("t") == 0


def test_dump_is_consistent_under_concurrent_updates(tmp_path):
    import threading

    s = tn.EmbeddingStore(num_internal_shards=8)
    s.create_table("t", 8, optimizer="sgd", lr=1.0, init_low=0.0, init_high=0.0)
    ids = np.arange(5000, dtype=np.uint64)
    s.lookup("t", ids)
    stop = threading.Event()

    def hammer():
        g = np.ones((len(ids), 8), np.float32)
        while not stop.is_set():
            s.update("t", ids, g)

    th = threading.Thread(target=hammer)
    th.start()
    try:
        for k in range(3):
            s.dump(tmp_path / f"c{k}.bin")
    finally:
        stop.set()
        th.join()
    for k in range(3):
        t = tn.EmbeddingStore(num_internal_shards=8)
        t.load(tmp_path / f"c{k}.bin")
        assert t.num_rows("t") == 5000
        # every row is internally consistent: all 8 values equal (one update = -1 on all)
        rows = t.lookup("t", ids, create=False)
        assert np.all(rows == rows[:, :1])


def test_export_delta():
    s = tn.EmbeddingStore()
    s.create_table("t", 3, optimizer="sgd", lr=1.0)
    s.create_table("u", 2)
    v0 = s.version
    assert v0 == 0
    s.lookup("t", np.arange(10, dtype=np.uint64))
    ids, rows, cur = s.export_delta("t", 0)
    assert sorted(ids.tolist()) == list(range(10))  # created rows count as changed
    assert rows.shape == (10, 3) and rows.dtype == np.float32
    assert cur == 0
    s.update("t", np.array([2, 5], np.uint64), np.ones((2, 3), np.float32))
    s.update("u", np.array([1], np.uint64), np.ones((1, 2), np.float32))  # other table bumps version
    ids, rows, cur = s.export_delta("t", 0)
    assert cur == 2 == s.version
    assert len(ids) == 10  # all changed since 0
    ids, rows, cur2 = s.export_delta("t", 1)
    assert sorted(ids.tolist()) == []  # update of t was version 1, nothing after 1
    ids, rows, _ = s.export_delta("t", 0)
    s.update("t", np.array([7], np.uint64), np.full((1, 3), 2, np.float32))
    ids, rows, cur3 = s.export_delta("t", cur)
    assert ids.tolist() == [7]
    np.testing.assert_array_equal(rows[0], s.get_row("t", 7))
    assert cur3 == 3
    ids, _, _ = s.export_delta("t", cur3)
    assert len(ids) == 0
    s.lookup("t", np.array([100], np.uint64))  # new row after the last export
    ids, _, _ = s.export_delta("t", cur3)
    assert ids.tolist() == [100]
    with pytest.raises(ValueError):
        s.export_delta("t", -1)
    with pytest.raises(KeyError):
        s.export_delta("nope", 0)
