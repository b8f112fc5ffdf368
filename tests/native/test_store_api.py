"""API behaviour: init determinism, precision, hashing, concurrency, introspection,
and clean errors for bad inputs."""

from __future__ import annotations

import json
import math
import threading

import numpy as np
import pytest
from aiokafka.partitioner import DefaultPartitioner
from hypothesis import given
from hypothesis import strategies as st
from splitmix import M64, mix64

import trillium_native as tn

# ---------------------------------------------------------------- routing / hashing


def test_shard_of_matches_documented_formula():
    ids = np.array([0, 1, 2, 3, 12345678901234567890, M64, 1 << 63], dtype=np.uint64)
    for n in (1, 2, 3, 7, 1000):
        got = tn.shard_of(ids, n)
        assert got.dtype == np.uint32
        assert got.tolist() == [mix64(int(i)) % n for i in ids]
    # frozen values (must never change across releases)
    assert tn.shard_of(np.arange(8, dtype=np.uint64), 4).tolist() == [mix64(i) % 4 for i in range(8)]
    assert mix64(1) == 0x5692161D100B05E5


def test_shard_of_is_balanced():
    counts = np.bincount(tn.shard_of(np.arange(100000, dtype=np.uint64), 7), minlength=7)
    assert counts.min() > 13500 and counts.max() < 15100


def test_hash_ids_and_hash_ints_stable():
    a = tn.hash_ids("user", ["42", "alice", "", "é"])
    assert a.dtype == np.uint64 and len(a) == 4
    assert np.array_equal(a, tn.hash_ids("user", ("42", "alice", "", "é")))
    assert np.array_equal(a[:2], tn.hash_ids("user", [b"42", b"alice"]))
    assert tn.hash_ids("item", ["42"])[0] != a[0]  # namespaces differ
    assert tn.hash_ids("ab", ["c"])[0] != tn.hash_ids("a", ["bc"])[0]  # separator byte
    ints = np.array([42, -7, 0, 2**63 - 1, -(2**63)], dtype=np.int64)
    h = tn.hash_ints("user", ints)
    assert np.array_equal(h, tn.hash_ids("user", [str(int(v)) for v in ints]))
    assert np.array_equal(tn.hash_ints("user", ints[:3].astype(np.int32)), h[:3])
    # frozen value: xxh3_64(b"user\x0042")
    assert int(tn.hash_ids("user", ["42"])[0]) == 16274034637320737580


def test_hash_strings_equals_hash_ids_over_arrow_layout_buffers():
    values = ["42", "alice", "", "é", "x" * 300]
    encoded = [v.encode() for v in values]
    data = np.frombuffer(b"pad" + b"".join(encoded), np.uint8)
    offsets = 3 + np.concatenate([[0], np.cumsum([len(e) for e in encoded])])  # a sliced column
    expect = tn.hash_ids("user", values)
    assert np.array_equal(tn.hash_strings("user", data, offsets.astype(np.int32)), expect)
    assert np.array_equal(tn.hash_strings("user", data, offsets.astype(np.int64)), expect)
    assert len(tn.hash_strings("user", data, offsets[:1].astype(np.int32))) == 0
    # Long enough to be hashed in parallel: still hash_ids, value by value.
    many = [str(i) for i in range(200_000)]
    lengths = np.array([len(v) for v in many])
    data = np.frombuffer("".join(many).encode(), np.uint8)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    assert np.array_equal(tn.hash_strings("c", data, offsets), tn.hash_ids("c", many))


def test_hash_strings_errors_name_the_bad_input():
    data = np.frombuffer(b"abc", np.uint8)
    with pytest.raises(ValueError, match="at least one"):
        tn.hash_strings("n", data, np.zeros(0, np.int32))
    with pytest.raises(ValueError, match=r"offsets\[2\] = 1 is below"):
        tn.hash_strings("n", data, np.array([0, 2, 1], np.int32))
    with pytest.raises(ValueError, match="past the 3 data bytes"):
        tn.hash_strings("n", data, np.array([0, 4], np.int64))
    with pytest.raises(TypeError, match="uint8"):
        tn.hash_strings("n", np.zeros(3, np.int8), np.array([0, 1], np.int32))
    with pytest.raises(TypeError, match="int64"):
        tn.hash_strings("n", data, np.array([0.0, 1.0]))


