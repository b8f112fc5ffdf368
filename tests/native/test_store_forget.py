"""Forgetting IDs (GDPR Art. 17) through trillium_native: a live store's rows (in RAM and in a
disk tier), a snapshot's and a values file's. The oracles are the rows read before forgetting,
a store that never saw the IDs, hashlib, and the files' own bytes."""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest

import trillium_native as tn

IDS = np.arange(1, 401, dtype=np.uint64) * 7919
GONE = np.concatenate([IDS[::5], IDS[:10:5], np.array([1, 2], np.uint64)])  # two repeats, two unknown
N_GONE = len(IDS[::5])
DIMS = {"user": 4, "item": 3, "cold": 4}


def make_store(tmp_path) -> tn.EmbeddingStore:
    """Three trained tables: Adam, Adagrad, and one with a disk tier of ~40 resident rows."""
    s = tn.EmbeddingStore(num_internal_shards=4, threads=2)
    s.create_table("user", DIMS["user"], optimizer="adam", lr=0.05, seed=3)
    s.create_table("item", DIMS["item"], optimizer="adagrad", lr=0.1)
    s.create_table("cold", DIMS["cold"], memory_budget_bytes=40 * 40, disk=tmp_path / "spill")
    rng = np.random.default_rng(0)
    for name, dim in DIMS.items():
        s.lookup(name, IDS, create=True)
        s.update(name, IDS, (rng.standard_normal((len(IDS), dim)) * 0.1).astype(np.float32))
    return s


def rows_of(s: tn.EmbeddingStore, name: str) -> dict[int, np.ndarray | None]:
    return {int(i): s.get_row(name, int(i)) for i in IDS}


def check_forgotten(got: dict, before: dict, gone: np.ndarray) -> None:
    gone_set = {int(i) for i in gone}
    for i, row in got.items():
        if i in gone_set:
            assert row is None, f"id {i} was forgotten"
        else:
            np.testing.assert_array_equal(row, before[i], err_msg=f"id {i}")


