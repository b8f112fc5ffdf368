"""The embedding worker's pooling (native plan, pool, scatter behind
trillium/pooling.py) against the numpy + torch implementation it replaced
(pooling_reference.py): random batches, sum / mean / sequence slots, tables shared by
slots, empty batches and samples, one to four PS shards."""

from __future__ import annotations

import numpy as np
import pooling_reference as ref
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import trillium_native
from trillium import pooling
from trillium.job import FeatureSlot, TableConfig
from trillium.services.nn_worker.embeddings import SlotEmbeddings, embeddings_of, gradients_request
from trillium.wire import codec
from trillium.wire.batch import KeyedIds
from trillium.wire.pb import embedding_pb2 as pb


@st.composite
def batches(draw):
    """(slots, tables, num_shards, KeyedIds) with keys in another order than the slots, and
    one key no slot reads."""
    num_tables = draw(st.integers(1, 3))
    tables = {f"t{i}": TableConfig(dim=draw(st.sampled_from([1, 3, 8, 16]))) for i in range(num_tables)}
    slots = []
    for k in range(draw(st.integers(1, 5))):
        kind = draw(st.sampled_from(["sum", "mean", "none"]))
        max_len = draw(st.integers(1, 4)) if kind == "none" else None
        slots.append(
            FeatureSlot(
                name=f"s{k}",
                column=f"C{k}",
                table=f"t{draw(st.integers(0, num_tables - 1))}",
                pooling=kind,
                max_len=max_len,
            )
        )
    batch = draw(st.integers(0, 9))
    # A small universe makes IDs repeat within and across slots; some IDs are huge.
    universe = draw(st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=12, unique=True))
    keyed = {}
    for slot in slots + [FeatureSlot(name="unused", column="C9", table="t0")]:
        longest = slot.max_len if slot.pooling == "none" else 4
        lengths = draw(st.lists(st.integers(0, longest), min_size=batch, max_size=batch))
        values = [draw(st.sampled_from(universe)) for _ in range(sum(lengths))]
        keyed[slot.name] = (np.array(values, np.uint64), np.array(lengths, np.int32))
    order = draw(st.permutations(list(keyed)))
    ids = KeyedIds.from_slots({k: keyed[k] for k in order})
    return slots, tables, draw(st.integers(1, 4)), ids


def row_of(table: str, ids: np.ndarray, dim: int) -> np.ndarray:
    """A deterministic float32 row per (table, id): what a PS lookup would return."""
    seeds = (ids % np.uint64(2**31)).astype(np.int64) + 7919 * int(table[1:])
    return (
        np.stack([np.random.default_rng(int(s)).standard_normal(dim).astype(np.float32) for s in seeds])
        if len(ids)
        else np.zeros((0, dim), np.float32)
    )


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=batches(), fp16=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_native_pooling_matches_the_numpy_torch_reference(case, fp16, seed):
    slots, tables, num_shards, ids = case
    layout = pooling.Layout(slots, tables, num_shards)
    p = pooling.plan(layout, ids)
    r = ref.plan(ids, slots, num_shards)
    assert p.batch_size == r.batch_size == ids.batch_size
    assert set(p.tables) == set(r.tables)

    # Plan: the same unique IDs, each in the range of the shard that owns it, ranges in shard order.
    for t, tp in p.tables.items():
        np.testing.assert_array_equal(np.sort(tp.ids), r.tables[t].ids)
        assert [s.start for s in tp.shard_rows] == [0] + [s.stop for s in tp.shard_rows[:-1]]
        assert tp.shard_rows[-1].stop == len(tp.ids)
        for s in range(num_shards):
            assert (trillium_native.shard_of(tp.shard_ids(s), num_shards) == s).all()
            np.testing.assert_array_equal(np.sort(tp.shard_ids(s)), r.tables[t].ids[r.tables[t].shard_rows[s]])

    # Pool: rows in each plan's own order; outputs bit for bit.
    dims = {t: tables[t].dim for t in p.tables}
    got = pooling.pool(p, {t: row_of(t, tp.ids, dims[t]) for t, tp in p.tables.items()}, fp16=fp16)
    want = ref.pool(r, {t: row_of(t, tp.ids, dims[t]) for t, tp in r.tables.items()})
    assert got.pooled.dtype == (np.float16 if fp16 else np.float32)
    assert got.pooled.shape == (ids.batch_size, sum(tables[s.table].dim for s in slots if s.pooling != "none"))
    for slot, (values, mask), (ref_values, ref_mask) in zip(slots, got.slots(), want, strict=True):
        expect = ref_values.numpy().astype(np.float16 if fp16 else np.float32)
        np.testing.assert_array_equal(values, expect, err_msg=slot.name)
        if ref_mask is None:
            assert mask is None
        else:
            np.testing.assert_array_equal(mask, ref_mask.numpy(), err_msg=slot.name)

    # Scatter: per-slot gradients of the model inputs -> per unique ID, compared by ID.
    rng = np.random.default_rng(seed)
    grads = [rng.standard_normal(np.shape(v)).astype(np.float32) for v, _ in got.slots()]
    got_g = pooling.scatter_gradients(p, grads)
    want_g = ref.scatter_gradients(r, grads)
    for t, tp in p.tables.items():
        assert got_g[t].dtype == np.float32 and got_g[t].shape == (len(tp.ids), dims[t])
        if t in want_g:
            order = np.searchsorted(r.tables[t].ids, tp.ids)
            np.testing.assert_array_equal(got_g[t], want_g[t][order], err_msg=t)
        else:  # the reference leaves out tables whose slots have no gradient rows
            assert len(tp.ids) == 0


