"""What a model's outputs are trained against and scored by: a job's tasks (`Objective`).

A one-label job (`label:`) trains its (B,) logits by BCE, summed over the batch. A multi-task job
(`labels:`) trains the model's (B, T) outputs, column k against task k's labels:

    loss_sum = sum_k weight_k * sum_{i labelled for k} loss_k(out[i, k], y[i, k])

with loss_k BCE with logits (binary), squared error or Huber (regression, against the label after
its transform). A sample with no label for task k (NaN) adds nothing to task k's loss and gets no
gradient from it. Every trainer divides this sum by its step's sample count (the mean over the
step's samples, however many of them a task labels), so ranks need agree on one count only.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from trillium.job import JobConfig, TaskConfig

__all__ = ["Objective"]


class Objective:
    """A job's tasks, as a trainer, an evaluation and a server use them."""

    def __init__(self, tasks: Sequence[TaskConfig], multitask: bool) -> None:
        if not multitask and (len(tasks) != 1 or tasks[0].kind != "binary"):
            raise ValueError("a one-label objective is one binary task")
        self.tasks, self.multitask = list(tasks), multitask
        self.names = [t.name for t in self.tasks]
        self._binary = torch.tensor([t.kind == "binary" for t in self.tasks])
        self._weights = [float(t.weight) for t in self.tasks]
        self.label_shape = (len(self.tasks),) if multitask else ()  # a sample's labels

    @classmethod
    def of(cls, job: JobConfig) -> Objective:
        return cls(job.tasks, job.multitask)

    @classmethod
    def one_label(cls) -> Objective:
        """A `label:` job's: one binary label, BCE."""
        return cls([TaskConfig(name="label", column="label")], multitask=False)

    def outputs(self, out: Tensor) -> Tensor:
        """The model's output as this objective reads it: (B,) one label, (B, T) several (a
        one-task model's (B,) taken as (B, 1)); any other shape fails naming it."""
        t = len(self.tasks)
        if not self.multitask:
            if out.dim() == 2 and out.shape[1] == 1:
                return out[:, 0]
            if out.dim() != 1:
                raise ValueError(f"the model returned {tuple(out.shape)}; a one-label job needs (B,) logits")
            return out
        if out.dim() == 1 and t == 1:
            return out[:, None]
        if out.dim() != 2 or out.shape[1] != t:
            raise ValueError(f"the model returned {tuple(out.shape)}; this job's {t} tasks {self.names} need (B, {t})")
        return out

    def loss_sums(self, out: Tensor, labels: Tensor) -> Tensor:
        """(T,): each task's weighted loss summed over the batch (module docstring); `out` as
        `outputs` gives it. Their sum is what a trainer back-propagates."""
        if not self.multitask:
            return F.binary_cross_entropy_with_logits(out, labels, reduction="sum").reshape(1)
        has = ~torch.isnan(labels)
        y = torch.where(has, labels, torch.zeros_like(labels))
        sums = []
        for k, task in enumerate(self.tasks):
            if not self._weights[k]:  # a task only scored: no loss, and no 0 * inf to make a NaN
                sums.append(out.new_zeros(()))
                continue
            if task.kind == "binary":
                each = F.binary_cross_entropy_with_logits(out[:, k], y[:, k], reduction="none")
            elif task.loss_name == "huber":
                each = F.huber_loss(out[:, k], y[:, k], reduction="none", delta=task.huber_delta)
            else:
                each = F.mse_loss(out[:, k], y[:, k], reduction="none")
            sums.append(self._weights[k] * (each * has[:, k]).sum())
        return torch.stack(sums)

    def loss_sum(self, out: Tensor, labels: Tensor) -> Tensor:
        """The batch's summed loss over every task."""
        if not self.multitask:
            return F.binary_cross_entropy_with_logits(out, labels, reduction="sum")
        return self.loss_sums(out, labels).sum()

    def loss_mean(self, out: Tensor, labels: Tensor) -> Tensor:
        """`loss_sum` over the batch's sample count: a single-process trainer's loss."""
        if not self.multitask:
            return F.binary_cross_entropy_with_logits(out, labels)
        return self.loss_sum(out, labels) / max(len(labels), 1)

    def scores(self, out: Tensor) -> Tensor:
        """What evaluation and progressive validation score: a binary task's probability, a
        regression task's prediction on its transformed scale (where its loss and MSE are)."""
        if not self.multitask:
            return torch.sigmoid(out)
        return torch.where(self._binary.to(out.device), torch.sigmoid(out), out)

    def positive(self, labels: np.ndarray) -> np.ndarray:
        """bool (B,): the samples with a positive label (for several tasks, of any binary task)."""
        if not self.multitask:
            return labels > 0.5
        binary = self._binary.numpy()
        return (labels[:, binary] > 0.5).any(axis=1)

    def answers(self, scores: np.ndarray) -> np.ndarray:
        """Serving's answers from `scores`: a regression task's transform undone (its label's own
        units), the rest as they are."""
        if not self.multitask:
            return scores
        out = np.array(scores, dtype=np.float64)
        for k, task in enumerate(self.tasks):
            if task.transform == "log":
                out[:, k] = np.exp(out[:, k])
            elif task.transform == "log1p":
                out[:, k] = np.expm1(out[:, k])
        return out