def sha256_of(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_forget_removes_rows_in_ram_and_on_disk(tmp_path):
    s = make_store(tmp_path)
    assert s.stats("cold")["disk_rows"] > 300, "most of the cold table's rows are on disk"
    for name in DIMS:
        before = rows_of(s, name)
        assert s.forget(name, GONE) == N_GONE
        check_forgotten(rows_of(s, name), before, GONE)
        st = s.stats(name)
        assert (st["rows"], st["forgotten"], st["evicted"], st["expired"]) == (len(IDS) - N_GONE, N_GONE, 0, 0)
        assert s.forget(name, GONE) == 0
    assert s.stats("cold")["disk_rows"] + s.stats("cold")["resident_rows"] == len(IDS) - N_GONE
    # Looked up again: a new row, as in a store that never saw the ID (fresh Adam state).
    fresh = tn.EmbeddingStore(threads=1)
    fresh.create_table("user", DIMS["user"], optimizer="adam", lr=0.05, seed=3)
    again = IDS[:10:5]
    np.testing.assert_array_equal(s.lookup("user", again), fresh.lookup("user", again))
    state = s.get_row_state("user", int(again[0]))
    assert state["step"] == 0 and not state["m"].any() and not state["v"].any()
    with pytest.raises(KeyError):
        s.forget("nope", GONE)
    with pytest.raises(TypeError):
        s.forget("user", GONE.astype(np.int64))


def test_a_capture_after_a_forget_is_full(tmp_path):
    s = make_store(tmp_path)
    with s.capture() as c:
        mark = c.mark
    s.update("user", IDS[:5], np.ones((5, 4), np.float32))
    with s.capture(since=mark) as d:
        assert d.delta
    s.forget("item", IDS[:1])
    with s.capture(since=mark) as e:
        assert not e.delta, "a delta cannot say that a row is gone"
        assert e.rows == 3 * len(IDS) - 1
        after = e.mark
    with s.capture(since=after) as f:
        assert f.delta


def test_forget_in_snapshot_full_and_delta(tmp_path):
    s = make_store(tmp_path)
    base = tmp_path / "base.snap"
    with s.capture() as c:
        c.write(base)
        mark = c.mark
    s.update("user", IDS[:50], np.full((50, 4), 0.5, np.float32))
    delta = tmp_path / "delta.snap"
    with s.capture(since=mark) as d:
        assert d.delta
        d.write(delta)
    before = {name: rows_of(s, name) for name in DIMS}
    ids = {"user": GONE, "cold": GONE, "absent": np.array([5], np.uint64)}
    n, size, sha = tn.forget_in_snapshot(base, tmp_path / "base2.snap", ids)
    assert (n, size, sha) == (2 * N_GONE, (tmp_path / "base2.snap").stat().st_size, sha256_of(tmp_path / "base2.snap"))
    n, _, sha = tn.forget_in_snapshot(delta, tmp_path / "delta2.snap", ids)
    assert (n, sha) == (len(IDS[:50:5]), sha256_of(tmp_path / "delta2.snap"))
    flags = struct.unpack_from("<I", (tmp_path / "delta2.snap").read_bytes(), 12)[0]
    assert flags & 1, "a delta stays a delta"
    back = tn.EmbeddingStore(num_internal_shards=2, threads=1)
    back.load(tmp_path / "base2.snap")
    back.load(tmp_path / "delta2.snap")
    check_forgotten(rows_of(back, "user"), before["user"], GONE)
    check_forgotten(rows_of(back, "cold"), before["cold"], GONE)
    check_forgotten(rows_of(back, "item"), before["item"], np.array([], np.uint64))
    assert back.version == s.version


def test_forget_in_snapshot_in_place_and_a_corrupt_source(tmp_path):
    s = make_store(tmp_path)
    p = tmp_path / "s.snap"
    s.dump(p)
    before = rows_of(s, "item")
    good = p.read_bytes()
    # Nothing to forget: the same bytes again.
    assert tn.forget_in_snapshot(p, tmp_path / "same.snap", {})[1:] == (len(good), hashlib.sha256(good).hexdigest())
    assert (tmp_path / "same.snap").read_bytes() == good
    bad = tmp_path / "bad.snap"
    bad.write_bytes(good[: len(good) // 2] + bytes([good[len(good) // 2] ^ 1]) + good[len(good) // 2 + 1 :])
    with pytest.raises(ValueError, match="corrupt"):
        tn.forget_in_snapshot(bad, tmp_path / "out.snap", {"item": GONE})
    assert not (tmp_path / "out.snap").exists()
    n, _, sha = tn.forget_in_snapshot(p, p, {"item": GONE})
    assert (n, sha) == (N_GONE, sha256_of(p))
    back = tn.EmbeddingStore(threads=1)
    back.load(p)
    check_forgotten(rows_of(back, "item"), before, GONE)


def test_forget_in_values_then_serve(tmp_path):
    s = make_store(tmp_path)
    src, dst = tmp_path / "v.values", tmp_path / "w.values"
    with s.capture() as c:
        c.write_values(src, "fp32")
        mark = c.mark
    before = {name: rows_of(s, name) for name in DIMS}
    n, size, sha = tn.forget_in_values(src, dst, {"user": GONE, "absent": GONE})
    assert (n, size, sha) == (N_GONE, dst.stat().st_size, sha256_of(dst))
    serving = tn.ServingTables(DIMS, 1, dtype="fp32")
    serving.apply([(0, dst)], 1)
    got, version, misses = serving.lookup([(name, IDS) for name in DIMS])
    assert version == 1 and misses == [N_GONE, 0, 0]
    gone = np.isin(IDS, GONE)
    assert not got[0][gone].any(), "a forgotten ID reads as zeros"
    for (name, dim), out in zip(DIMS.items(), got, strict=True):
        zero = gone if name == "user" else np.zeros(len(IDS), bool)
        want = np.stack(
            [np.zeros(dim, np.float32) if z else before[name][int(i)] for i, z in zip(IDS, zero, strict=True)]
        )
        np.testing.assert_array_equal(out, want, err_msg=name)
    # A delta stays one (header byte 13: the flags); a damaged file is refused, nothing written.
    s.update("user", IDS[:10], np.ones((10, 4), np.float32))
    with s.capture(since=mark) as d:
        assert d.delta
        d.write_values(src, "fp16")
    assert src.read_bytes()[13] & 1
    assert tn.forget_in_values(src, src, {"user": GONE})[0] == len(IDS[:10:5])
    assert src.read_bytes()[13] & 1, "the delta flag kept"
    raw = bytearray(src.read_bytes())
    raw[48 + 8 * 8 + 4] ^= 0x20  # a value of "user" (its 8 IDs from byte 48)
    src.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="CRC-32 mismatch"):
        tn.forget_in_values(src, tmp_path / "x.values", {"user": GONE})
    assert not (tmp_path / "x.values").exists()
