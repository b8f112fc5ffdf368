from __future__ import annotations

import numpy as np
import pytest

from trillium.wire.batch import Batch, EmbeddingRef, GradientUpdate, KeyedIds


def u64(*values: int) -> np.ndarray:
    return np.array(values, np.uint64)


def i32(*values: int) -> np.ndarray:
    return np.array(values, np.int32)


@pytest.fixture
def ids() -> KeyedIds:
    # 3 samples; slot "a": [1], [], [2, 3]; slot "b": [7], [7], [8]
    return KeyedIds.from_slots({"a": (u64(1, 2, 3), i32(1, 0, 2)), "b": (u64(7, 7, 8), i32(1, 1, 1))})


def test_keyed_ids_layout_is_key_major(ids: KeyedIds) -> None:
    assert ids.keys == ("a", "b")
    assert ids.batch_size == 3
    np.testing.assert_array_equal(ids.values, u64(1, 2, 3, 7, 7, 8))
    np.testing.assert_array_equal(ids.lengths, i32(1, 0, 2, 1, 1, 1))
    np.testing.assert_array_equal(ids.offsets(), [0, 1, 1, 3, 4, 5, 6])


def test_keyed_ids_slot(ids: KeyedIds) -> None:
    values, lengths = ids.slot("b")
    np.testing.assert_array_equal(values, u64(7, 7, 8))
    np.testing.assert_array_equal(lengths, i32(1, 1, 1))
    values, lengths = ids.slot("a")
    np.testing.assert_array_equal(values, u64(1, 2, 3))
    with pytest.raises(KeyError, match="no slot 'c'"):
        ids.slot("c")


def test_keyed_ids_first(ids: KeyedIds) -> None:
    first, has = ids.first("a")  # [1], [], [2, 3]
    np.testing.assert_array_equal(first, u64(1, 0, 2))
    np.testing.assert_array_equal(has, [True, False, True])
    first, has = ids.first("b")
    np.testing.assert_array_equal(first, u64(7, 7, 8))
    assert has.all()
    with pytest.raises(KeyError, match="no slot 'c'"):
        ids.first("c")


def test_keyed_ids_unique(ids: KeyedIds) -> None:
    unique, inverse = ids.unique()
    np.testing.assert_array_equal(unique, u64(1, 2, 3, 7, 8))
    np.testing.assert_array_equal(unique[inverse], ids.values)


def test_keyed_ids_equality(ids: KeyedIds) -> None:
    same = KeyedIds(("a", "b"), ids.values.copy(), ids.lengths.copy())
    assert same == ids
    assert KeyedIds(("a", "c"), ids.values, ids.lengths) != ids
    assert KeyedIds(("a", "b"), u64(1, 2, 3, 7, 7, 9), ids.lengths) != ids


@pytest.mark.parametrize(
    ("keys", "values", "lengths", "message"),
    [
        ((), u64(), i32(), "at least one"),
        (("a", "a"), u64(), i32(0, 0), "unique"),
        (("a",), np.array([1], np.int64), i32(1), "dtype uint64"),
        (("a",), u64(1), np.array([1], np.int64), "dtype int32"),
        (("a", "b"), u64(1), i32(1), "multiple of the 2 keys"),
        (("a",), u64(1), i32(2), "sum to 2 but there are 1"),
        (("a",), u64(), i32(1, -1), "non-negative"),
        (["a"], u64(1), i32(1), "tuple"),
    ],
)
def test_keyed_ids_validation(keys, values, lengths, message) -> None:
    with pytest.raises(ValueError, match=message):
        KeyedIds(keys, values, lengths)


def test_from_slots_rejects_ragged_batch() -> None:
    with pytest.raises(ValueError, match="batch size"):
        KeyedIds.from_slots({"a": (u64(1), i32(1)), "b": (u64(1, 2), i32(1, 1))})


def test_batch_validation(ids: KeyedIds) -> None:
    dense, labels = np.zeros((3, 2), np.float32), np.zeros(3, np.float32)
    batch = Batch(batch_id=4, epoch=0, rank=1, ids=ids, dense=dense, labels=labels)
    assert batch.batch_size == 3
    assert batch == Batch(4, 0, 1, ids, dense.copy(), labels.copy())
    assert batch != Batch(5, 0, 1, ids, dense, labels)
    with pytest.raises(ValueError, match="dense has 2 rows"):
        Batch(0, 0, 0, ids, np.zeros((2, 2), np.float32), labels)
    with pytest.raises(ValueError, match="labels must have dtype float32"):
        Batch(0, 0, 0, ids, dense, np.zeros(3, np.float64))
    with pytest.raises(ValueError, match="batch_id must be a non-negative int"):
        Batch(-1, 0, 0, ids, dense, labels)
    with pytest.raises(ValueError, match="rank must be a non-negative int"):
        Batch(0, 0, True, ids, dense, labels)


def test_embedding_ref() -> None:
    ref = EmbeddingRef(worker="embedding_worker-0", rank=1, batch_id=7, epoch=0)
    assert ref == EmbeddingRef("embedding_worker-0", 1, 7, 0)
    assert len({ref, EmbeddingRef("embedding_worker-0", 1, 7, 0)}) == 1  # usable as a dict key
    with pytest.raises(ValueError, match="worker"):
        EmbeddingRef("", 0, 0, 0)


def test_gradient_update() -> None:
    grads = np.ones((2, 4), np.float32)
    update = GradientUpdate(ranks=(0, 1), step=3, epoch=1, shard=1, tables={"t": (u64(5, 9), grads)})
    with pytest.raises(TypeError):
        update.tables["u"] = (u64(), np.zeros((0, 4), np.float32))  # type: ignore[index]
    assert update == GradientUpdate([0, 1], 3, 1, 1, {"t": (u64(5, 9), grads.copy())})
    assert update.ranks == (0, 1) and update != GradientUpdate((0,), 3, 1, 1, {"t": (u64(5, 9), grads)})
    # A repeated ID is not refused (two ranks' rows of one ID: the PS sums them, one update).
    assert GradientUpdate((0,), 0, 0, 0, {"t": (u64(5, 5), grads)}).tables["t"][0].tolist() == [5, 5]
    with pytest.raises(ValueError, match="2 ids but 3 gradient rows"):
        GradientUpdate((0,), 0, 0, 0, {"t": (u64(5, 6), np.ones((3, 4), np.float32))})
    with pytest.raises(ValueError, match="grads must have dtype float32"):
        GradientUpdate((0,), 0, 0, 0, {"t": (u64(5, 6), np.ones((2, 4)))})
    for ranks in ((), (1, 0), (0, 0), 0, (0, -1)):
        with pytest.raises(ValueError, match="rank"):
            GradientUpdate(ranks, 0, 0, 0, {})  # type: ignore[arg-type]
