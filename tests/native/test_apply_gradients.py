"""A PS shard's steps of gradient messages applied natively (`trillium_native.apply_gradients`),
checked against SGD by hand: each step is one update per table with every message's rows of it,
in rank order, duplicate IDs summed; fp16 messages widened by their scale; a message that is no
gradients frame refused before any step is applied."""

from __future__ import annotations

import numpy as np
import pytest

import trillium_native
from trillium.wire import codec
from trillium.wire.batch import GradientUpdate

LR = 0.5


def store() -> trillium_native.EmbeddingStore:
    s = trillium_native.EmbeddingStore(threads=1)
    s.create_table("a", 4, optimizer="sgd", lr=LR, seed=3)
    s.create_table("b", 2, optimizer="sgd", lr=LR, seed=4)
    return s


def message(ranks, step, rows: dict[str, tuple[list[int], np.ndarray]], *, fp16: bool = False) -> bytes:
    tables = {t: (np.asarray(ids, np.uint64), g.astype(np.float32)) for t, (ids, g) in rows.items()}
    return codec.encode_gradients(GradientUpdate(tuple(ranks), step, 0, 0, tables), fp16=fp16)


def test_each_step_is_one_sgd_update_per_table_of_every_message_in_rank_order() -> None:
    s = store()
    rng = np.random.default_rng(0)
    ga, gb, gc = (rng.normal(size=(3, 4)) for _ in range(3))
    hb = rng.normal(size=(2, 2))
    first = message([0], 0, {"a": ([1, 2, 1], ga), "b": ([9, 9], hb)})
    second = message([1], 0, {"a": ([2, 5, 7], gb), "b": ([], np.zeros((0, 2)))}, fp16=True)
    later = message([0, 1], 1, {"a": ([7, 7, 1], gc), "b": ([], np.zeros((0, 2)))})
    before = {i: s.lookup("a", np.array([i], np.uint64))[0].copy() for i in (1, 2, 5, 7)}
    b9 = s.lookup("b", np.array([9], np.uint64))[0].copy()
    gb16 = codec.decode_gradients(second).tables["a"][1]  # what the fp16 message carries
    rows = trillium_native.apply_gradients(s, [[first, second], [later]])
    assert rows == 4 + 1 + 2  # the unique IDs of each update: step 0's a (1, 2, 5, 7) and b (9), step 1's a (7, 1)
    summed = {1: ga[0] + ga[2] + gc[2], 2: ga[1] + gb16[0], 5: gb16[1], 7: gb16[2] + gc[0] + gc[1]}
    for i, g in summed.items():
        np.testing.assert_allclose(s.get_row("a", i), before[i] - LR * g, rtol=1e-5, atol=1e-6, err_msg=str(i))
    np.testing.assert_allclose(s.get_row("b", 9), b9 - LR * (hb[0] + hb[1]), rtol=1e-5, atol=1e-6)


def test_what_is_no_gradients_message_is_refused_before_any_step_is_applied() -> None:
    s = store()
    good = message([0], 0, {"a": ([1], np.ones((1, 4))), "b": ([], np.zeros((0, 2)))})
    s.lookup("a", np.array([1], np.uint64))
    row = s.get_row("a", 1).copy()
    for bad, why in [
        (b"TRLM", "too short"),
        (b"x" * 20, "not a Trillium message"),
        (codec.pack_array(np.zeros(3, np.float32)), "expected a 'gradients' message"),
        (good[:-4], "truncated"),
    ]:
        with pytest.raises(ValueError, match=why):
            trillium_native.apply_gradients(s, [[good], [bad]])
    np.testing.assert_array_equal(s.get_row("a", 1), row)  # the good step before it was not applied
    lacking = message([1], 0, {"a": ([1], np.ones((1, 4)))})  # no table b
    with pytest.raises(ValueError, match='no table "b"'):
        trillium_native.apply_gradients(s, [[good, lacking]])
    np.testing.assert_array_equal(s.get_row("a", 1), row)  # not half a step either