def test_hash_cells_is_hash_ids_of_each_cells_parts():
    cells = ["a|b||c", None, "", "x", "|", "é|é|é|é", ("t" * 300)]
    for separator, max_len in ((None, None), ("|", None), ("|", 2), ("||", 1), (None, 0)):
        lengths, ids = tn.hash_cells("s", cells, separator, max_len)
        want_lengths, want_texts = [], []
        for cell in cells:
            parts = [] if not cell else [cell] if separator is None else [p for p in cell.split(separator) if p]
            parts = parts[:max_len] if max_len is not None else parts
            want_lengths.append(len(parts))
            want_texts += parts
        assert lengths.dtype == np.int32 and lengths.tolist() == want_lengths
        assert np.array_equal(ids, tn.hash_ids("s", want_texts) if want_texts else np.zeros(0, np.uint64))
    assert np.array_equal(tn.hash_cells("s", tuple(cells))[1], tn.hash_cells("s", cells)[1])
    with pytest.raises(ValueError, match="separator"):
        tn.hash_cells("s", cells, "")
    with pytest.raises(TypeError, match=r"cells\[1\] must be str or None, got int"):
        tn.hash_cells("s", ["a", 1])


def test_parse_floats_reads_what_rust_reads_and_names_the_rest():
    cells = [
        "1",
        "-2.5",
        "1e-7",
        ".5",
        "+3",
        "1.7976931348623157e308",
        None,
        "",
        " 4",
        "1_000",
        "x",
        "nan",
        "-inf",
        "1e400",
        "0x1p3",
        "٣",
    ]
    values, odd = tn.parse_floats(cells)
    assert values.dtype == np.float64 and odd.dtype == np.int64
    assert values[:6].tolist() == [float(c) for c in cells[:6]]  # the same double as Python's float()
    assert np.isnan(values[6:]).all()
    assert odd.tolist() == list(range(8, len(cells)))  # missing cells are not odd: everything else after is


def test_kafka_partitions_are_the_default_partitioners():
    rng = np.random.default_rng(5)
    keys = [rng.bytes(int(n)) for n in rng.integers(0, 40, 2000)] + [b"", b"r2-17", "é".encode()]
    for partitions in (1, 3, 4, 7, 64):
        want = [DefaultPartitioner()(k, list(range(partitions)), []) for k in keys]
        got = tn.kafka_partitions(keys, partitions)
        assert got.dtype == np.uint32 and got.tolist() == want
    with pytest.raises(TypeError, match=r"keys\[1\] must be bytes"):
        tn.kafka_partitions([b"a", "b"], 4)
    with pytest.raises(ValueError, match="partitions"):
        tn.kafka_partitions([b"a"], 0)


@given(
    st.lists(st.tuples(st.one_of(st.none(), st.text()), st.one_of(st.none(), st.floats(allow_nan=True))), max_size=20)
)
def test_json_rows_read_back_as_the_values(rows):
    texts = [t for t, _ in rows]
    numbers = np.array([0.0 if v is None else v for _, v in rows], np.float64)
    missing = np.array([v is None for _, v in rows], bool)
    template = [b'{"t":', 0, b',"e":', 1, b',"n":', 2, b"}"]
    out = tn.json_rows(template, [(texts, False), ([t.encode() if t else t for t in texts], True), (numbers, missing)])
    assert len(out) == len(rows)
    for message, (text, number) in zip(out, rows, strict=True):
        event = json.loads(message)  # Python's reader takes NaN and Infinity, as json.dumps writes them
        assert event["t"] == text and event["e"] == (text or None)
        assert (
            event["n"] is None
            if number is None
            else (math.isnan(event["n"]) if math.isnan(number) else event["n"] == number)
        )


