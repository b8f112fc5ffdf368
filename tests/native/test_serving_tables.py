"""Values files (StoreCapture.write_values) and the serving store (ServingTables).

Training is one EmbeddingStore per PS shard, IDs routed by shard_of as the embedding worker
routes them; each shard publishes a values file per version from its own capture. The
files are read back here by an independent reader of the documented format, folded into a
plain dict model (a full file replaces its shard's rows of each table it lists, a delta
upserts), and the ServingTables must equal that model, which must equal the training
stores' read-only float16 lookups, bit for bit. A serving shard's store (a `slice`) must equal
the model's rows whose ID's splitmix64 hash places them on it, whatever the training shards."""

from __future__ import annotations

import hashlib
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from splitmix import mix64
from values_files import read_values

import trillium_native as tn

SHARDS = 2
UNIVERSE = 400  # trained IDs are 0..UNIVERSE-1; lookups also ask for IDs never seen

TABLE_KINDS = [
    dict(dtype="fp32", optimizer="sgd", lr=0.5),
    dict(dtype="fp16", optimizer="adagrad", lr=0.3),
    dict(dtype="bf16", optimizer="rowwise_adagrad", lr=0.3),
    dict(dtype="fp32", optimizer="adam", lr=0.05, admission="probability", admission_probability=0.6, seed=3),
]
TABLES = st.lists(st.tuples(st.sampled_from(range(len(TABLE_KINDS))), st.integers(1, 9)), min_size=1, max_size=3)
OPS = st.lists(
    st.tuples(st.sampled_from(["train", "train", "full", "delta"]), st.integers(0, 2**31)), min_size=1, max_size=8
)


def make_stores(tables):
    """One store per training shard, each with `tables` [(name, dim, kind)]."""
    stores = [tn.EmbeddingStore(num_internal_shards=4, threads=1) for _ in range(SHARDS)]
    for s in stores:
        for name, dim, kind in tables:
            s.create_table(name, dim, init_low=-1.0, init_high=1.0, **TABLE_KINDS[kind])
    return stores


def train(stores, tables, seed):
    """One step: a batch per table, routed to the owning shard's store, looked up and updated."""
    rng = np.random.default_rng(seed)
    for name, dim, _ in tables:
        ids = rng.integers(0, UNIVERSE, size=int(rng.integers(1, 60))).astype(np.uint64)
        grads = rng.standard_normal((len(ids), dim)).astype(np.float32)
        owner = tn.shard_of(ids, SHARDS)
        for sh, store in enumerate(stores):
            m = owner == sh
            if m.any():
                store.lookup(name, ids[m])
                store.update(name, ids[m], grads[m])


def expected(stores, name, ids, out_dtype):
    """What the training stores read for `ids` (zeros for an ID they do not hold), and
    which of them they hold."""
    owner = tn.shard_of(ids, SHARDS)
    dim = stores[0].table_config(name)["dim"]
    out = np.zeros((len(ids), dim), out_dtype)
    held = np.zeros(len(ids), bool)
    for sh, store in enumerate(stores):
        m = owner == sh
        out[m] = store.lookup(name, ids[m], create=False, out_dtype=np.dtype(out_dtype).name)
        held[m] = [store.get_row(name, int(i)) is not None for i in ids[m]]
    return out, held


def owner_of(i):
    return int(tn.shard_of(np.array([i], np.uint64), SHARDS)[0])


