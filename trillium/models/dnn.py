"""The default model: PERSIA's DNN."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from .contract import joined_slots, mlp


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
        self.mlp = mlp(width, hidden)

    def forward(self, dense: Tensor, embeddings: list[Tensor]) -> Tensor:
        parts = []
        if self.dense_proj is not None:
            parts.append(self.dense_proj(dense))
        if self.sparse_proj is not None:
            parts.append(self.sparse_proj(joined_slots(embeddings)))
        return self.mlp(torch.cat(parts, dim=1)).squeeze(-1)