def test_json_rows_refuse_what_they_cannot_write():
    with pytest.raises(TypeError, match=r"columns\[0\]\[1\] must be str, bytes or None"):
        tn.json_rows([0], [(["a", 3], False)])
    with pytest.raises(TypeError, match=r"template\[1\] must be bytes or int"):
        tn.json_rows([0, "}"], [(["a"], False)])
    with pytest.raises(ValueError, match="column 1 has 2 rows"):
        tn.json_rows([0, 1], [(["a"], False), (np.zeros(2), np.zeros(2, bool))])
    with pytest.raises(ValueError, match="names column 2 of 1"):
        tn.json_rows([2], [(["a"], False)])
    with pytest.raises(TypeError, match="dtype float64"):
        tn.json_rows([0], [(np.zeros(1, np.float32), np.zeros(1, bool))])


def test_hash_inputs_errors():
    with pytest.raises(TypeError):
        tn.hash_ids("n", "abc")
    with pytest.raises(TypeError):
        tn.hash_ids("n", ["a", 3])
    with pytest.raises(TypeError):
        tn.hash_ints("n", np.array([1.5]))
    with pytest.raises(TypeError):
        tn.hash_ints("n", [1, 2])
    with pytest.raises(TypeError):
        tn.shard_of(np.array([1, 2], np.int64), 3)
    with pytest.raises(ValueError):
        tn.shard_of(np.array([1], np.uint64), 0)


# ---------------------------------------------------------------- init / precision


@pytest.mark.parametrize(
    "init",
    [
        dict(initializer="uniform", init_low=-0.5, init_high=0.25),
        dict(initializer="normal", init_mean=1.0, init_std=0.1),
    ],
)
def test_deterministic_init_across_stores_and_shards(init):
    ids = np.array([0, 1, 17, 2**40, M64], dtype=np.uint64)
    a = tn.EmbeddingStore(num_internal_shards=1, threads=1)
    b = tn.EmbeddingStore(num_internal_shards=13, threads=2)
    a.create_table("t", 16, seed=77, **init)
    b.create_table("t", 16, seed=77, **init)
    ra = a.lookup("t", ids)
    rb = b.lookup("t", ids[::-1].copy())[::-1]
    np.testing.assert_array_equal(ra, rb)
    c = tn.EmbeddingStore()
    c.create_table("t", 16, seed=78, **init)
    assert not np.array_equal(ra, c.lookup("t", ids))
    assert len({r.tobytes() for r in ra}) == len(ids)
    big = tn.EmbeddingStore()
    big.create_table("t", 8, seed=1, **init)
    v = big.lookup("t", np.arange(20000, dtype=np.uint64))
    if init["initializer"] == "uniform":
        assert v.min() >= -0.5 and v.max() < 0.25
        assert abs(v.mean() - (-0.125)) < 0.01
    else:
        assert abs(v.mean() - 1.0) < 0.01 and abs(v.std() - 0.1) < 0.01


@pytest.mark.parametrize("dtype,rtol", [("fp16", 2e-3), ("bf16", 1.6e-2)])
def test_half_precision_storage(dtype, rtol):
    ids = np.arange(200, dtype=np.uint64)
    full = tn.EmbeddingStore()
    half = tn.EmbeddingStore()
    for s, dt in ((full, "fp32"), (half, dtype)):
        s.create_table("t", 8, dtype=dt, optimizer="adagrad", lr=0.01, init_low=-1, init_high=1, seed=3)
    a, b = full.lookup("t", ids), half.lookup("t", ids)
    assert b.dtype == np.float32
    np.testing.assert_allclose(b, a, rtol=rtol, atol=1e-6)
    rng = np.random.default_rng(0)
    for _ in range(5):
        g = rng.standard_normal((200, 8)).astype(np.float32)
        full.update("t", ids, g)
        half.update("t", ids, g)
    np.testing.assert_allclose(half.lookup("t", ids), full.lookup("t", ids), rtol=3 * rtol, atol=1e-3)
    h16 = half.lookup("t", ids, out_dtype="float16")
    assert h16.dtype == np.float16 and h16.shape == (200, 8)
    np.testing.assert_allclose(h16.astype(np.float32), half.lookup("t", ids), rtol=2e-3, atol=1e-4)
    assert half.memory_bytes("t") < full.memory_bytes("t")


