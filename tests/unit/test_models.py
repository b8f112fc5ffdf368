from __future__ import annotations

import pytest
import torch

from trillium.job import DenseAdagrad, DenseAdam, DenseSgd, ModelSpec
from trillium.job.trust import ENV_MODEL_MODULES
from trillium.models import DNN, build_dense_optimizer, load_model


def test_dnn_takes_pooled_and_sequence_slots() -> None:
    model = DNN(num_dense=3, embedding_dims=[4, 2], hidden=[8])
    out = model(torch.randn(5, 3), [torch.randn(5, 4), torch.randn(5, 6, 2)])
    assert out.shape == (5,)
    # Zero padding rows of a sequence slot change nothing: it is sum-pooled.
    model.eval()
    seq = torch.randn(2, 3, 2)
    padded = torch.cat([seq, torch.zeros(2, 4, 2)], dim=1)
    dense, pooled = torch.randn(2, 3), torch.randn(2, 4)
    torch.testing.assert_close(model(dense, [pooled, seq]), model(dense, [pooled, padded]))


def test_dnn_handles_a_batch_of_one_and_no_dense_columns() -> None:
    model = DNN(num_dense=0, embedding_dims=[4], hidden=[])
    assert model(torch.zeros(1, 0), [torch.randn(1, 4)]).shape == (1,)


def test_load_model() -> None:
    spec = ModelSpec(cls="trillium.models:DNN", kwargs={"num_dense": 2, "embedding_dims": [3]})
    model = load_model(spec)
    assert isinstance(model, DNN)


@pytest.mark.parametrize(
    ("cls", "kwargs", "message"),
    [
        ("trillium.no_such_module:DNN", {}, "cannot import module 'trillium.no_such_module'"),
        ("trillium.models:Missing", {}, "module 'trillium.models' has no 'Missing'"),
        ("collections:OrderedDict", {}, "is not a torch.nn.Module subclass"),
        ("trillium.models:load_model", {}, "is not a torch.nn.Module subclass"),
        ("trillium.models:DNN", {"num_dense": 2}, "cannot build it with"),
    ],
)
def test_bad_model_spec_is_named(cls: str, kwargs: dict, message: str, monkeypatch) -> None:
    monkeypatch.setenv(ENV_MODEL_MODULES, "trillium,collections")  # past the trust check (test_trust.py)
    with pytest.raises(ValueError, match=message) as info:
        load_model(ModelSpec(cls=cls, kwargs=kwargs))
    assert repr(cls) in str(info.value)


def test_dense_optimizers() -> None:
    params = [torch.nn.Parameter(torch.zeros(2))]
    sgd = build_dense_optimizer(DenseSgd(name="sgd", lr=0.1, momentum=0.9), params)
    assert isinstance(sgd, torch.optim.SGD) and sgd.defaults["momentum"] == 0.9
    adam = build_dense_optimizer(DenseAdam(name="adam", lr=0.01, beta1=0.8), params)
    assert isinstance(adam, torch.optim.Adam) and adam.defaults["betas"] == (0.8, 0.999)
    adagrad = build_dense_optimizer(DenseAdagrad(name="adagrad", lr=0.05), params)
    assert isinstance(adagrad, torch.optim.Adagrad) and adagrad.defaults["lr"] == 0.05
