"""Property tests: every optimizer (and weight bound, duplicates, NaN skipping)
against a small pure-numpy reference model."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import trillium_native as tn

F = np.float32
SETTINGS = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])


class RefTable:
    """Reference optimizer math in float32 numpy, mirroring the documented formulas."""

    def __init__(
        self,
        dim,
        optimizer,
        lr=0.05,
        weight_decay=0.0,
        eps=1e-8,
        beta1=0.9,
        beta2=0.999,
        initial_accumulator=0.0,
        ftrl_alpha=0.05,
        ftrl_beta=1.0,
        ftrl_l1=0.0,
        ftrl_l2=0.0,
        weight_bound=None,
    ):
        self.dim = dim
        self.opt = optimizer
        self.lr, self.wd, self.eps = F(lr), F(weight_decay), F(eps)
        self.b1, self.b2 = F(beta1), F(beta2)
        self.b1_64, self.b2_64 = beta1, beta2
        self.acc0 = F(initial_accumulator)
        self.alpha, self.beta, self.l1, self.l2 = F(ftrl_alpha), F(ftrl_beta), F(ftrl_l1), F(ftrl_l2)
        self.bound = None if weight_bound is None else F(weight_bound)
        self.rows: dict[int, dict] = {}

    def insert(self, i, w):
        w = np.array(w, dtype=F)
        st_ = {"w": w}
        if self.opt == "adagrad":
            st_["acc"] = np.full(self.dim, self.acc0, F)
        elif self.opt == "rowwise_adagrad":
            st_["acc"] = self.acc0
        elif self.opt == "adam":
            st_["m"] = np.zeros(self.dim, F)
            st_["v"] = np.zeros(self.dim, F)
            st_["t"] = 0
        elif self.opt == "ftrl":
            n = np.full(self.dim, self.acc0, F)
            d = (self.beta + np.sqrt(n)) / self.alpha + self.l2
            z = np.where(w == 0, F(0), -(w * d + np.sign(w) * self.l1)).astype(F)
            st_["z"], st_["n"] = z, n
        self.rows[i] = st_

    def clip(self, w):
        return w if self.bound is None else np.clip(w, -self.bound, self.bound).astype(F)

    def apply(self, i, g):
        r = self.rows[i]
        w = r["w"]
        g = g.astype(F)
        if self.opt == "sgd":
            r["w"] = self.clip(w - self.lr * (g + self.wd * w))
        elif self.opt == "adagrad":
            gi = g + self.wd * w
            r["acc"] = r["acc"] + gi * gi
            r["w"] = self.clip(w - self.lr * gi / (np.sqrt(r["acc"]) + self.eps))
        elif self.opt == "rowwise_adagrad":
            gi = g + self.wd * w
            r["acc"] = F(r["acc"] + F(np.sum(gi * gi, dtype=F)) / F(self.dim))
            r["w"] = self.clip(w - (self.lr / (np.sqrt(r["acc"]) + self.eps)) * gi)
        elif self.opt == "adam":
            gi = g + self.wd * w
            r["t"] += 1
            t = r["t"]
            bc1, bc2 = F(1.0 - self.b1_64**t), F(1.0 - self.b2_64**t)
            r["m"] = self.b1 * r["m"] + (F(1) - self.b1) * gi
            r["v"] = self.b2 * r["v"] + (F(1) - self.b2) * gi * gi
            r["w"] = self.clip(w - self.lr * ((r["m"] / bc1) / (np.sqrt(r["v"] / bc2) + self.eps)))
        elif self.opt == "ftrl":
            n_old = r["n"]
            n_new = n_old + g * g
            sigma = (np.sqrt(n_new) - np.sqrt(n_old)) / self.alpha
            z = r["z"] + g - sigma * w
            r["z"], r["n"] = z, n_new
            wn = np.where(
                np.abs(z) <= self.l1,
                F(0),
                -(z - np.sign(z) * self.l1) / ((self.beta + np.sqrt(n_new)) / self.alpha + self.l2),
            ).astype(F)
            r["w"] = self.clip(wn)


OPT_CONFIGS = [
    ("sgd", {"weight_decay": 0.1}),
    ("sgd", {"weight_bound": 0.02}),
    ("adagrad", {"initial_accumulator": 0.1}),
    ("adagrad", {"weight_decay": 0.05, "weight_bound": 0.05}),
    ("rowwise_adagrad", {}),
    ("rowwise_adagrad", {"weight_decay": 0.01, "initial_accumulator": 0.5, "weight_bound": 0.03}),
    ("adam", {}),
    ("adam", {"weight_decay": 0.01, "beta1": 0.8, "beta2": 0.99, "weight_bound": 0.05}),
    ("ftrl", {"ftrl_alpha": 0.1, "ftrl_beta": 1.0, "ftrl_l1": 0.001, "ftrl_l2": 0.01}),
    ("ftrl", {"ftrl_alpha": 0.5, "ftrl_l1": 0.0, "weight_bound": 0.1, "initial_accumulator": 0.1}),
]

batches_strategy = st.lists(
    st.tuples(
        st.lists(st.integers(0, 15), min_size=1, max_size=12),  # ids (duplicates likely)
        st.integers(0, 2**31 - 1),  # grad seed
    ),
    min_size=1,
    max_size=6,
)


@pytest.mark.parametrize("optimizer,kw", OPT_CONFIGS, ids=[f"{o}-{i}" for i, (o, _) in enumerate(OPT_CONFIGS)])
@SETTINGS
@given(batches=batches_strategy, shards=st.sampled_from([1, 3, 16]))
def test_optimizer_matches_reference(optimizer, kw, batches, shards):
    dim = 5
    store = tn.EmbeddingStore(num_internal_shards=shards, threads=2)
    store.create_table("t", dim, optimizer=optimizer, lr=0.05, seed=11, **kw)
    ref = RefTable(dim, optimizer, lr=0.05, **kw)
    for ids_list, gseed in batches:
        ids = np.array(ids_list, dtype=np.uint64)
        out = store.lookup("t", ids)
        for k, i in enumerate(ids_list):
            if i not in ref.rows:
                ref.insert(i, out[k])
            np.testing.assert_allclose(out[k], ref.rows[i]["w"], rtol=1e-5, atol=1e-7)
        grads = (np.random.default_rng(gseed).standard_normal((len(ids), dim)) * 0.1).astype(np.float32)
        n = store.update("t", ids, grads)
        uniq = sorted(set(ids_list))
        assert n == len(uniq)
        for i in uniq:
            g = grads[ids == i].sum(axis=0, dtype=np.float32)
            ref.apply(i, g)
    for i, r in ref.rows.items():
        np.testing.assert_allclose(store.get_row("t", i), r["w"], rtol=2e-5, atol=1e-7)
        s = store.get_row_state("t", i)
        if optimizer == "adam":
            assert s["step"] == r["t"]
            np.testing.assert_allclose(s["m"], r["m"], rtol=2e-5, atol=1e-8)
        if optimizer == "rowwise_adagrad":
            np.testing.assert_allclose(s["accumulator"], r["acc"], rtol=2e-5)
        if optimizer == "ftrl":
            np.testing.assert_allclose(s["z"], r["z"], rtol=2e-5, atol=1e-7)
        if "weight_bound" in kw:
            assert np.all(np.abs(store.get_row("t", i)) <= kw["weight_bound"] + 1e-9)
    assert store.stats("t")["updates"] == sum(len(set(b[0])) for b in batches)


def test_duplicate_ids_are_summed():
    s = tn.EmbeddingStore(threads=2)
    s.create_table("t", 3, optimizer="sgd", lr=1.0, init_low=0.0, init_high=0.0)
    ids = np.array([7, 7, 7, 8], dtype=np.uint64)
    s.lookup("t", ids)
    g = np.array([[1, 2, 3], [10, 20, 30], [100, 200, 300], [5, 5, 5]], dtype=np.float32)
    assert s.update("t", ids, g) == 2
    np.testing.assert_array_equal(s.get_row("t", 7), -np.array([111, 222, 333], np.float32))
    np.testing.assert_array_equal(s.get_row("t", 8), -np.array([5, 5, 5], np.float32))


def test_nan_gradient_row_skipped_and_counted():
    s = tn.EmbeddingStore()
    s.create_table("t", 4, optimizer="adagrad", lr=0.1)
    ids = np.array([1, 2, 3, 2], dtype=np.uint64)
    before = s.lookup("t", ids)
    g = np.ones((4, 4), np.float32)
    g[0, 1] = np.nan  # id 1
    g[3, 2] = np.inf  # id 2 (its sum becomes inf)
    assert s.update("t", ids, g) == 1
    np.testing.assert_array_equal(s.get_row("t", 1), before[0])
    np.testing.assert_array_equal(s.get_row("t", 2), before[1])
    assert not np.array_equal(s.get_row("t", 3), before[2])
    st_ = s.stats("t")
    assert st_["nan_grads_skipped"] == 2
    np.testing.assert_array_equal(s.get_row_state("t", 1)["accumulator"], np.zeros(4, np.float32))
    # a later finite update of the same row still works
    assert s.update("t", np.array([1], np.uint64), np.ones((1, 4), np.float32)) == 1


def test_updates_to_missing_ids_are_dropped():
    s = tn.EmbeddingStore()
    s.create_table("t", 2, optimizer="sgd", lr=1.0, init_low=0.0, init_high=0.0)
    s.lookup("t", np.array([1], np.uint64))
    n = s.update("t", np.array([1, 99], np.uint64), np.array([[1, 1], [2, 2]], np.float32))
    assert n == 1
    assert s.get_row("t", 99) is None
    assert s.stats("t")["dropped_grads"] == 1
    np.testing.assert_array_equal(s.get_row("t", 1), [-1, -1])
