"""Point-in-time captures (EmbeddingStore.capture, StoreCapture.write), dump's (bytes, sha256),
and checkpoints resharded by loading several filtered files into each new store."""

from __future__ import annotations

import hashlib
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from stores import COUNTERS, TABLES, all_state, assert_state_equal, corrupt_variants, make_store, train

import trillium_native as tn

TABLE_CONFIGS = st.sampled_from(
    [
        dict(optimizer="sgd", dtype="fp32"),
        dict(optimizer="adagrad", dtype="bf16", ttl_updates=50),
        dict(
            optimizer="rowwise_adagrad",
            dtype="fp32",
            admission="threshold",
            admission_threshold=2,
            admission_sketch_width=64,
        ),
        dict(optimizer="adam", dtype="fp16", ttl_seconds=3600),
        dict(optimizer="ftrl", dtype="fp32", capacity=150),
        dict(optimizer="sgd", dtype="fp16", admission="probability", admission_probability=0.5, seed=9),
    ]
)
BATCHES = st.lists(st.lists(st.integers(0, 299), min_size=1, max_size=40), min_size=0, max_size=5)


def step(store, name, dim, ids, seed):
    """One training step of a PS shard: look the batch up, apply a gradient."""
    ids = np.asarray(ids, np.uint64)
    store.lookup(name, ids)
    grads = (np.random.default_rng(seed).standard_normal((len(ids), dim)) * 0.1).astype(np.float32)
    store.update(name, ids, grads)


def trained(cfg, batches, *, threads, shards, dim=5):
    """A store with table "t" of `cfg` after one training step per batch."""
    s = tn.EmbeddingStore(num_internal_shards=shards, threads=threads)
    s.create_table("t", dim, **cfg)
    for k, ids in enumerate(batches):
        step(s, "t", dim, ids, k)
    return s


def counters(store, name):
    s = store.stats(name)
    return {k: s[k] for k in COUNTERS + ["update_batches"]}


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    cfg=TABLE_CONFIGS,
    before=BATCHES,
    after=BATCHES,
    threads=st.sampled_from([1, 2]),
    shards=st.sampled_from([1, 4, 16]),
)
def test_capture_round_trips_exactly_and_later_updates_stay_out(tmp_path_factory, cfg, before, after, threads, shards):
    dim = 5
    s = trained(cfg, before, threads=threads, shards=shards, dim=dim)
    at_capture = all_state(s, "t", range(300))
    stats_at_capture, version_at_capture = counters(s, "t"), s.version
    cap = s.capture()
    assert cap.rows == len(at_capture) == s.num_rows("t")
    assert cap.tables() == ["t"]
    for k, ids in enumerate(after):
        step(s, "t", dim, ids, 100 + k)
    path = tmp_path_factory.mktemp("capture") / "t.snap"
    nbytes, sha = cap.write(path)
    data = path.read_bytes()
    assert nbytes == len(data)
    assert sha == hashlib.sha256(data).hexdigest()
    back = tn.EmbeddingStore(num_internal_shards=3, threads=2)
    back.load(path)
    assert_state_equal(all_state(back, "t", range(300)), at_capture, skip=())
    assert counters(back, "t") == stats_at_capture
    assert back.version == version_at_capture
    assert back.table_config("t") == s.table_config("t")
    # The live store kept everything applied after the capture.
    live = all_state(s, "t", range(300))
    changed = {i for i, row in live.items() if i not in at_capture or row["version"] != at_capture[i]["version"]}
    assert changed == ({i for ids in after for i in ids if i in live} if after else set())
    cap.release()


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    cfg=TABLE_CONFIGS, before=BATCHES, between=BATCHES, threads=st.sampled_from([1, 2]), shards=st.sampled_from([1, 4])
)
def test_a_delta_loaded_on_its_base_is_the_store_at_the_delta(tmp_path_factory, cfg, before, between, threads, shards):
    dim = 5
    s = trained(cfg, before, threads=threads, shards=shards, dim=dim)
    base = s.capture()
    removed = s.stats("t")["evicted"] + s.stats("t")["expired"]
    for k, ids in enumerate(between):
        step(s, "t", dim, ids, 100 + k)
    delta = s.capture(since=base.mark)
    # A delta only when no row left the store since the base (it would come back from the base file).
    assert delta.delta == (s.stats("t")["evicted"] + s.stats("t")["expired"] == removed)
    if delta.delta:  # only the rows the steps since touched
        assert delta.rows <= len({i for ids in between for i in ids})
    at_delta, stats_at_delta, version_at_delta = all_state(s, "t", range(300)), counters(s, "t"), s.version
    d = tmp_path_factory.mktemp("delta")
    base.write(d / "base.snap")
    delta.write(d / "delta.snap")
    back = tn.EmbeddingStore(num_internal_shards=3, threads=2)
    for path in ([d / "base.snap"] if delta.delta else []) + [d / "delta.snap"]:
        back.load(path)
    assert_state_equal(all_state(back, "t", range(300)), at_delta, skip=())
    assert counters(back, "t") == stats_at_delta
    assert back.version == version_at_delta


