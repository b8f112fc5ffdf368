"""Where a rank trains (device and collective backend) and what one synchronous step is.

Shapes in a step: B samples in this rank's batch, S samples in the step over all R ranks, F
feature slots of dims D_f: dense [B, num_dense], labels [B], embeddings[f] [B, D_f] (pooled) or
[B, L_f, D_f] (a sequence slot, padded to L_f = max_len).

Loss scaling: each rank's loss is `R * sum(per-sample losses of its batch) / S`, so DDP's average
of the ranks' gradients is the gradient of the mean loss over the whole step; the embedding
gradients are divided by R for the same reason. With one rank this is plain mean-loss SGD, which
the golden test compares against a single-process reference.

Every call into torch runs on the rank's one torch thread (`Trainer.thread`): collectives are
issued in one order, and the thread's current CUDA device is this rank's.
"""

from __future__ import annotations

import copy
import io
import logging
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from trillium.batch import Batch

logger = logging.getLogger("trillium.nn_worker")

ENV_DEVICE = "TRILLIUM_DEVICE"  # cpu, cuda or cuda:N: overrides the automatic choice


@dataclass(frozen=True)
class Placement:
    device: torch.device
    ident: str  # "cpu", or "cuda:<uuid>" of the GPU: how ranks tell whether they share one


def local_placement(rank: int) -> Placement:
    """This rank's device: its own GPU when the host has enough (rank r takes GPU r mod n, as
    ranks on one host number from 0), else the CPU; TRILLIUM_DEVICE overrides."""
    wanted = os.environ.get(ENV_DEVICE, "").strip()
    if wanted == "cpu" or not torch.cuda.is_available():
        return Placement(torch.device("cpu"), "cpu")
    index = int(wanted.split(":", 1)[1]) if wanted.startswith("cuda:") else rank % torch.cuda.device_count()
    device = torch.device("cuda", index)
    return Placement(device, f"cuda:{torch.cuda.get_device_properties(index).uuid}")


def choose_backend(idents: Sequence[str]) -> tuple[str, str]:
    """The collective backend for ranks placed on `idents` (one per rank), and why.

    NCCL needs every rank on a GPU of its own: ranks sharing a GPU fail in NCCL's communicator
    setup ("Duplicate GPU detected"). Otherwise gloo, which all-reduces CPU and CUDA tensors alike.
    """
    gpus = [i for i in idents if i != "cpu"]
    if gpus and len(gpus) == len(idents) and len(set(gpus)) == len(gpus):
        return "nccl", f"every one of the {len(idents)} ranks has a GPU of its own"
    if not gpus:
        return "gloo", "no rank has a GPU"
    if len(gpus) < len(idents):
        return "gloo", f"{len(idents) - len(gpus)} of {len(idents)} ranks have no GPU"
    return "gloo", f"{len(idents)} ranks share {len(set(gpus))} GPU(s): NCCL needs one per rank"


@dataclass(frozen=True)
class Control:
    """What the ranks agree on before every step (one small all-reduce)."""

    samples: int  # in the step, over all ranks
    paused: bool  # some rank has heard the job is paused
    seq: int  # the highest checkpoint request any rank has heard of


class Trainer:
    """The dense model of one rank under DDP, and its optimizer."""

    def __init__(self, thread: ThreadPoolExecutor, ddp: torch.nn.parallel.DistributedDataParallel,
                 optimizer: torch.optim.Optimizer, device: torch.device, world: int, rank: int,
                 control_group: Any) -> None:
        self.thread = thread
        self.ddp = ddp
        self.model = ddp.module
        self.optimizer = optimizer
        self.device = device
        self.world = world
        self.rank = rank
        self.control_group = control_group

    def control(self, batch_size: int, paused: bool, seq: int) -> Control:
        """Row r of a [R, 3] table is rank r's word; a sum all-reduce gives every rank all of them."""
        table = torch.zeros((self.world, 3), dtype=torch.int64)
        table[self.rank] = torch.tensor([batch_size, int(paused), seq])
        dist.all_reduce(table, group=self.control_group)
        return Control(samples=int(table[:, 0].sum()), paused=bool(table[:, 1].any()), seq=int(table[:, 2].max()))

    def step(self, batch: Batch, embeddings: list[np.ndarray], step_samples: int) -> tuple[float, list[np.ndarray]]:
        """One synchronous step; returns (sum of this rank's losses, embedding gradients)."""
        device = self.device
        dense = torch.from_numpy(np.array(batch.dense, dtype=np.float32)).to(device)
        labels = torch.from_numpy(np.array(batch.labels, dtype=np.float32)).to(device)
        embs = [torch.from_numpy(e).to(device).requires_grad_() for e in embeddings]
        loss_sum = F.binary_cross_entropy_with_logits(self.ddp(dense, embs), labels, reduction="sum")
        self.optimizer.zero_grad(set_to_none=True)
        (loss_sum * (self.world / max(step_samples, 1))).backward()
        self.optimizer.step()
        grads = [(e.grad if e.grad is not None else torch.zeros_like(e)).div(self.world).cpu().numpy() for e in embs]
        return loss_sum.item(), grads

    def scores(self, batch: Batch, embeddings: list[np.ndarray]) -> np.ndarray:
        """Predicted probabilities of a batch (evaluation: no gradients, the model in eval mode)."""
        device = self.device
        self.model.eval()
        try:
            with torch.no_grad():
                dense = torch.from_numpy(np.array(batch.dense, dtype=np.float32)).to(device)
                logits = self.model(dense, [torch.from_numpy(e).to(device) for e in embeddings])
            return torch.sigmoid(logits).cpu().numpy()
        finally:
            self.model.train()

    def dense_state(self) -> bytes:
        """The model and optimizer state as `torch.save` bytes of plain state_dicts (loadable
        with weights_only=True): a copy, so training may go on while it is written."""
        state = {"model": {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()},
                 "optimizer": copy.deepcopy(self.optimizer.state_dict())}
        buffer = io.BytesIO()
        torch.save(state, buffer)
        return buffer.getvalue()

    def load_dense(self, data: bytes) -> None:
        state = torch.load(io.BytesIO(data), map_location=self.device, weights_only=True)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