def bits(a):
    a = np.ascontiguousarray(a, np.float32)
    return a.view(np.uint32)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    tables=TABLES,
    ops=OPS,
    serve=st.sampled_from(["fp16", "fp32"]),
    threads=st.sampled_from([1, 2]),
    part=st.sampled_from([(0, 1), (1, 2), (2, 3), (0, 3), (3, 4)]),
)
def test_serving_equals_a_dict_model_and_the_training_stores(tmp_path_factory, tables, ops, serve, threads, part):
    tables = [(f"t{k}", dim, kind) for k, (kind, dim) in enumerate(tables)]
    dims = {name: dim for name, dim, _ in tables}
    vtype = np.float16 if serve == "fp16" else np.float32
    stores = make_stores(tables)
    serving = tn.ServingTables(dims, SHARDS, dtype=serve, threads=threads, slice=part)
    index, count = part

    def kept(i: int) -> bool:
        return mix64(i) % count == index

    model = {name: {} for name in dims}  # table -> id -> row (as served, vtype)
    marks = [None] * SHARDS
    version = 0
    d = tmp_path_factory.mktemp("values")
    probe = np.concatenate([np.arange(UNIVERSE + 50, dtype=np.uint64), np.array([2**64 - 1, 2**63], np.uint64)])
    misses_total = {name: 0 for name in dims}
    for op, seed in ops:
        if op == "train":
            train(stores, tables, seed)
            continue
        version += 1
        parts = []
        for sh, store in enumerate(stores):
            since = marks[sh] if op == "delta" else None
            with store.capture(since=since) as cap:
                path = d / f"v{version}-s{sh}.values"
                nbytes, sha = cap.write_values(path, serve)
                assert nbytes == path.stat().st_size and sha == hashlib.sha256(path.read_bytes()).hexdigest()
                marks[sh] = cap.mark
                is_delta, content = read_values(path)
                # Nothing leaves these stores (no eviction, no TTL): a delta whenever asked for.
                assert is_delta == cap.delta == (since is not None)
            parts.append((sh, path))
            assert set(content) == set(dims)
            for name, (ids, rows) in content.items():
                assert (tn.shard_of(ids, SHARDS) == sh).all()
                if not is_delta:
                    model[name] = {i: r for i, r in model[name].items() if owner_of(i) != sh}
                model[name].update(zip(ids.tolist(), rows.copy(), strict=True))
        report = serving.apply(parts, version)
        assert report["version"] == version == serving.version
        # The model is what the training stores hold now, bit for bit.
        for name in dims:
            want, held = expected(stores, name, probe, vtype)
            assert set(np.asarray(probe)[held].tolist()) == set(model[name])
            for i, r in model[name].items():
                assert i < UNIVERSE  # probe[i] == i
                np.testing.assert_array_equal(r.view(np.uint8), want[i].view(np.uint8))
        # The serving store is the model: one call over every table, at one version.
        got, v, misses = serving.lookup([(name, probe) for name in dims])
        assert v == version
        for name, out, miss in zip(dims, got, misses, strict=True):
            assert out.dtype == np.float32 and out.shape == (len(probe), dims[name])
            want = np.zeros((len(probe), dims[name]), np.float32)
            present = np.array([int(i) in model[name] and kept(int(i)) for i in probe])
            for k in np.flatnonzero(present):
                want[k] = model[name][int(probe[k])].astype(np.float32)
            np.testing.assert_array_equal(bits(out), bits(want))
            assert miss == (~present).sum()
            misses_total[name] += miss
    stats = serving.stats()
    for name in dims:
        assert stats[name]["rows"] == sum(kept(i) for i in model[name])
        assert stats[name]["misses"] == misses_total[name]
        assert stats[name]["memory_bytes"] > 0
    assert serving.memory_bytes() >= sum(s["memory_bytes"] for s in stats.values())


def publish(stores, d, version, *, delta_marks=None, dtype="fp16"):
    parts, marks = [], []
    for sh, store in enumerate(stores):
        with store.capture(since=delta_marks[sh] if delta_marks else None) as cap:
            path = d / f"v{version}-s{sh}.values"
            cap.write_values(path, dtype)
            marks.append(cap.mark)
        parts.append((sh, path))
    return parts, marks


