"""ESMM: conversion learnt over every impression, through the click."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .contract import joined_slots, mlp
from .tasks import task_names

# log p of a pCTCVR so near 1 that 1 - p is no longer a float32: its logit is held finite there.
_LOG_P_MAX = -1e-30


def logit_of_product(a: Tensor, b: Tensor) -> Tensor:
    """logit(sigmoid(a) * sigmoid(b)), computed in log space: log p = logsigmoid(a) +
    logsigmoid(b), logit p = log p - log(1 - p), with log(1 - p) = log(-expm1(log p)) near p = 1
    and log1p(-exp(log p)) elsewhere (exact where the product of probabilities would underflow)."""
    log_p = (F.logsigmoid(a) + F.logsigmoid(b)).clamp(max=_LOG_P_MAX)
    log_q = torch.where(log_p > -0.6931471805599453, torch.log(-torch.expm1(log_p)), torch.log1p(-torch.exp(log_p)))
    return log_p - log_q


class ESMM(nn.Module):
    """Ma et al., "Entire Space Multi-Task Model: An Effective Approach for Estimating
    Post-Click Conversion Rate", SIGIR 2018 (Section 2.3, Eq. 2-3, Fig. 2).

    x = concat(dense, slot embeddings) (a sequence slot sum-pooled): the embeddings the CTR and
    CVR networks share (the paper's feature-representation transfer). With h_ctr and h_cvr ReLU
    MLPs (`tower_hidden`) to one logit each:

        pCTR   = sigmoid(h_ctr(x))
        pCVR   = sigmoid(h_cvr(x))                  p(conversion | click, x)
        pCTCVR = pCTR * pCVR                        Eq. 2: p(click and conversion | x)

    forward returns (B, T), column k for task `tasks[k]`: the `ctr` task's column is h_ctr(x), the
    `ctcvr` task's is logit(pCTCVR) (`logit_of_product`), any other task's a tower of its own over
    x. BCE with logits on those two columns, over every impression, is Eq. 3's loss:

        L = sum_i l(y_i, pCTR_i) + sum_i l(y_i & z_i, pCTCVR_i)

    so the CVR network learns from every impression, a clicked one or not, never from the clicked
    ones alone (the sample selection bias the paper removes), and is never given labels of its
    own: its `ctcvr` task's labels are a click-and-conversion over every impression (datagen
    `--multitask`'s `conversion`). `cvr` gives pCVR. Parameters: `towers[name]` a task's tower
    (`towers[ctr]` is h_ctr; the ctcvr task has none), `cvr_tower` h_cvr.
    """

    def __init__(
        self,
        num_dense: int,
        embedding_dims: Sequence[int],
        tasks: Sequence[str] | int,
        ctr: str,
        ctcvr: str,
        tower_hidden: Sequence[int] = (128, 64),
    ) -> None:
        super().__init__()
        self.task_names = task_names("ESMM", tasks)
        for name, role in ((ctr, "ctr"), (ctcvr, "ctcvr")):
            if name not in self.task_names:
                raise ValueError(f"ESMM {role}={name!r} is not one of its tasks {self.task_names}")
        if ctr == ctcvr:
            raise ValueError(f"ESMM ctr and ctcvr must be two tasks, got {ctr!r} for both")
        width = num_dense + sum(embedding_dims)
        if not width:
            raise ValueError("ESMM needs dense columns or embeddings")
        self.ctr, self.ctcvr = ctr, ctcvr
        self.cvr_tower = mlp(width, tower_hidden, out=1)
        # Every task's tower but ctcvr's, whose column the CTR and CVR networks make.
        self.towers = nn.ModuleDict(
            {name: mlp(width, tower_hidden, out=1) for name in self.task_names if name != ctcvr}
        )

    def _x(self, dense: Tensor, embeddings: list[Tensor]) -> Tensor:
        return torch.cat([dense, joined_slots(embeddings)], dim=1)

    def forward(self, dense: Tensor, embeddings: list[Tensor]) -> Tensor:
        x = self._x(dense, embeddings)
        out = {name: tower(x) for name, tower in self.towers.items()}
        out[self.ctcvr] = logit_of_product(out[self.ctr], self.cvr_tower(x))
        return torch.cat([out[name] for name in self.task_names], dim=1)

    def cvr(self, dense: Tensor, embeddings: list[Tensor]) -> Tensor:
        """pCVR, (B,): the conversion's probability given a click."""
        return torch.sigmoid(self.cvr_tower(self._x(dense, embeddings)))[:, 0]
