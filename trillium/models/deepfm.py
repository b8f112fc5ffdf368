"""DeepFM: a factorization machine and a deep network sharing the slot embeddings."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from .contract import mlp, pooled_slots


class DeepFM(nn.Module):
    """Guo et al., "DeepFM: A Factorization-Machine based Neural Network for CTR Prediction",
    2017, arXiv:1703.04247 (Eq. 1-4).

    The fields are the slot embeddings v_1..v_m (all of one dim d; a sequence slot sum-pooled)
    and, with dense columns, one more: v_0 = P dense (P: d x num_dense, no bias), the sum of a
    vector per dense column scaled by its value as the paper's FM has it. Then

        y_FM   = b + <w_dense, dense> + sum_f <w_f, v_f>                      first order
                 + 1/2 sum_k ((sum_f v_f,k)^2 - sum_f v_f,k^2)                second order (Eq. 2)
        y_DNN  = deep(concat(dense, v_1, ..., v_m))                           a ReLU MLP (Eq. 3-4)
        logit  = y_FM + y_DNN

    Deviations: the paper's first order is a scalar weight per ID; Trillium's tables hold one
    vector per ID and nothing else, so the first order of a slot is a learned linear function
    <w_f, v_f> of its embedding (`slot_linear[f]`). The deep part reads the dense columns as they
    are, beside the slot embeddings (the paper's fields are all categorical).
    """

    def __init__(self, num_dense: int, embedding_dims: Sequence[int], hidden: Sequence[int] = (256, 128)) -> None:
        super().__init__()
        if not embedding_dims:
            raise ValueError("DeepFM needs at least one slot (embedding_dims is empty)")
        if len(set(embedding_dims)) > 1:
            raise ValueError(
                f"DeepFM needs every slot's embedding dim equal, got embedding_dims={list(embedding_dims)}"
            )
        dim = embedding_dims[0]
        self.bias = nn.Parameter(torch.zeros(1))
        self.dense_linear = nn.Linear(num_dense, 1, bias=False) if num_dense else None
        self.dense_field = nn.Linear(num_dense, dim, bias=False) if num_dense else None
        self.slot_linear = nn.Parameter(torch.empty(len(embedding_dims), dim))
        nn.init.normal_(self.slot_linear, std=dim**-0.5)
        self.deep = mlp(num_dense + sum(embedding_dims), hidden)

    def forward(self, dense: Tensor, embeddings: list[Tensor]) -> Tensor:
        slots = torch.stack(pooled_slots(embeddings), dim=1)  # (B, m, d)
        first = self.bias + (slots * self.slot_linear).sum(dim=(1, 2))
        fields = slots
        if self.dense_linear is not None and self.dense_field is not None:
            first = first + self.dense_linear(dense).squeeze(-1)
            fields = torch.cat([self.dense_field(dense).unsqueeze(1), slots], dim=1)
        second = 0.5 * (fields.sum(dim=1).square() - fields.square().sum(dim=1)).sum(dim=1)
        deep = self.deep(torch.cat([dense, slots.flatten(1)], dim=1)).squeeze(-1)
        return first + second + deep
