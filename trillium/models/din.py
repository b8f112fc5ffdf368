"""DIN: attention of a behaviour sequence to the target item."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from .contract import pooled_slots


def _prelu_mlp(width: int, hidden: Sequence[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for size in hidden:
        layers += [nn.Linear(width, size), nn.PReLU()]
        width = size
    layers.append(nn.Linear(width, 1))
    return nn.Sequential(*layers)


class DIN(nn.Module):
    """Zhou et al., "Deep Interest Network for Click-Through Rate Prediction", 2018,
    arXiv:1706.06978 (Eq. 3 and Fig. 2, right).

    The behaviour sequence h_1..h_L is slot `sequence_slot` (pooling `none`, (B, max_len, d)),
    the target (candidate) item t is slot `target_slot` (same dim d; a sequence sum-pooled).
    The activation unit a(.) is a PReLU MLP to one output, and

        w_j = a(concat(h_j, t, h_j - t, h_j ⊙ t))     for every non-padding position j
        u   = sum_j w_j h_j                           (Eq. 3: no softmax over j, as the paper)
        logit = mlp(concat(dense, the other slots, t, u))   a PReLU MLP (the other slots pooled)

    A padding position, a row that is all zero (the contract passes no mask), gets weight 0, so
    padding never changes the output. PReLU where the paper has PReLU or Dice: Dice normalizes
    with batch statistics, and a sample's output must not depend on its batch.
    """

    def __init__(
        self,
        num_dense: int,
        embedding_dims: Sequence[int],
        sequence_slot: int,
        target_slot: int,
        attention_hidden: Sequence[int] = (36,),
        hidden: Sequence[int] = (200, 80),
    ) -> None:
        super().__init__()
        dims = list(embedding_dims)
        for name, index in (("sequence_slot", sequence_slot), ("target_slot", target_slot)):
            if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(dims):
                raise ValueError(f"DIN {name}={index!r} is not a slot index (embedding_dims={dims})")
        if sequence_slot == target_slot:
            raise ValueError(f"DIN sequence_slot and target_slot are both {sequence_slot}")
        if dims[sequence_slot] != dims[target_slot]:
            raise ValueError(
                f"DIN sequence_slot {sequence_slot} (dim {dims[sequence_slot]}) and target_slot {target_slot} "
                f"(dim {dims[target_slot]}) must have the same dim"
            )
        self.sequence_slot, self.target_slot = sequence_slot, target_slot
        dim = dims[target_slot]
        self.attention = _prelu_mlp(4 * dim, attention_hidden)
        others = sum(d for i, d in enumerate(dims) if i not in (sequence_slot, target_slot))
        self.mlp = _prelu_mlp(num_dense + others + 2 * dim, hidden)

    def forward(self, dense: Tensor, embeddings: list[Tensor]) -> Tensor:
        seq = embeddings[self.sequence_slot]
        if seq.dim() == 2:  # a pooled slot: a sequence of one
            seq = seq.unsqueeze(1)
        target = pooled_slots([embeddings[self.target_slot]])[0]
        t = target.unsqueeze(1).expand_as(seq)
        weights = self.attention(torch.cat([seq, t, seq - t, seq * t], dim=-1)).squeeze(-1)  # (B, L)
        weights = weights * (seq != 0).any(dim=-1)  # padding rows: weight 0
        interest = (weights.unsqueeze(-1) * seq).sum(dim=1)
        pooled = pooled_slots(embeddings)
        others = [e for i, e in enumerate(pooled) if i not in (self.sequence_slot, self.target_slot)]
        return self.mlp(torch.cat([dense, *others, target, interest], dim=1)).squeeze(-1)
