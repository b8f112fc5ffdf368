"""MMoE: experts shared by several tasks, mixed per task by a gate of its own."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from .contract import joined_slots, mlp, mlp_width
from .dcn import CrossNetwork, check_cross
from .tasks import task_names


class MMoE(nn.Module):
    """Ma et al., "Modeling Task Relationships in Multi-task Learning with Multi-gate
    Mixture-of-Experts", KDD 2018 (Section 4.2 and Fig. 1c).

    x = concat(dense, slot embeddings) (a sequence slot sum-pooled), width D; with E experts f_i
    (ReLU MLPs, `expert_hidden`) and T tasks, for task k:

        g_k(x) = softmax(W_gk x + b_gk)               W_gk: E x D (the paper has no bias b_gk)
        y_k    = sum_i g_k(x)_i f_i(x)                the task's mixture of the experts
        logit_k = h_k(y_k)                            its tower, a ReLU MLP to one output

    and forward returns the logits (B, T), column k for task `task_names[k]`, also when T = 1
    ((B, 1), not (B,)). `tasks` is the task names, or their number (named "task0", ...).
    `features: dcnv2` first passes x through DCN-V2's cross network (`CrossNetwork`, Eq. 1;
    `cross_layers`, default 2, and `low_rank`), whose output x_L is what the experts and the
    gates read; `features: concat` refuses those two arguments.

    Parameters: `experts[i]` is f_i, `gates[k]` is (W_gk, b_gk), `towers[k]` is h_k, `cross`
    the cross network (None with `concat`). A job trains it with `labels:`, its `tasks` the
    labels' names in order (examples/multitask/job.yaml).
    """

    def __init__(
        self,
        num_dense: int,
        embedding_dims: Sequence[int],
        tasks: Sequence[str] | int,
        num_experts: int = 4,
        expert_hidden: Sequence[int] = (128, 64),
        tower_hidden: Sequence[int] = (32,),
        features: str = "concat",
        cross_layers: int | None = None,
        low_rank: int | None = None,
    ) -> None:
        super().__init__()
        self.task_names = task_names("MMoE", tasks)
        if isinstance(num_experts, bool) or num_experts < 1:
            raise ValueError(f"MMoE num_experts must be >= 1, got {num_experts!r}")
        if features not in ("concat", "dcnv2"):
            raise ValueError(f"MMoE features must be 'concat' or 'dcnv2', got {features!r}")
        if features == "concat" and (cross_layers is not None or low_rank is not None):
            raise ValueError(
                f"MMoE cross_layers={cross_layers} and low_rank={low_rank} need features: dcnv2, got {features!r}"
            )
        cross_layers = 2 if cross_layers is None else cross_layers
        check_cross("MMoE", cross_layers, low_rank)
        width = num_dense + sum(embedding_dims)
        if not width:
            raise ValueError("MMoE needs dense columns or embeddings")
        self.cross = CrossNetwork(width, cross_layers, low_rank) if features == "dcnv2" else None
        self.experts = nn.ModuleList(mlp(width, expert_hidden, out=None) for _ in range(num_experts))
        self.gates = nn.ModuleList(nn.Linear(width, num_experts) for _ in self.task_names)
        expert_out = mlp_width(width, expert_hidden)
        self.towers = nn.ModuleList(mlp(expert_out, tower_hidden, out=1) for _ in self.task_names)

    def forward(self, dense: Tensor, embeddings: list[Tensor]) -> Tensor:
        x = torch.cat([dense, joined_slots(embeddings)], dim=1)
        if self.cross is not None:
            x = self.cross(x)
        f = torch.stack([expert(x) for expert in self.experts], dim=1)  # (B, E, expert_out)
        out = []
        for gate, tower in zip(self.gates, self.towers, strict=True):
            g = torch.softmax(gate(x), dim=1)  # (B, E)
            out.append(tower(torch.einsum("be,beh->bh", g, f)))  # (B, 1)
        return torch.cat(out, dim=1)