# ---------------------------------------------------------------- concurrency


def test_concurrent_updates_sum_exactly():
    s = tn.EmbeddingStore(num_internal_shards=8, threads=2)
    s.create_table("t", 4, optimizer="sgd", lr=1.0, init_low=0.0, init_high=0.0)
    n_threads, iters, universe = 6, 60, 300
    expected = np.zeros((universe, 4), np.float64)
    plans = []
    for t in range(n_threads):
        rng = np.random.default_rng(t)
        steps = []
        for _ in range(iters):
            ids = rng.integers(0, universe, size=128).astype(np.uint64)
            g = rng.integers(-3, 4, size=(128, 4)).astype(np.float32)  # exact in fp32
            np.add.at(expected, ids.astype(np.int64), g)
            steps.append((ids, g))
        plans.append(steps)
    errors = []

    def worker(steps):
        try:
            for ids, g in steps:
                out = s.lookup("t", ids)
                assert out.shape == (len(ids), 4)
                s.update("t", ids, g)
        except Exception as e:  # pragma: no cover
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(p,)) for p in plans]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    got = s.lookup("t", np.arange(universe, dtype=np.uint64), create=False)
    present = np.array([s.get_row("t", i) is not None for i in range(universe)])
    np.testing.assert_array_equal(got[present], -expected[present].astype(np.float32))
    assert s.stats("t")["update_batches"] == n_threads * iters
    assert s.version == n_threads * iters


@pytest.mark.parametrize("admission", [dict(), dict(admission="threshold", admission_threshold=2)])
def test_concurrent_inserts_create_each_row_once(admission):
    s = tn.EmbeddingStore(num_internal_shards=4, threads=2)
    s.create_table("t", 3, seed=5, **admission)
    universe = 5000
    errors = []

    def worker(seed):
        try:
            rng = np.random.default_rng(seed)
            for _ in range(40):
                ids = rng.integers(0, universe, size=2000).astype(np.uint64)
                out = s.lookup("t", ids)
                # duplicates within a batch always agree
                order = np.argsort(ids, kind="stable")
                a, b = ids[order], out[order]
                same = a[1:] == a[:-1]
                assert np.array_equal(b[1:][same], b[:-1][same])
        except Exception as e:  # pragma: no cover
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    present = [i for i in range(universe) if s.get_row("t", i) is not None]
    assert s.num_rows("t") == len(present) == s.stats("t")["admitted"]
    oracle = tn.EmbeddingStore(num_internal_shards=1, threads=1)
    oracle.create_table("t", 3, seed=5)
    ids = np.array(present, dtype=np.uint64)
    np.testing.assert_array_equal(s.lookup("t", ids, create=False), oracle.lookup("t", ids))


# ---------------------------------------------------------------- introspection