def test_shards_and_shared_tables_by_hand():
    slots = [
        FeatureSlot(name="a", column="A", table="t"),
        FeatureSlot(name="b", column="B", table="t", pooling="mean"),
        FeatureSlot(name="c", column="C", table="u", pooling="none", max_len=3),
    ]
    layout = pooling.Layout(slots, {"t": TableConfig(dim=2), "u": TableConfig(dim=1)}, num_shards=2)
    assert layout.tables == ["t", "u"] and layout.columns == [(0, 2), (2, 4), None]
    ids = KeyedIds.from_slots(
        {
            "c": (np.array([7, 8, 9], np.uint64), np.array([0, 3], np.int32)),
            "a": (np.array([1, 2, 1], np.uint64), np.array([2, 1], np.int32)),
            "b": (np.array([2, 3], np.uint64), np.array([0, 2], np.int32)),
        }
    )
    p = pooling.plan(layout, ids)
    t = p.tables["t"]
    assert sorted(t.ids.tolist()) == [1, 2, 3]  # a and b share table t: each ID once
    owners = trillium_native.shard_of(t.ids, 2)
    assert owners.tolist() == sorted(owners.tolist())
    rows = {"t": np.array([[10 * i, i] for i in t.ids.tolist()], np.float32), "u": p.tables["u"].ids[:, None] * 1.0}
    out = pooling.pool(p, {"t": rows["t"], "u": rows["u"].astype(np.float32)})
    np.testing.assert_array_equal(out.pooled, [[30, 3, 0, 0], [10, 1, 25, 2.5]])  # a: [1, 2] | [1]; b: [] | mean(2, 3)
    ((seq, mask),) = out.sequences
    np.testing.assert_array_equal(seq[:, :, 0], [[0, 0, 0], [7, 8, 9]])
    np.testing.assert_array_equal(mask, [[False] * 3, [True] * 3])
    g = pooling.scatter_gradients(
        p,
        [np.ones((2, 2), np.float32), np.full((2, 2), 4, np.float32), np.arange(6, dtype=np.float32).reshape(2, 3, 1)],
    )
    by_id = dict(zip(t.ids.tolist(), g["t"].tolist(), strict=True))
    # id 1: in both samples of a; id 2: once in a, once in b (a mean over 2: 4 / 2); id 3: once in b
    assert by_id == {1: [2, 2], 2: [3, 3], 3: [2, 2]}
    assert dict(zip(p.tables["u"].ids.tolist(), g["u"][:, 0].tolist(), strict=True)) == {7: 3, 8: 4, 9: 5}


