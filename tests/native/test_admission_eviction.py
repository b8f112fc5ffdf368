"""Admission (off / probability / threshold) and eviction (capacity LRU,
ttl_updates, ttl_seconds) against pure-Python reference models."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from splitmix import mix64

import trillium_native as tn

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ADMIT_SALT = 0x13198A2E03707344


def admitted_by_probability(seed: int, i: int, p: float) -> bool:
    """Documented deterministic draw: unit(mix64(mix64(seed ^ SALT) ^ id)) < p."""
    r = mix64(mix64(seed ^ ADMIT_SALT) ^ i)
    return (r >> 11) * (1.0 / (1 << 53)) < p


def oracle_rows(dim, seed, ids, **kw):
    """Initial vectors straight from a fresh store (deterministic init)."""
    s = tn.EmbeddingStore(num_internal_shards=1, threads=1)
    s.create_table("o", dim, seed=seed, **kw)
    return s.lookup("o", np.asarray(ids, dtype=np.uint64))


id_batches = st.lists(st.lists(st.integers(0, 40), min_size=1, max_size=15), min_size=1, max_size=8)


# ---------------------------------------------------------------- admission


@SETTINGS
@given(batches=id_batches, threshold=st.integers(1, 4), shards=st.sampled_from([1, 4, 16]))
def test_threshold_admission_matches_reference(batches, threshold, shards):
    dim = 3
    s = tn.EmbeddingStore(num_internal_shards=shards, threads=2)
    s.create_table("t", dim, seed=5, admission="threshold", admission_threshold=threshold)
    counts: dict[int, int] = {}
    present: set[int] = set()
    not_admitted = 0
    for b in batches:
        out = s.lookup("t", np.array(b, dtype=np.uint64))
        expect_present = set(present)
        for i in sorted(set(b)):
            if i in present:
                continue
            counts[i] = counts.get(i, 0) + b.count(i)
            if counts[i] >= threshold:
                expect_present.add(i)
            else:
                not_admitted += 1
        init = oracle_rows(dim, 5, b)
        for k, i in enumerate(b):
            if i in expect_present:
                np.testing.assert_array_equal(out[k], init[k])
            else:
                np.testing.assert_array_equal(out[k], np.zeros(dim, np.float32))
        present = expect_present
        assert s.num_rows("t") == len(present)
    st_ = s.stats("t")
    assert st_["admitted"] == len(present)
    assert st_["not_admitted"] == not_admitted


@SETTINGS
@given(batches=id_batches, p=st.sampled_from([0.0, 0.3, 0.7, 1.0]), seed=st.integers(0, 2**63))
def test_probability_admission_matches_reference(batches, p, seed):
    s = tn.EmbeddingStore(num_internal_shards=4)
    s.create_table("t", 2, seed=seed, admission="probability", admission_probability=p)
    present = set()
    for b in batches:
        out = s.lookup("t", np.array(b, dtype=np.uint64))
        for k, i in enumerate(b):
            if admitted_by_probability(seed, i, p):
                present.add(i)
                assert s.get_row("t", i) is not None
                np.testing.assert_array_equal(out[k], s.get_row("t", i))
            else:
                np.testing.assert_array_equal(out[k], [0, 0])
                assert s.get_row("t", i) is None
    assert s.num_rows("t") == len(present)


def test_probability_admission_rate_and_stability():
    ids = np.arange(20000, dtype=np.uint64)
    a = tn.EmbeddingStore()
    a.create_table("t", 1, seed=3, admission="probability", admission_probability=0.25)
    a.lookup("t", ids)
    frac = a.num_rows("t") / len(ids)
    assert 0.23 < frac < 0.27
    b = tn.EmbeddingStore(num_internal_shards=3)
    b.create_table("t", 1, seed=3, admission="probability", admission_probability=0.25)
    b.lookup("t", ids[::-1].copy())
    assert b.num_rows("t") == a.num_rows("t")
    for i in range(0, 20000, 97):
        assert (a.get_row("t", i) is None) == (b.get_row("t", i) is None)


def test_non_admitted_gradients_do_not_shift_other_rows():
    """PERSIA regression: dropping non-admitted ids must not misalign gradients."""
    s = tn.EmbeddingStore(num_internal_shards=8)
    s.create_table(
        "t", 4, optimizer="sgd", lr=1.0, init_low=0.0, init_high=0.0, admission="threshold", admission_threshold=2
    )
    admitted = np.array([10, 20, 30, 40], dtype=np.uint64)
    s.lookup("t", admitted)
    s.lookup("t", admitted)  # second sighting -> admitted
    assert s.num_rows("t") == 4
    # Interleave admitted and (new, non-admitted) ids.
    ids = np.array([100, 10, 101, 102, 20, 30, 103, 40, 104], dtype=np.uint64)
    out = s.lookup("t", ids)
    assert s.num_rows("t") == 4
    np.testing.assert_array_equal(out[[0, 2, 3, 6, 8]], np.zeros((5, 4), np.float32))
    grads = np.arange(len(ids) * 4, dtype=np.float32).reshape(len(ids), 4) + 1
    assert s.update("t", ids, grads) == 4
    for pos, i in [(1, 10), (4, 20), (5, 30), (7, 40)]:
        np.testing.assert_array_equal(s.get_row("t", i), -grads[pos])
    for i in [100, 101, 102, 103, 104]:
        assert s.get_row("t", i) is None
    assert s.stats("t")["dropped_grads"] == 5


def test_create_false_does_not_insert_or_count():
    s = tn.EmbeddingStore()
    s.create_table("t", 2, admission="threshold", admission_threshold=1)
    out = s.lookup("t", np.array([5, 6], np.uint64), create=False)
    np.testing.assert_array_equal(out, np.zeros((2, 2), np.float32))
    assert s.num_rows("t") == 0
    s.lookup("t", np.array([5], np.uint64))
    assert s.num_rows("t") == 1


# ---------------------------------------------------------------- eviction


@SETTINGS
@given(batches=id_batches, capacity=st.integers(1, 12))
def test_capacity_lru_matches_reference(batches, capacity):
    """Exact LRU when an internal shard holds <= 64 rows. Order of recency within
    one lookup: existing rows in batch order, then new rows in ascending id order."""
    dim = 2
    s = tn.EmbeddingStore()
    s.create_table("t", dim, seed=9, capacity=capacity, optimizer="sgd", lr=1.0)
    assert s.stats("t")["internal_shards"] == 1
    lru: OrderedDict[int, None] = OrderedDict()
    evicted = 0
    for b in batches:
        out = s.lookup("t", np.array(b, dtype=np.uint64))
        for i in b:
            if i in lru:
                lru.move_to_end(i)
        for i in sorted(set(b) - set(lru)):
            if len(lru) >= capacity:
                lru.popitem(last=False)
                evicted += 1
            lru[i] = None
        init = oracle_rows(dim, 9, b)
        for k in range(len(b)):
            # rows looked up in this batch are either present or were evicted later in it
            np.testing.assert_array_equal(out[k], init[k])
        assert s.num_rows("t") == len(lru)
        for i in range(41):
            assert (s.get_row("t", i) is not None) == (i in lru), (i, list(lru))
        # updates do not change recency
        upd = np.array(b[:3], dtype=np.uint64)
        s.update("t", upd, np.zeros((len(upd), dim), np.float32))
    assert s.stats("t")["evicted"] == evicted


def test_capacity_large_table_approximate_lru_keeps_hot_rows():
    s = tn.EmbeddingStore(num_internal_shards=8)
    s.create_table("t", 4, capacity=20000)
    hot = np.arange(1000, dtype=np.uint64)
    for start in range(1000, 200000, 5000):
        s.lookup("t", hot)
        s.lookup("t", np.arange(start, start + 5000, dtype=np.uint64))
    assert s.num_rows("t") <= 20000
    st_ = s.stats("t")
    assert st_["evicted"] == st_["admitted"] - s.num_rows("t")
    kept_hot = sum(s.get_row("t", int(i)) is not None for i in hot)
    assert kept_hot >= 950  # sampled LRU keeps (nearly) all hot rows


@SETTINGS
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["lookup", "update", "expire"]), st.lists(st.integers(0, 20), min_size=1, max_size=8)
        ),
        min_size=1,
        max_size=14,
    ),
    ttl=st.integers(1, 3),
)
def test_ttl_updates_matches_reference(ops, ttl):
    """Row tick = table update-batch number of its last update; rows created by a
    lookup count as updated by the next batch. Expired when B - tick >= ttl;
    applied lazily on lookup and by expire()."""
    s = tn.EmbeddingStore(num_internal_shards=4)
    s.create_table("t", 2, seed=1, ttl_updates=ttl, optimizer="sgd", lr=1.0)
    B = 0
    tick: dict[int, int] = {}
    expired = 0
    for op, ids in ops:
        arr = np.array(ids, dtype=np.uint64)
        if op == "lookup":
            for i in sorted(set(ids)):
                if i in tick and B - tick[i] >= ttl:
                    del tick[i]
                    expired += 1
                if i not in tick:
                    tick[i] = B + 1
            s.lookup("t", arr)
        elif op == "update":
            B += 1
            for i in set(ids):
                if i in tick:
                    tick[i] = B
            s.update("t", arr, np.zeros((len(ids), 2), np.float32))
        else:
            gone = [i for i, t in tick.items() if B - t >= ttl]
            for i in gone:
                del tick[i]
            expired += len(gone)
            assert s.expire("t") == len(gone)
        assert s.num_rows("t") == len(tick)
        for i in range(21):
            assert (s.get_row("t", i) is not None) == (i in tick)
    assert s.stats("t")["expired"] == expired


def test_ttl_seconds_expire_and_lazy_on_lookup():
    import time

    s = tn.EmbeddingStore()
    s.create_table("t", 2, ttl_seconds=100, optimizer="sgd", lr=1.0, init_low=0.0, init_high=0.0)
    s.lookup("t", np.array([1, 2], np.uint64))
    s.update("t", np.array([1, 2], np.uint64), np.ones((2, 2), np.float32))
    now = time.time()
    assert s.expire("t", now=now + 50) == 0
    s.update("t", np.array([2], np.uint64), np.ones((1, 2), np.float32))
    assert s.expire("t", now=now + 101.5) in (1, 2)  # id 1 certainly expired
    assert s.get_row("t", 1) is None
    assert s.stats("t")["expired"] >= 1