def test_introspection():
    s = tn.EmbeddingStore(num_internal_shards=4, threads=2)
    assert s.threads == 2 and s.num_internal_shards == 4
    s.create_table("a", 8, optimizer="rowwise_adagrad")
    s.create_table("b", 3, dtype="fp16", capacity=10, ttl_seconds=5)
    assert s.tables() == ["a", "b"] and "a" in s and "zz" not in s
    m0 = s.memory_bytes("a")
    s.lookup("a", np.arange(50000, dtype=np.uint64))
    assert s.num_rows("a") == 50000 and len(s) == 50000
    m1 = s.memory_bytes("a")
    assert m1 > m0 + 50000 * 8 * 4
    assert m1 < 50000 * (8 * 4 + 64) * 1.6
    assert s.memory_bytes() >= m1 + s.memory_bytes("b")
    st_ = s.stats("a")
    for k in [
        "rows",
        "memory_bytes",
        "admitted",
        "evicted",
        "expired",
        "nan_grads_skipped",
        "lookups",
        "updates",
        "version",
    ]:
        assert k in st_
    assert st_["lookups"] == 50000 and st_["admitted"] == 50000
    cfg = s.table_config("b")
    assert cfg["dtype"] == "fp16" and cfg["capacity"] == 10 and cfg["ttl_seconds"] == 5 and cfg["dim"] == 3
    assert s.get_row("a", 10**12) is None
    s.set_row("a", 10**12, np.arange(8, dtype=np.float64))
    np.testing.assert_array_equal(s.get_row("a", 10**12), np.arange(8, dtype=np.float32))
    s.drop_table("b")
    assert s.tables() == ["a"]
    assert "EmbeddingStore" in repr(s)


def test_readonly_and_noncontiguous_inputs():
    s = tn.EmbeddingStore()
    s.create_table("t", 4, optimizer="sgd", lr=1.0, init_low=0.0, init_high=0.0)
    base = np.arange(20, dtype=np.uint64)
    ids = base[::2]  # non-contiguous
    ro = base.copy()
    ro.setflags(write=False)
    r1 = s.lookup("t", ids)
    r2 = s.lookup("t", ro)
    assert r1.shape == (10, 4) and r2.shape == (20, 4)
    g = np.ones((10, 8), np.float32)[:, ::2]  # non-contiguous grads
    g.setflags(write=False)
    assert s.update("t", ids, g) == 10
    np.testing.assert_array_equal(s.get_row("t", 2), [-1, -1, -1, -1])
    gf = np.asfortranarray(np.full((10, 4), 2.0, np.float32))
    assert s.update("t", ids, gf) == 10
    np.testing.assert_array_equal(s.get_row("t", 2), [-3, -3, -3, -3])
    assert s.lookup("t", np.array([], np.uint64)).shape == (0, 4)
    assert s.update("t", np.array([], np.uint64), np.zeros((0, 4), np.float32)) == 0


@pytest.mark.parametrize("threads", [1, 2])
def test_lookup_tables_is_each_tables_lookup_in_turn(threads):
    """A PS shard's request in one call: the rows the per-table lookups give, flat, in order."""
    s, per_table = tn.EmbeddingStore(threads=threads), tn.EmbeddingStore(threads=threads)
    for store in (s, per_table):
        store.create_table("a", 4, seed=1)
        store.create_table("b", 2, seed=2, dtype="fp16")
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 2**64, 50, np.uint64), rng.integers(0, 2**64, 7, np.uint64)
    for out_dtype in ("float32", "float16"):
        rows, dims = s.lookup_tables(["a", "b", "a"], [50, 7, 0], np.concatenate([a, b]), out_dtype=out_dtype)
        expected = [per_table.lookup(t, ids, out_dtype=out_dtype).ravel() for t, ids in (("a", a), ("b", b))]
        assert dims == [4, 2, 4] and rows.dtype == out_dtype
        np.testing.assert_array_equal(rows, np.concatenate(expected))
    unknown = np.array([7], np.uint64)
    rows, _ = s.lookup_tables(["b"], [1], unknown, create=False)
    assert rows.tolist() == [0, 0] and s.num_rows("b") == 7  # read-only: zeros, no row made
    rows, dims = s.lookup_tables([], [], np.array([], np.uint64))
    assert rows.shape == (0,) and dims == []
    bad = [
        (ValueError, "3 ids do not fit the counts \\[2\\] of tables", lambda: s.lookup_tables(["a"], [2], a[:3])),
        (ValueError, "do not fit", lambda: s.lookup_tables(["a", "b"], [3], a[:3])),
        (ValueError, "a count must be >= 0", lambda: s.lookup_tables(["a", "b"], [4, -1], a[:3])),
        (KeyError, "missing", lambda: s.lookup_tables(["missing"], [3], a[:3])),
        (TypeError, "uint64", lambda: s.lookup_tables(["a"], [3], a[:3].astype(np.int64))),
        (ValueError, "out_dtype", lambda: s.lookup_tables(["a"], [3], a[:3], out_dtype="float64")),
    ]
    for exc, match, fn in bad:
        with pytest.raises(exc, match=match):
            fn()