def test_errors_name_what_is_wrong():
    slots = [
        FeatureSlot(name="a", column="A", table="t"),
        FeatureSlot(name="q", column="Q", table="t", pooling="none", max_len=2),
    ]
    tables = {"t": TableConfig(dim=2)}
    layout = pooling.Layout(slots, tables, 3)
    ok = KeyedIds.from_slots(
        {
            "a": (np.array([1], np.uint64), np.array([1], np.int32)),
            "q": (np.array([2, 3], np.uint64), np.array([2], np.int32)),
        }
    )
    with pytest.raises(KeyError, match="unknown table .x."):
        pooling.Layout([FeatureSlot(name="a", column="A", table="x")], tables, 1)
    with pytest.raises(ValueError, match="num_shards"):
        pooling.Layout(slots, tables, 0)
    with pytest.raises(KeyError, match="no slot .q."):
        pooling.plan(layout, KeyedIds.from_slots({"a": (np.array([1], np.uint64), np.array([1], np.int32))}))
    long = KeyedIds.from_slots(
        {
            "a": (np.array([1], np.uint64), np.array([1], np.int32)),
            "q": (np.array([2, 3, 4], np.uint64), np.array([3], np.int32)),
        }
    )
    with pytest.raises(ValueError, match="slot .q.: sample 0 has 3 IDs, more than max_len=2"):
        pooling.plan(layout, long)
    with pytest.raises(TypeError, match="uint64"):
        layout.native.plan(["a", "q"], np.array([1, 2, 3], np.int64), np.array([1, 2], np.int32))
    with pytest.raises(ValueError, match="lengths sum to 3 but there are 2 values"):
        layout.native.plan(["a", "q"], np.array([1, 2], np.uint64), np.array([1, 2], np.int32))
    p = pooling.plan(layout, ok)
    with pytest.raises(ValueError, match=r"rows of table .t. must have shape \(3, 2\)"):
        pooling.pool(p, {"t": np.zeros((2, 2), np.float32)})
    with pytest.raises(TypeError, match="float32"):
        pooling.pool(p, {"t": np.zeros((3, 2), np.float64)})
    with pytest.raises(ValueError, match="out_dtype"):
        p.native.pool([np.zeros((3, 2), np.float32)], out_dtype="int8")
    with pytest.raises(ValueError, match=r"gradient of slot .a. must have shape \(1, 2\)"):
        pooling.scatter_gradients(p, [np.zeros((1, 3), np.float32), np.zeros((1, 2, 2), np.float32)])
    with pytest.raises(ValueError, match=r"gradient of slot .q. must have shape \(1, 2, 2\)"):
        pooling.scatter_gradients(p, [np.zeros((1, 2), np.float32), np.zeros((1, 3, 2), np.float32)])
    with pytest.raises(ValueError, match=r"pooled_grad must have shape \(1, 2\), got \(1, 3\)"):
        p.native.scatter(np.zeros((1, 3), np.float32), [np.zeros((1, 2, 2), np.float32)])
    with pytest.raises(TypeError, match="pooled_grad must be a numpy.ndarray or a sequence"):
        p.native.scatter(7, [np.zeros((1, 2, 2), np.float32)])
    with pytest.raises(TypeError, match="float32"):
        pooling.scatter_gradients(p, [np.zeros((1, 2), np.float16), np.zeros((1, 2, 2), np.float32)])
    with pytest.raises(ValueError, match="a gradient per slot"):
        pooling.scatter_gradients(p, [np.zeros((1, 2), np.float32)])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=batches(), seed=st.integers(0, 2**32 - 1))
def test_embeddings_and_gradients_cross_the_wire_intact(case, seed):
    """A lookup answer as the embedding worker sends it (pooled slots in one array, sequence
    slots apart) gives the NN rank each slot's embeddings; the rank's gradients go back the same
    way, each slot's where its embeddings came (the worker's plane scatters them from there:
    tests/unit/test_native_worker.py)."""
    slots, tables, num_shards, ids = case
    layout = pooling.Layout(slots, tables, num_shards)
    p = pooling.plan(layout, ids)
    got = pooling.pool(p, {t: row_of(t, tp.ids, tables[t].dim) for t, tp in p.tables.items()})
    sequence_slots = [s for s, cols in zip(slots, layout.columns, strict=True) if cols is None]
    response = pb.BatchLookupResponse(
        pooled=pb.Array(data=codec.pack_array(got.pooled)),
        widths=[c[1] - c[0] if c is not None else 0 for c in layout.columns],
        slots=[
            pb.SlotEmbedding(
                slot=s.name, values=pb.Array(data=codec.pack_array(v)), mask=pb.Array(data=codec.pack_array(m))
            )
            for s, (v, m) in zip(sequence_slots, got.sequences, strict=True)
        ],
    )
    for received, (sent, _) in zip(embeddings_of(response).slots(), got.slots(), strict=True):
        np.testing.assert_array_equal(received, sent)
    rng = np.random.default_rng(seed)
    grads = [rng.standard_normal(np.shape(v)).astype(np.float32) for v, _ in got.slots()]
    request = gradients_request(response, SlotEmbeddings.of(grads))
    assert [s.slot for s in request.slots] == [s.name for s in sequence_slots]
    pooled = [g for g, cols in zip(grads, layout.columns, strict=True) if cols is not None]
    joined = np.concatenate(pooled, axis=1) if pooled else np.zeros((ids.batch_size, 0), np.float32)
    np.testing.assert_array_equal(codec.unpack_array(request.pooled.data), joined)
    sequences = [g for g, cols in zip(grads, layout.columns, strict=True) if cols is None]
    for sent, grad in zip(request.slots, sequences, strict=True):
        np.testing.assert_array_equal(codec.unpack_array(sent.grad.data), grad)
