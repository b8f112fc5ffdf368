from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import trillium_native
from trillium.data import load_job
from trillium.job import FeatureSlot, JobConfig, TableConfig
from trillium.train.reference import _pool, _Table, train_baseline, train_reference

TINY_JOB = Path(__file__).resolve().parents[1] / "data" / "tiny_job.yaml"


@pytest.fixture(scope="module")
def tiny() -> JobConfig:
    return load_job(TINY_JOB)


def test_reference_learns_and_is_deterministic(tiny: JobConfig) -> None:
    first, second = train_reference(tiny), train_reference(tiny)
    assert first.test_auc is not None and first.test_auc > 0.68
    assert first.losses == second.losses and first.test_auc == second.test_auc
    assert len(first.losses) == 3 * 20 and first.examples == 3 * 1000
    assert np.mean(first.losses[-10:]) < np.mean(first.losses[:10])


def test_gauc_only_with_group_by_and_grouping_changes_nothing_else(tiny: JobConfig) -> None:
    plain = train_reference(tiny)
    assert plain.test_gauc is None
    document = tiny.model_dump(mode="json")
    document["evaluation"] = {"group_by": "c2"}
    grouped = train_reference(JobConfig.model_validate(document))
    assert (grouped.losses, grouped.test_auc, grouped.test_logloss) == (
        plain.losses,
        plain.test_auc,
        plain.test_logloss,
    )
    assert grouped.test_gauc is not None and 0.6 < grouped.test_gauc < 0.9 and grouped.test_gauc != plain.test_auc


def test_a_different_seed_gives_a_different_run(tiny: JobConfig) -> None:
    document = tiny.model_dump(mode="json")
    document["training"]["seed"] = 2
    document["training"]["epochs"] = 1
    other = train_reference(JobConfig.model_validate(document))
    assert other.losses[:20] != train_reference(tiny).losses[:20]


def test_baseline_learns(tiny: JobConfig) -> None:
    result = train_baseline(tiny)
    assert result.test_auc is not None and result.test_auc > 0.68


@pytest.mark.parametrize(
    "table",
    [
        {"optimizer": {"name": "sgd", "lr": 0.5, "weight_decay": 0.1}},
        {"optimizer": {"name": "adagrad", "lr": 0.1, "initial_accumulator": 0.01}, "weight_bound": 0.05},
        {"optimizer": {"name": "rowwise_adagrad", "lr": 0.1, "weight_decay": 0.01}},
        {"optimizer": {"name": "adam", "lr": 0.01}, "initializer": "normal", "init_std": 0.1},
        {"optimizer": {"name": "ftrl", "alpha": 0.1, "l1": 0.001, "l2": 0.01}},
        {"optimizer": {"name": "adagrad", "lr": 0.1}, "dtype": "fp16"},
        {"optimizer": {"name": "adam", "lr": 0.01}, "dtype": "bf16"},
    ],
)
def test_embedding_optimizers_match_the_native_store(table: dict[str, Any]) -> None:
    config = TableConfig.model_validate({"dim": 4, **table})
    store = trillium_native.EmbeddingStore()
    store.create_table("t", **config.store_kwargs(seed=11))
    vocab = np.unique(np.random.default_rng(0).integers(0, 2**64, 12, dtype=np.uint64))
    reference = _Table("t", config, vocab, store)
    native = trillium_native.EmbeddingStore()
    native.create_table("t", **config.store_kwargs(seed=11))
    rng = np.random.default_rng(1)
    for _ in range(5):
        ids = np.sort(rng.choice(vocab, 6, replace=False))  # overlapping subsets: sparse updates
        grads = rng.normal(0, 0.1, (6, 4)).astype(np.float32)
        idx = reference.rows(ids)
        # As in the system, IDs are looked up (new rows created) before their gradients arrive;
        # new rows start from exactly the native initial values.
        np.testing.assert_allclose(reference.weight[idx], native.lookup("t", ids), rtol=1e-5, atol=1e-7)
        reference.apply(idx, grads)
        native.update("t", ids, grads)
        np.testing.assert_allclose(reference.weight[idx], native.lookup("t", ids), rtol=1e-5, atol=1e-7)
    seen = vocab[reference.known]
    np.testing.assert_allclose(reference.weight[reference.known], native.lookup("t", seen), rtol=1e-5, atol=1e-7)


def test_pooling() -> None:
    rows = torch.arange(8, dtype=torch.float32).view(4, 2)
    # Sample 0 has IDs 0 and 1, sample 1 none, sample 2 IDs 2 and 3.
    sample, position, lengths = np.array([0, 0, 2, 2]), np.array([0, 1, 0, 1]), np.array([2, 0, 2])

    def pool(pooling: str, max_len: int | None = None) -> torch.Tensor:
        slot = FeatureSlot(name="s", column="C1", pooling=pooling, max_len=max_len)
        return _pool(rows, sample, position, lengths, slot)

    torch.testing.assert_close(pool("sum"), torch.tensor([[2.0, 4.0], [0.0, 0.0], [10.0, 12.0]]))
    torch.testing.assert_close(pool("mean"), torch.tensor([[1.0, 2.0], [0.0, 0.0], [5.0, 6.0]]))
    padded = pool("none", max_len=3)
    assert padded.shape == (3, 3, 2)
    torch.testing.assert_close(padded[0], torch.tensor([[0.0, 1.0], [2.0, 3.0], [0.0, 0.0]]))
    torch.testing.assert_close(padded[1], torch.zeros(3, 2))


def test_reference_refuses_admission(tiny: JobConfig) -> None:
    document = tiny.model_dump(mode="json")
    document["tables"]["a"]["admission"] = {"policy": "probability", "probability": 0.5}
    with pytest.raises(ValueError, match="admission is not modelled"):
        train_reference(JobConfig.model_validate(document))
