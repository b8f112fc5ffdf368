"""The model contract, the default model, and how a job's model and dense optimizer are built.

A model is a plain `torch.nn.Module` whose `forward(dense, embeddings)` takes

- `dense`: float32 (B, num_dense), the normalized dense columns in the job's order;
- `embeddings`: one tensor per feature slot, in the job's slot order: (B, dim) for pooled slots,
  (B, max_len, dim) for sequence slots (pooling `none`), whose padding rows are zero; training
  and evaluation pass a `SlotTensors` (a list that may also hold them `joined`);

and returns logits of shape (B,) (the loss is BCE with logits).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from trillium.job import (
    DenseAdagrad,
    DenseAdam,
    DenseOptimizerConfig,
    DenseSgd,
    JobConfig,
    ModelSpec,
)
from trillium.job.trust import check_model_module

__all__ = ["DNN", "SlotTensors", "build_dense_optimizer", "build_model", "load_model", "logits"]


class SlotTensors(list):
    """A batch's embeddings as training and evaluation hand them to a model: one tensor per slot,
    in slot order (a list, as the contract says), and, when every slot is a pooled one, `joined`:
    all of them side by side, (B, sum of dims), the tensor the per-slot ones are column views of
    (TorchRec's `KeyedTensor.values()`). A model that concatenates the slots takes `joined`
    instead: the same values, without a copy forward and another backward."""

    joined: Tensor | None = None


class DNN(nn.Module):
    """After PERSIA's adult-income DNN: the dense columns and the concatenated embeddings are each
    projected and normalized, then a ReLU MLP maps both to a logit. Sequence slots are sum-pooled
    (their padding rows are zero, so padding adds nothing).

    LayerNorm where PERSIA has BatchNorm: a sample's output then does not depend on the rest of its
    batch, so it is the same on any number of NN ranks, in eval and for a batch of one.
    """

    def __init__(
        self,
        num_dense: int,
        embedding_dims: Sequence[int],
        hidden: Sequence[int] = (256, 128),
        dense_proj: int = 16,
        sparse_proj: int = 128,
    ) -> None:
        super().__init__()
        if not embedding_dims and not num_dense:
            raise ValueError("DNN needs dense columns or embeddings")
        self.dense_proj = (
            nn.Sequential(nn.Linear(num_dense, dense_proj), nn.LayerNorm(dense_proj)) if num_dense else None
        )
        self.sparse_proj = (
            nn.Sequential(nn.Linear(sum(embedding_dims), sparse_proj), nn.LayerNorm(sparse_proj))
            if embedding_dims
            else None
        )
        width = (dense_proj if num_dense else 0) + (sparse_proj if embedding_dims else 0)
        layers: list[nn.Module] = []
        for size in hidden:
            layers += [nn.Linear(width, size), nn.ReLU()]
            width = size
        layers.append(nn.Linear(width, 1))
        self.mlp = nn.Sequential(*layers)

    def forward(self, dense: Tensor, embeddings: list[Tensor]) -> Tensor:
        parts = []
        if self.dense_proj is not None:
            parts.append(self.dense_proj(dense))
        if self.sparse_proj is not None:
            joined = getattr(embeddings, "joined", None)
            if joined is None:
                joined = torch.cat([e.sum(dim=1) if e.dim() == 3 else e for e in embeddings], dim=1)
            parts.append(self.sparse_proj(joined))
        return self.mlp(torch.cat(parts, dim=1)).squeeze(-1)


def logits(model: nn.Module, dense: Tensor, embeddings: list[Tensor], bf16: bool = False) -> Tensor:
    """The model's logits [B] in fp32, as training, evaluation and serving all compute them: with
    `bf16` (`training.precision`) the forward runs under autocast, on the tensors' device type."""
    if not bf16:  # no autocast context to enter: a replica answering one instance feels its cost
        return model(dense, embeddings).float()
    with torch.autocast(dense.device.type, dtype=torch.bfloat16):
        out = model(dense, embeddings)
    return out.float()


def load_model(spec: ModelSpec) -> nn.Module:
    """Import `spec.cls` (`"package.module:Class"`, never evaluated) and build it with
    `spec.kwargs`. A `ValueError` names the spec when its module is not one the operator allows
    (`trillium.job.trust`), or when it cannot be resolved or built."""
    check_model_module(spec.cls)  # before the import: importing a module runs it
    module_name, _, attr = spec.cls.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"model {spec.cls!r}: cannot import module {module_name!r}: {e}") from e
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"model {spec.cls!r}: module {module_name!r} has no {attr!r}")
        obj = getattr(obj, part)
    if not (isinstance(obj, type) and issubclass(obj, nn.Module)):
        raise ValueError(f"model {spec.cls!r} is not a torch.nn.Module subclass")
    try:
        return obj(**spec.kwargs)
    except TypeError as e:
        raise ValueError(f"model {spec.cls!r}: cannot build it with {spec.kwargs}: {e}") from e


def build_model(job: JobConfig) -> nn.Module:
    """The job's model, initialised from `training.seed`: every NN rank and the reference trainer
    build identical weights."""
    torch.manual_seed(job.training.seed)
    return load_model(job.model)


def build_dense_optimizer(config: DenseOptimizerConfig, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    if isinstance(config, DenseSgd):
        return torch.optim.SGD(params, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay)
    if isinstance(config, DenseAdam):
        return torch.optim.Adam(
            params,
            lr=config.lr,
            betas=(config.beta1, config.beta2),
            eps=config.eps,
            weight_decay=config.weight_decay,
        )
    assert isinstance(config, DenseAdagrad)
    return torch.optim.Adagrad(
        params,
        lr=config.lr,
        eps=config.eps,
        initial_accumulator_value=config.initial_accumulator,
        weight_decay=config.weight_decay,
    )
