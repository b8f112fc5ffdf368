"""PLE: experts of each task's own beside shared ones, extracted level by level."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from .contract import joined_slots, mlp, mlp_width
from .tasks import task_names


def _gate(gate: nn.Linear, q: Tensor, experts: list[Tensor]) -> Tensor:
    """softmax(W q + b) over `experts` (each (B, H)): their mixture, (B, H)."""
    g = torch.softmax(gate(q), dim=1)  # (B, E)
    return torch.einsum("be,beh->bh", g, torch.stack(experts, dim=1))


class ExtractionLevel(nn.Module):
    """One level of PLE (CGC, Customized Gate Control, when it is the only one): see `PLE`."""

    def __init__(
        self, width: int, tasks: int, task_experts: int, shared_experts: int, hidden: Sequence[int], last: bool
    ):
        super().__init__()
        self.task_experts = nn.ModuleList(
            nn.ModuleList(mlp(width, hidden, out=None) for _ in range(task_experts)) for _ in range(tasks)
        )
        self.shared_experts = nn.ModuleList(mlp(width, hidden, out=None) for _ in range(shared_experts))
        self.task_gates = nn.ModuleList(nn.Linear(width, task_experts + shared_experts) for _ in range(tasks))
        # The shared path feeds the next level only: the last one has no shared gate.
        self.shared_gate = None if last else nn.Linear(width, tasks * task_experts + shared_experts)

    def forward(self, q_tasks: list[Tensor], q_shared: Tensor) -> tuple[list[Tensor], Tensor | None]:
        shared = [expert(q_shared) for expert in self.shared_experts]
        own = [[expert(q) for expert in experts] for experts, q in zip(self.task_experts, q_tasks, strict=True)]
        out = [_gate(gate, q, mine + shared) for gate, q, mine in zip(self.task_gates, q_tasks, own, strict=True)]
        if self.shared_gate is None:
            return out, None
        return out, _gate(self.shared_gate, q_shared, [e for mine in own for e in mine] + shared)


class PLE(nn.Module):
    """Tang et al., "Progressive Layered Extraction (PLE): A Novel Multi-Task Learning (MTL) Model
    for Personalized Recommendations", RecSys 2020 (Sections 4.2-4.3, Eq. 3-7, Fig. 4-5).

    x = concat(dense, slot embeddings) (a sequence slot sum-pooled). Level j = 1 .. `levels` holds,
    for each task k, `task_experts` experts E^{k,j}_i of its own and `shared_experts` experts
    E^{s,j}_i of every task (ReLU MLPs, `expert_hidden`). It reads task k's path q^{k,j-1} and the
    shared path q^{s,j-1}, both x at the first level:

        S^{k,j} = [E^{k,j}_i(q^{k,j-1}) for i <= m_k] + [E^{s,j}_i(q^{s,j-1}) for i <= m_s]   Eq. 6
        q^{k,j} = softmax(W^{k,j} q^{k,j-1} + b^{k,j}) . S^{k,j}                          Eq. 4-5, 7
        q^{s,j} = softmax(W^{s,j} q^{s,j-1} + b^{s,j}) . (every task's experts of level j, then
                  the shared ones)                                   the shared gate, but at the last level

    and task k's logit is t^k(q^{k,L}) (Eq. 3), a ReLU MLP (`tower_hidden`) to one output.
    forward returns (B, T), column k for task `tasks[k]`. One level is CGC. Parameters:
    `levels[j].task_experts[k][i]`, `levels[j].shared_experts[i]`, `levels[j].task_gates[k]`,
    `levels[j].shared_gate` (None at the last level), `towers[k]`.
    """

    def __init__(
        self,
        num_dense: int,
        embedding_dims: Sequence[int],
        tasks: Sequence[str] | int,
        levels: int = 2,
        task_experts: int = 1,
        shared_experts: int = 1,
        expert_hidden: Sequence[int] = (64,),
        tower_hidden: Sequence[int] = (32,),
    ) -> None:
        super().__init__()
        self.task_names = task_names("PLE", tasks)
        for name, value, least in (
            ("levels", levels, 1),
            ("task_experts", task_experts, 1),
            ("shared_experts", shared_experts, 0),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"PLE {name} must be an integer >= {least}, got {value!r}")
        if not expert_hidden:
            raise ValueError("PLE expert_hidden needs at least one layer: an expert is an MLP")
        width = num_dense + sum(embedding_dims)
        if not width:
            raise ValueError("PLE needs dense columns or embeddings")
        out = mlp_width(width, expert_hidden)
        t = len(self.task_names)
        self.levels = nn.ModuleList(
            ExtractionLevel(width if j == 0 else out, t, task_experts, shared_experts, expert_hidden, j == levels - 1)
            for j in range(levels)
        )
        self.towers = nn.ModuleList(mlp(out, tower_hidden, out=1) for _ in self.task_names)

    def forward(self, dense: Tensor, embeddings: list[Tensor]) -> Tensor:
        x = torch.cat([dense, joined_slots(embeddings)], dim=1)
        q_tasks, q_shared = [x] * len(self.task_names), x
        for level in self.levels:
            q_tasks, q_shared = level(q_tasks, q_shared)
        return torch.cat([tower(q) for tower, q in zip(self.towers, q_tasks, strict=True)], dim=1)