def test_a_bad_file_fails_the_whole_apply_and_the_previous_version_serves(tmp_path):
    tables = [("a", 4, 0), ("b", 3, 1)]
    stores = make_stores(tables)
    train(stores, tables, 1)
    serving = tn.ServingTables({"a": 4, "b": 3}, SHARDS)
    parts, marks = publish(stores, tmp_path, 1)
    serving.apply(parts, 1)
    probe = np.arange(UNIVERSE, dtype=np.uint64)
    before = serving.lookup([("a", probe), ("b", probe)])
    train(stores, tables, 2)
    good, _ = publish(stores, tmp_path, 2, delta_marks=marks)
    (sh, path) = good[1]
    data = path.read_bytes()
    bad = tmp_path / "bad.values"
    for damaged, problem in [
        (data[: len(data) // 2], "truncated"),
        (data[:100] + bytes([data[100] ^ 1]) + data[101:], "CRC-32 mismatch"),
        (b"NOTVALUE" + data[8:], "bad magic"),
    ]:
        bad.write_bytes(damaged)
        with pytest.raises(ValueError, match=f"values file .*bad.values: .*{problem}"):
            serving.apply([good[0], (sh, bad)], 2)
    # The file of shard 1 given as shard 0's: its IDs fail the ownership check.
    with pytest.raises(ValueError, match="belongs to training shard 1 of 2, not to shard 0"):
        serving.apply([(0, path)], 2)
    with pytest.raises(ValueError, match="values are fp16.*expected fp32"):
        tn.ServingTables({"a": 4, "b": 3}, SHARDS, dtype="fp32").apply(good, 1)
    with pytest.raises(ValueError, match="not greater than the current version 1"):
        serving.apply(good, 1)
    with pytest.raises(FileNotFoundError):
        serving.apply([(0, tmp_path / "missing.values")], 2)
    assert serving.version == 1
    after = serving.lookup([("a", probe), ("b", probe)])
    assert after[1] == before[1] == 1 and after[2] == before[2]
    for x, y in zip(after[0], before[0], strict=True):
        np.testing.assert_array_equal(x, y)
    serving.apply(good, 2)
    assert serving.version == 2


def test_lookups_never_see_a_mixed_version(tmp_path):
    """Version v holds rows S_v (growing, so deltas add IDs) whose values are all v: every
    lookup call must read every table at the one version it returns."""
    tables = [("a", 4, 0), ("b", 2, 1)]
    stores = make_stores(tables)
    universe = np.arange(3000, dtype=np.uint64)
    owner = tn.shard_of(universe, SHARDS)
    serving = tn.ServingTables({"a": 4, "b": 2}, SHARDS, threads=2)
    rows_at = {0: 0}
    stop, errors, seen = threading.Event(), [], []

    def reader():
        last = 0
        while not stop.is_set():
            got, v, misses = serving.lookup([("a", universe), ("b", universe)])
            n = rows_at.get(v)
            try:
                assert n is not None and v >= last, (v, last)
                for out in got:
                    assert (out[:n] == v).all() and (out[n:] == 0).all(), v
                assert misses == [len(universe) - n] * 2
            except AssertionError as e:
                errors.append(e)
                return
            seen.append(v)
            last = v

    t = threading.Thread(target=reader)
    t.start()
    marks = None
    try:
        for v in range(1, 41):
            n = 1000 + 40 * v
            for name, dim, _ in tables:
                for i in universe[:n]:
                    stores[int(owner[i])].set_row(name, int(i), np.full(dim, v, np.float32))
            rows_at[v] = n
            parts, marks = publish(stores, tmp_path, v, delta_marks=marks if v % 4 else None)
            serving.apply(parts, v)
    finally:
        stop.set()
        t.join()
    assert not errors, errors[0]
    assert len(set(seen)) > 2, "the reader saw too few versions to test anything"


def test_api_edges(tmp_path):
    s = tn.ServingTables({"a": 3}, 1)
    assert (s.version, s.shards, s.dtype, s.tables) == (0, 1, "fp16", {"a": 3})
    got, v, misses = s.lookup([("a", np.array([], np.uint64)), ("a", np.array([7], np.uint64))])
    assert [g.shape for g in got] == [(0, 3), (1, 3)] and v == 0 and misses == [0, 1]
    assert (got[1] == 0).all()
    with pytest.raises(KeyError):
        s.lookup([("zz", np.array([1], np.uint64))])
    with pytest.raises(TypeError):
        s.lookup([("a", np.array([1], np.int64))])
    with pytest.raises(ValueError):
        tn.ServingTables({"a": 3}, 0)
    with pytest.raises(ValueError):
        tn.ServingTables({"a": 3}, 1, dtype="bf16")
    with pytest.raises(ValueError):
        tn.ServingTables({"a": 0}, 1)
    stats = s.stats()["a"]
    assert stats["memory_bytes"] > 0
    assert {k: stats[k] for k in ("rows", "overlay_rows", "lookups", "misses")} == dict(
        rows=0, overlay_rows=0, lookups=1, misses=1
    )
    assert "ServingTables" in repr(s)
    store = tn.EmbeddingStore(threads=1)
    store.create_table("a", 3)
    cap = store.capture()
    with pytest.raises(ValueError):
        cap.write_values(tmp_path / "x", "bf16")
    cap.release()
    with pytest.raises(ValueError, match="released"):
        cap.write_values(tmp_path / "x")
