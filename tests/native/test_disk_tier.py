"""The disk tier (create_table's `memory_budget_bytes` and `disk`): a table with a tiny RAM
budget answers exactly as the same table all in RAM — lookups, updates, optimizer state,
versions, deltas, counters, eviction and TTL, captures, dumps, deltas of captures and
reshards by filtered loads — for every optimizer, dtype, admission and eviction setting."""

from __future__ import annotations

import itertools
import os
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from stores import COUNTERS, all_state, assert_state_equal

import trillium_native as tn

UNIVERSE = 90
OPTIMIZERS = ["sgd", "adagrad", "rowwise_adagrad", "adam", "ftrl"]
DTYPES = ["fp32", "fp16", "bf16"]
POLICIES = [
    {},
    # capacity <= 64: one internal shard with exact LRU, so the victims are the all-RAM table's
    dict(capacity=40, ttl_seconds=3600),
    dict(ttl_updates=4, admission="threshold", admission_threshold=2, admission_sketch_width=64),
    dict(capacity=25, admission="probability", admission_probability=0.6, ttl_updates=6),
]

IDS = st.lists(st.integers(0, UNIVERSE - 1), min_size=1, max_size=24)
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("lookup"), IDS, st.booleans()),
        st.tuples(st.just("update"), IDS, st.integers(0, 2**16)),
        st.tuples(st.just("set_row"), st.integers(0, UNIVERSE - 1), st.integers(0, 2**16)),
        st.tuples(st.just("expire"), st.sampled_from([10, 10**6])),
        st.tuples(st.just("delta"), st.integers(0, 40)),
        st.tuples(st.just("restore"), st.sampled_from(["capture", "dump", "delta"])),
    ),
    min_size=1,
    max_size=30,
)

_dirs = itertools.count()


def tier(tmp_path_factory, budget_rows: int) -> dict:
    # ~100 bytes a row at these dims: budget_rows rows or fewer stay in RAM per store
    return dict(memory_budget_bytes=100 * budget_rows, disk=str(tmp_path_factory.mktemp(f"tier{next(_dirs)}")))


def make(cfg: dict, shards: int, extra: dict | None = None) -> tn.EmbeddingStore:
    s = tn.EmbeddingStore(num_internal_shards=shards, threads=1)
    s.create_table("t", cfg["dim"], **{k: v for k, v in cfg.items() if k != "dim"}, **(extra or {}))
    return s


def counters(s: tn.EmbeddingStore) -> dict:
    st_ = s.stats("t")
    return {k: st_[k] for k in ["rows", *COUNTERS, "update_batches"]}


def same(a: tn.EmbeddingStore, b: tn.EmbeddingStore) -> None:
    assert counters(a) == counters(b)
    assert a.version == b.version
    assert_state_equal(all_state(a, "t", range(UNIVERSE)), all_state(b, "t", range(UNIVERSE)))