def test_capture_writes_what_dump_writes(tmp_path):
    s = make_store(num_internal_shards=4)
    train([s], 4, seed=1, num_shards=1)
    with s.capture() as cap:
        size, sha = s.dump(tmp_path / "dump.snap")
        train([s], 2, seed=2, num_shards=1)  # not in the capture
        assert cap.write(tmp_path / "cap.snap") == cap.write(tmp_path / "again.snap")
    dumped, captured = (tmp_path / "dump.snap").read_bytes(), (tmp_path / "cap.snap").read_bytes()
    assert (size, sha) == (len(dumped), hashlib.sha256(dumped).hexdigest())
    # The same bytes but the header's creation time (bytes 28..36) and its checksum (36..40).
    assert dumped[:28] + dumped[40:] == captured[:28] + captured[40:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again.snap", "cap.snap", "dump.snap"]  # no temp files


def test_damaged_capture_file_is_refused(tmp_path):
    s = make_store()
    train([s], 2, seed=5, num_shards=1)
    good = tmp_path / "good.snap"
    s.capture().write(good)
    bad = tmp_path / "bad.snap"
    for what, data in corrupt_variants(good.read_bytes()):
        bad.write_bytes(data)
        t = tn.EmbeddingStore()
        with pytest.raises(ValueError):
            t.load(bad)
        assert t.tables() == [], f"{what}: store modified by a failed load"


def test_release_frees_the_copy(tmp_path):
    s = tn.EmbeddingStore()
    s.create_table("t", 64, optimizer="rowwise_adagrad")
    s.lookup("t", np.arange(20000, dtype=np.uint64))
    cap = s.capture()
    assert cap.rows == 20000
    assert 20000 * (64 * 4 + 8 + 4 + 4) <= cap.memory_bytes < 2 * s.memory_bytes()
    cap.release()
    assert cap.memory_bytes == 0
    cap.release()  # idempotent
    for use in (lambda: cap.write(tmp_path / "x.snap"), lambda: cap.rows, cap.tables):
        with pytest.raises(ValueError, match="released"):
            use()
    with s.capture() as c:
        assert c.memory_bytes > 0
    assert c.memory_bytes == 0
    assert not (tmp_path / "x.snap").exists()


def test_write_errors_are_os_errors(tmp_path):
    s = tn.EmbeddingStore()
    s.create_table("t", 4)
    with pytest.raises(FileNotFoundError):
        s.capture().write(tmp_path / "no" / "such" / "dir.snap")
    with pytest.raises(FileNotFoundError):
        s.dump(tmp_path / "no" / "dir.snap")
    with pytest.raises(TypeError):
        s.capture().write(42)


def test_capture_while_lookups_create_rows(tmp_path):
    """Lookups may run during a capture: each capture holds whole rows, as of some instant
    per internal shard."""
    s = tn.EmbeddingStore(num_internal_shards=8, threads=2)
    s.create_table("t", 16)
    stop = threading.Event()

    def look_up_new_ids():
        start = 0
        while not stop.is_set():
            s.lookup("t", np.arange(start, start + 5000, dtype=np.uint64))
            start += 5000

    th = threading.Thread(target=look_up_new_ids)
    th.start()
    try:
        caps = [s.capture() for _ in range(3)]
    finally:
        stop.set()
        th.join()
    fresh = tn.EmbeddingStore()
    fresh.create_table("t", 16)
    for k, cap in enumerate(caps):
        cap.write(tmp_path / f"c{k}.snap")
        back = tn.EmbeddingStore()
        back.load(tmp_path / f"c{k}.snap")
        assert back.num_rows("t") == cap.rows
        ids = np.arange(s.num_rows("t"), dtype=np.uint64)
        present = back.lookup("t", ids, create=False).any(axis=1)
        assert present.sum() == cap.rows
        # No update ran: every captured row is its id's initial vector.
        np.testing.assert_array_equal(back.lookup("t", ids[present], create=False), fresh.lookup("t", ids[present]))


def reshard(sources, num_new, tmp_path):
    paths = []
    for i, src in enumerate(sources):
        paths.append(tmp_path / f"old{len(sources)}-{i}.snap")
        with src.capture() as cap:
            cap.write(paths[-1])
    new = [tn.EmbeddingStore(num_internal_shards=3) for _ in range(num_new)]
    for j, dst in enumerate(new):
        for p in paths:
            dst.load(p, shard_index=j, num_shards=num_new)
    return new


@pytest.mark.parametrize("old_shards, new_shards", [(2, 3), (3, 1)])
def test_reshard_keeps_every_row_once_with_its_state(tmp_path, old_shards, new_shards):
    old = [make_store(num_internal_shards=4) for _ in range(old_shards)]
    train(old, 6, seed=3, num_shards=old_shards)
    train(old[:1], 2, seed=4, num_shards=old_shards)  # shard 0 (its own ids) sees more update batches
    new = reshard(old, new_shards, tmp_path)
    for name, _ in TABLES:
        rows = {}
        for src in old:
            for i, state in all_state(src, name, range(400)).items():
                assert i not in rows
                rows[i] = (state, src.stats(name)["update_batches"])
        assert sum(d.num_rows(name) for d in new) == len(rows) > 0
        owners = tn.shard_of(np.array(sorted(rows), np.uint64), new_shards)
        for i, owner in zip(sorted(rows), owners, strict=True):
            (state, old_batches), holder = rows[i], new[owner]
            assert all(d.get_row_state(name, i) is None for j, d in enumerate(new) if j != owner)
            got = holder.get_row_state(name, i)
            if "update_batch" in state:
                # Ages in update batches (the TTL by updates) survive the merge.
                new_batches = holder.stats(name)["update_batches"]
                assert (new_batches - got["update_batch"]) % 2**32 == (old_batches - state["update_batch"]) % 2**32
                got.pop("update_batch"), state.pop("update_batch")
            assert_state_equal({i: state}, {i: got}, skip=())
        for k in COUNTERS:
            assert sum(d.stats(name)[k] for d in new) == sum(s.stats(name)[k] for s in old), k
        assert {d.stats(name)["update_batches"] for d in new} == {max(s.stats(name)["update_batches"] for s in old)}
    assert {d.version for d in new} == {max(s.version for s in old)}
