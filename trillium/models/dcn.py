"""DCN-V2: explicit feature crosses beside (or before) a deep network."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from .contract import joined_slots, mlp, mlp_width


class CrossNetwork(nn.ModuleList):
    """DCN-V2's cross layers (Eq. 1, or Eq. 2's low rank), x0 (B, D) -> x_L (B, D):

        x_{l+1} = x0 ⊙ (W_l x_l + b_l) + x_l          W_l: D x D, or U_l V_l^T with `low_rank` r

    A `ModuleList` of the layers, so a model holding one as `cross` keeps the parameter names
    `cross.<l>...`: with `low_rank`, `[l][0]` is V_l^T (D -> r, no bias) and `[l][1]` is U_l with
    b_l; otherwise `[l]` is W_l with b_l. The models using it validate `layers` and `low_rank`
    (`check_cross`), so that their errors name the model and its arguments.
    """

    def __init__(self, width: int, layers: int, low_rank: int | None = None) -> None:
        def layer() -> nn.Module:
            if low_rank is None:
                return nn.Linear(width, width)
            return nn.Sequential(nn.Linear(width, low_rank, bias=False), nn.Linear(low_rank, width))

        super().__init__(layer() for _ in range(layers))

    def forward(self, x0: Tensor) -> Tensor:
        x = x0
        for layer in self:
            x = x0 * layer(x) + x
        return x


def check_cross(model: str, cross_layers: int, low_rank: int | None) -> None:
    """A ValueError naming `model` and the argument unless a `CrossNetwork` can be built of them."""
    if cross_layers < 0:
        raise ValueError(f"{model} cross_layers must be >= 0, got {cross_layers}")
    if low_rank is not None and low_rank < 1:
        raise ValueError(f"{model} low_rank must be a positive int or null, got {low_rank}")


class DCNv2(nn.Module):
    """Wang et al., "DCN V2: Improved Deep & Cross Network and Practical Lessons for Web-scale
    Learning to Rank Systems", 2021, arXiv:2008.13535 (Eq. 1, Fig. 2 and 3; the low-rank cross
    of Eq. 2 without its mixture of experts).

    x0 = concat(dense, slot embeddings) (a sequence slot sum-pooled), width D. Cross layer l
    (`CrossNetwork`):

        x_{l+1} = x0 ⊙ (W_l x_l + b_l) + x_l          W_l: D x D, or U_l V_l^T with `low_rank` r

    `structure: stacked`: logit = w^T deep(x_L) + b (the deep ReLU MLP on the cross output);
    `parallel`: logit = w^T concat(x_L, deep(x0)) + b.
    """

    def __init__(
        self,
        num_dense: int,
        embedding_dims: Sequence[int],
        cross_layers: int = 3,
        structure: str = "stacked",
        low_rank: int | None = None,
        hidden: Sequence[int] = (256, 128),
    ) -> None:
        super().__init__()
        if structure not in ("stacked", "parallel"):
            raise ValueError(f"DCNv2 structure must be 'stacked' or 'parallel', got {structure!r}")
        check_cross("DCNv2", cross_layers, low_rank)
        width = num_dense + sum(embedding_dims)
        if not width:
            raise ValueError("DCNv2 needs dense columns or embeddings")
        self.structure = structure
        self.cross = CrossNetwork(width, cross_layers, low_rank)
        self.deep = mlp(width, hidden, out=None)
        out = mlp_width(width, hidden) + (width if structure == "parallel" else 0)
        self.out = nn.Linear(out, 1)

    def forward(self, dense: Tensor, embeddings: list[Tensor]) -> Tensor:
        x0 = torch.cat([dense, joined_slots(embeddings)], dim=1)
        x = self.cross(x0)
        if self.structure == "stacked":
            return self.out(self.deep(x)).squeeze(-1)
        return self.out(torch.cat([x, self.deep(x0)], dim=1)).squeeze(-1)
