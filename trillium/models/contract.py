"""The model contract, and how a job's model and dense optimizer are built.

A model is a plain `torch.nn.Module` whose `forward(dense, embeddings)` takes

- `dense`: float32 (B, num_dense), the normalized dense columns in the job's order;
- `embeddings`: one tensor per feature slot, in the job's slot order: (B, dim) for pooled slots,
  (B, max_len, dim) for sequence slots (pooling `none`), whose padding rows are zero; training
  and evaluation pass a `SlotTensors` (a list that may also hold them `joined`);

and returns logits of shape (B,) (the loss is BCE with logits). A multi-task job's model (`labels:`)
returns (B, T), column k its output for the job's k-th task (`trillium.models.Objective`).

No mask comes with a sequence slot: a row of it is padding iff it is all zero. (An ID whose
embedding is exactly zero, as a not-yet-admitted ID reads, is therefore indistinguishable from
padding; a model that sums or masks such rows loses nothing by it.)
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

__all__ = ["SlotTensors", "build_dense_optimizer", "build_model", "load_model", "logits", "mlp", "pooled_slots"]


class SlotTensors(list):
    """A batch's embeddings as training and evaluation hand them to a model: one tensor per slot,
    in slot order (a list, as the contract says), and, when every slot is a pooled one, `joined`:
    all of them side by side, (B, sum of dims), the tensor the per-slot ones are column views of
    (TorchRec's `KeyedTensor.values()`). A model that concatenates the slots takes `joined`
    instead: the same values, without a copy forward and another backward."""

    joined: Tensor | None = None


def pooled_slots(embeddings: Sequence[Tensor]) -> list[Tensor]:
    """Every slot as (B, dim): a sequence slot (B, max_len, dim) sum-pooled (its padding rows
    are zero, so padding adds nothing), a pooled one as it is."""
    return [e.sum(dim=1) if e.dim() == 3 else e for e in embeddings]


def joined_slots(embeddings: Sequence[Tensor]) -> Tensor:
    """All slots side by side, (B, sum of dims), sequence slots sum-pooled: `SlotTensors.joined`
    when the batch has it (no copy), else a concatenation."""
    joined = getattr(embeddings, "joined", None)
    return joined if joined is not None else torch.cat(pooled_slots(embeddings), dim=1)


def mlp(width: int, hidden: Sequence[int], out: int | None = 1, final_relu: bool = False) -> nn.Sequential:
    """Linear + ReLU for each size in `hidden`, from `width` inputs, then a last Linear to `out`
    (none when `out` is None; ReLU after it too with `final_relu`)."""
    layers: list[nn.Module] = []
    for size in hidden:
        layers += [nn.Linear(width, size), nn.ReLU()]
        width = size
    if out is not None:
        layers.append(nn.Linear(width, out))
        if final_relu:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def mlp_width(width: int, hidden: Sequence[int]) -> int:
    """The output width of `mlp(width, hidden, out=None)`."""
    return hidden[-1] if hidden else width


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
    except (TypeError, ValueError) as e:  # a missing or unknown kwarg, or one the model refuses
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