def delta_of(s: tn.EmbeddingStore, since: int) -> dict:
    ids, rows, cur = s.export_delta("t", since)
    return {"cur": cur, "rows": {int(i): rows[k].tobytes() for k, i in enumerate(ids)}}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    opt=st.sampled_from(OPTIMIZERS),
    dtype=st.sampled_from(DTYPES),
    policy=st.sampled_from(POLICIES),
    shards=st.sampled_from([1, 4]),
    budget=st.sampled_from([0, 1, 6]),
    ops=OPS,
)
def test_a_tiny_budget_answers_as_all_in_ram(tmp_path_factory, opt, dtype, policy, shards, budget, ops):
    cfg = dict(dim=4, optimizer=opt, dtype=dtype, lr=0.05, seed=3, **policy)
    ram = make(cfg, shards)
    disk = make(cfg, shards, tier(tmp_path_factory, budget))
    snaps = tmp_path_factory.mktemp("snaps")
    base = None  # (capture of ram, capture of disk) for the next delta
    chains: tuple[list, list] = ([], [])  # the files that restore the newest capture of each
    for k, op in enumerate(ops):
        kind = op[0]
        if kind == "lookup":
            ids = np.asarray(op[1], np.uint64)
            a, b = ram.lookup("t", ids, create=op[2]), disk.lookup("t", ids, create=op[2])
            assert a.tobytes() == b.tobytes()
        elif kind == "update":
            ids = np.asarray(op[1], np.uint64)
            g = (np.random.default_rng(op[2]).standard_normal((len(ids), 4)) * 0.1).astype(np.float32)
            assert ram.update("t", ids, g) == disk.update("t", ids, g)
        elif kind == "set_row":
            v = np.random.default_rng(op[2]).standard_normal(4).astype(np.float32)
            ram.set_row("t", op[1], v)
            disk.set_row("t", op[1], v)
        elif kind == "expire":
            now = time.time() + op[1]
            assert ram.expire("t", now=now) == disk.expire("t", now=now)
        elif kind == "delta":
            since = max(0, ram.version - op[1])
            assert delta_of(ram, since) == delta_of(disk, since)
        else:
            # Snapshot both stores, restore each into a fresh store of its kind (the disk
            # one with a tier again) and go on with the restored ones.
            pa, pb = snaps / f"a{k}.snap", snaps / f"b{k}.snap"
            if op[1] == "dump":
                ram.dump(pa)
                disk.dump(pb)
                base = None
                chains = ([pa], [pb])
            else:
                ca = ram.capture(since=base[0].mark if op[1] == "delta" and base else None)
                cb = disk.capture(since=base[1].mark if op[1] == "delta" and base else None)
                assert ca.delta == cb.delta and ca.rows == cb.rows
                ca.write(pa)
                cb.write(pb)
                base = (ca, cb)
                # A delta loads after the chain it extends: the last full capture, then each delta.
                chains = (chains[0] + [pa], chains[1] + [pb]) if ca.delta else ([pa], [pb])
            files_a, files_b = chains
            # A restored store must hold exactly what its source held (compared before the
            # sources are replaced), and both kinds the same.
            ram2, disk2 = make(cfg, shards), make(cfg, shards, tier(tmp_path_factory, budget))
            for f in files_a:
                ram2.load(f)
            for f in files_b:
                disk2.load(f)
            assert_state_equal(all_state(ram2, "t", range(UNIVERSE)), all_state(ram, "t", range(UNIVERSE)), skip=())
            same(ram2, disk2)
            ram, disk = ram2, disk2
            base = None if op[1] == "dump" else base
        same(ram, disk)
    st_ = disk.stats("t")
    assert st_["resident_rows"] + st_["disk_rows"] == st_["rows"]
    assert st_["disk_error"] is None


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    opt=st.sampled_from(OPTIMIZERS),
    dtype=st.sampled_from(DTYPES),
    policy=st.sampled_from(POLICIES[:1] + POLICIES[2:3]),
    batches=st.lists(IDS, min_size=1, max_size=8),
)
def test_a_reshard_of_a_disk_tier_checkpoint_is_the_all_in_ram_one(tmp_path_factory, opt, dtype, policy, batches):
    """Two PS shards' checkpoints loaded, filtered, into three new shards: with a disk tier on
    either side the new shards hold what they hold all in RAM."""
    cfg = dict(dim=3, optimizer=opt, dtype=dtype, lr=0.05, seed=5, **policy)
    old = {
        kind: [make(cfg, 4, tier(tmp_path_factory, 1) if kind == "disk" else None) for _ in range(2)]
        for kind in ("ram", "disk")
    }
    for k, ids in enumerate(batches):
        ids = np.asarray(ids, np.uint64)
        owner = tn.shard_of(ids, 2)
        g = (np.random.default_rng(k).standard_normal((len(ids), 3)) * 0.1).astype(np.float32)
        for stores in old.values():
            for sh, s in enumerate(stores):
                m = owner == sh
                if m.any():
                    s.lookup("t", ids[m])
                    s.update("t", ids[m], g[m])
    d = tmp_path_factory.mktemp("reshard")
    files = {}
    for kind, stores in old.items():
        files[kind] = []
        for sh, s in enumerate(stores):
            p = d / f"{kind}{sh}.snap"
            s.capture().write(p)
            files[kind].append(p)
    for i in range(3):
        ram = make(cfg, 2)
        disk = make(cfg, 2, tier(tmp_path_factory, 0))
        for f in files["ram"]:
            ram.load(f, shard_index=i, num_shards=3)
        for f in files["disk"]:
            disk.load(f, shard_index=i, num_shards=3)
        same(ram, disk)


def _open_spill_files() -> int:
    targets = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            targets.append(os.readlink(f"/proc/self/fd/{fd}"))
        except FileNotFoundError:  # the fd of the listing itself, closed by now
            pass
    return sum(".spill (deleted)" in t for t in targets)


def test_options_are_both_or_neither_and_stats_report_the_tier(tmp_path):
    s = tn.EmbeddingStore(num_internal_shards=2, threads=1)
    others = _open_spill_files()  # of stores an earlier test (a failed one's traceback) still holds
    with pytest.raises(ValueError, match="memory_budget_bytes needs disk"):
        s.create_table("a", 4, memory_budget_bytes=1000)
    with pytest.raises(ValueError, match="disk needs memory_budget_bytes"):
        s.create_table("a", 4, disk=str(tmp_path))
    s.create_table("a", 8, memory_budget_bytes=10 * 56, disk=tmp_path / "tier")
    s.lookup("a", np.arange(1000, dtype=np.uint64))
    st_ = s.stats("a")
    assert st_["rows"] == 1000 and st_["resident_rows"] <= 10
    assert st_["disk_rows"] == 1000 - st_["resident_rows"]
    assert len(st_["disk_rows_per_shard"]) == len(st_["disk_bytes_per_shard"]) == 2
    # a record: id (8) + 8 fp32 weights + the LRU tick (4), no optimizer state for SGD; each
    # internal shard's file grows an eighth (64 KiB at least) at a time
    records = st_["disk_rows"] * 44
    assert records <= st_["disk_bytes"] <= records * 9 // 8 + 2 * (68 << 10)
    # A spill file per internal shard, unlinked once open: nothing is left behind, even by a kill -9.
    assert list((tmp_path / "tier").iterdir()) == []
    assert _open_spill_files() == others + 2
    s.lookup("a", np.arange(10, dtype=np.uint64))
    assert s.stats("a")["disk_lookup_hits"] > 0
    assert s.table_config("a")["disk"] == str(tmp_path / "tier")
    s.drop_table("a")
    assert _open_spill_files() == others  # closed with the table