# ---------------------------------------------------------------- errors


def test_bad_inputs_raise_clean_errors():
    s = tn.EmbeddingStore()
    s.create_table("t", 4)
    ids = np.array([1, 2], np.uint64)
    cases = [
        (KeyError, lambda: s.lookup("missing", ids)),
        (KeyError, lambda: s.update("missing", ids, np.zeros((2, 4), np.float32))),
        (KeyError, lambda: s.stats("missing")),
        (KeyError, lambda: s.drop_table("missing")),
        (TypeError, lambda: s.lookup("t", ids.astype(np.int64))),
        (TypeError, lambda: s.lookup("t", [1, 2])),
        (ValueError, lambda: s.lookup("t", ids.reshape(2, 1))),
        (ValueError, lambda: s.lookup("t", ids, out_dtype="float64")),
        (TypeError, lambda: s.update("t", ids, np.zeros((2, 4), np.float64))),
        (ValueError, lambda: s.update("t", ids, np.zeros((3, 4), np.float32))),
        (ValueError, lambda: s.update("t", ids, np.zeros((2, 5), np.float32))),
        (ValueError, lambda: s.update("t", ids, np.zeros(8, np.float32))),
        (ValueError, lambda: s.create_table("t", 4)),
        (ValueError, lambda: s.create_table("z", 0)),
        (ValueError, lambda: s.create_table("z", -3)),
        (ValueError, lambda: s.create_table("z", 4, optimizer="rmsprop")),
        (ValueError, lambda: s.create_table("z", 4, dtype="int8")),
        (ValueError, lambda: s.create_table("z", 4, admission="sometimes")),
        (ValueError, lambda: s.create_table("z", 4, initializer="xavier")),
        (ValueError, lambda: s.create_table("z", 4, admission="threshold", admission_threshold=0)),
        (ValueError, lambda: s.create_table("z", 4, admission="probability", admission_probability=1.5)),
        (ValueError, lambda: s.create_table("z", 4, capacity=0)),
        (ValueError, lambda: s.create_table("z", 4, ttl_updates=-1)),
        (ValueError, lambda: s.create_table("z", 4, lr=float("nan"))),
        (ValueError, lambda: s.create_table("z", 4, weight_bound=-1.0)),
        (ValueError, lambda: s.create_table("z", 4, init_low=1.0, init_high=0.0)),
        (ValueError, lambda: s.create_table("z", 4, optimizer="ftrl", weight_decay=0.1)),
        (ValueError, lambda: s.create_table("z", 4, beta1=1.0)),
        (ValueError, lambda: s.create_table("", 4)),
        (ValueError, lambda: s.set_row("t", 1, np.zeros(3, np.float32))),
        (ValueError, lambda: s.set_row("t", -1, np.zeros(4, np.float32))),
        (TypeError, lambda: s.get_row("t", "x")),
        (ValueError, lambda: s.load("/nonexistent", shard_index=3, num_shards=2)),
        (ValueError, lambda: s.load("/nonexistent", shard_index=0)),
        (ValueError, lambda: tn.EmbeddingStore(num_internal_shards=0)),
        (ValueError, lambda: tn.EmbeddingStore(threads=0)),
    ]
    for exc, fn in cases:
        with pytest.raises(exc):
            fn()
    assert s.tables() == ["t"]
