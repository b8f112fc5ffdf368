"""DLRM: dot-product interactions of the dense features and the slot embeddings."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from .contract import mlp, pooled_slots


class DLRM(nn.Module):
    """Naumov et al., "Deep Learning Recommendation Model for Personalization and Recommendation
    Systems", 2019, arXiv:1906.00091 (Section 2.1 and Fig. 1; the `dot` interaction of the
    reference implementation).

    With x = bottom(dense) (a ReLU MLP to the embedding dim d) and e_1..e_m the slot embeddings,
    the features T = [x, e_1, ..., e_m] (n = m + 1 rows of dim d) interact pairwise:

        z = (<T_i, T_j> for i < j)           n(n-1)/2 dot products, the strict upper triangle
        logit = top(concat(x, z))            a ReLU MLP to one output

    Every slot must have the same dim (the dot products need it); a sequence slot is sum-pooled.
    Without dense columns there is no bottom MLP and T is the slot embeddings alone.
    """

    def __init__(
        self,
        num_dense: int,
        embedding_dims: Sequence[int],
        bottom: Sequence[int] = (64,),
        top: Sequence[int] = (128, 64),
    ) -> None:
        super().__init__()
        if len(set(embedding_dims)) > 1:
            raise ValueError(f"DLRM needs every slot's embedding dim equal, got embedding_dims={list(embedding_dims)}")
        if not embedding_dims:
            raise ValueError("DLRM needs at least one slot (embedding_dims is empty)")
        dim = embedding_dims[0]
        self.bottom = mlp(num_dense, bottom, out=dim, final_relu=True) if num_dense else None
        n = len(embedding_dims) + (1 if num_dense else 0)
        self.num_interactions = n * (n - 1) // 2
        rows, cols = torch.triu_indices(n, n, offset=1)
        self.register_buffer("pairs_i", rows, persistent=False)
        self.register_buffer("pairs_j", cols, persistent=False)
        self.top = mlp((dim if num_dense else 0) + self.num_interactions, top)

    def forward(self, dense: Tensor, embeddings: list[Tensor]) -> Tensor:
        features = pooled_slots(embeddings)
        kept: list[Tensor] = []
        if self.bottom is not None:
            x = self.bottom(dense)
            features = [x, *features]
            kept.append(x)
        t = torch.stack(features, dim=1)  # (B, n, d)
        gram = torch.bmm(t, t.transpose(1, 2))  # (B, n, n)
        kept.append(gram[:, self.pairs_i, self.pairs_j])
        return self.top(torch.cat(kept, dim=1)).squeeze(-1)