def test_sampled_eviction_counts_cold_rows_against_the_capacity(tmp_path):
    """Past 64 rows a shard samples its eviction victims (resident and cold alike): which rows
    go is then not the all-RAM table's, but the capacity holds and nothing is lost."""
    s = tn.EmbeddingStore(num_internal_shards=1, threads=1)
    # 40 bytes of RAM a row: id 8 + 4 fp32 weights 16 + version 4 + LRU tick 4 + index 8
    s.create_table("a", 4, capacity=500, memory_budget_bytes=50 * 40, disk=tmp_path)
    for k in range(6):
        s.lookup("a", np.arange(k * 300, k * 300 + 400, dtype=np.uint64))
    st_ = s.stats("a")
    assert st_["rows"] == 500 and st_["resident_rows"] <= 50 and st_["disk_rows"] >= 450
    assert st_["admitted"] - st_["evicted"] == 500


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_capture_pins_its_rows_on_disk_while_training_goes_on(tmp_path, dtype):
    """A capture of a table mostly on disk copies no cold row into RAM, yet writes every row as it
    was at the capture, although training meanwhile read each one back, updated it and spilled it
    again (to other record slots): its checkpoint, its delta and its values file are the all-in-RAM
    table's."""
    dim, universe = 64, 2000
    cfg = dict(dim=dim, optimizer="adam", dtype=dtype, lr=0.05, seed=3)
    ram, disk = make(cfg, 4), make(cfg, 4, dict(memory_budget_bytes=100 * 900, disk=str(tmp_path / "tier")))
    ids = np.arange(universe, dtype=np.uint64)
    g = (np.random.default_rng(1).standard_normal((universe, dim)) * 0.1).astype(np.float32)

    def train(k: int, subset: slice = slice(None)) -> None:
        # In batches well under the RAM budget, as steps are: the resident chunks stay small.
        for batch in np.array_split(np.arange(universe)[subset], 40):
            for s in (ram, disk):
                s.lookup("t", ids[batch])
                s.update("t", ids[batch], g[batch] * (k + 1))

    train(0)
    base = {"ram": ram.capture(), "disk": disk.capture()}
    train(1, slice(0, universe, 3))  # a third of the rows changed: the delta's
    at_capture = all_state(ram, "t", range(universe))
    full = {"ram": ram.capture(), "disk": disk.capture()}
    delta = {"ram": ram.capture(since=base["ram"].mark), "disk": disk.capture(since=base["disk"].mark)}
    assert disk.stats("t")["disk_rows"] > 0.9 * universe
    assert full["disk"].memory_bytes < full["ram"].memory_bytes / 4  # no cold row's values copied
    assert delta["disk"].rows == delta["ram"].rows == len(range(0, universe, 3))
    for k in (2, 3, 4):
        train(k)  # every row read back, updated and spilled again
    for kind in ("ram", "disk"):
        base[kind].write(tmp_path / f"{kind}.base")
        full[kind].write(tmp_path / f"{kind}.full")
        delta[kind].write(tmp_path / f"{kind}.delta")
        full[kind].write_values(tmp_path / f"{kind}.values", "fp32")
        for restored in (make(cfg, 4, dict(memory_budget_bytes=100 * 300, disk=str(tmp_path / "again"))), make(cfg, 2)):
            restored.load(tmp_path / f"{kind}.full")
            assert_state_equal(all_state(restored, "t", range(universe)), at_capture, skip=())
        chained = make(cfg, 4)
        chained.load(tmp_path / f"{kind}.base")
        chained.load(tmp_path / f"{kind}.delta")
        assert_state_equal(all_state(chained, "t", range(universe)), at_capture, skip=())
    served = {}
    for kind in ("ram", "disk"):
        tables = tn.ServingTables({"t": dim}, shards=1, dtype="fp32", threads=1)
        tables.apply([(0, tmp_path / f"{kind}.values")], version=1)
        served[kind] = tables.lookup([("t", ids)])[0][0]
    np.testing.assert_array_equal(served["disk"], served["ram"])
    expected = np.stack([at_capture[int(i)]["weights"] for i in ids]).astype(np.float32)
    np.testing.assert_array_equal(served["disk"], expected)
    # Released, the copies unpin the file: the records set aside are reused, the file stops growing.
    for c in (*base.values(), *full.values(), *delta.values()):
        c.release()
    grown = disk.stats("t")["disk_bytes"]
    train(5)
    train(6)
    assert disk.stats("t")["disk_bytes"] <= grown
