"""Where a rank trains (device and collective backend) and what one synchronous step is.

Shapes in a step: B samples in this rank's batch, S samples in the step over all R ranks, F
feature slots of dims D_f: dense [B, num_dense], labels [B] (a multi-task job's [B, T]: see
`trillium.models.Objective`), embeddings[f] [B, D_f] (pooled) or [B, L_f, D_f] (a sequence slot,
padded to L_f = max_len).

Loss scaling: each rank back-propagates the sum of its batch's per-sample losses; the step's
one all-reduce (a DDP communication hook) sums the ranks' gradients together with every rank's
control words — its batch size among them — and divides the sum by S, giving the gradient of the
mean loss over the whole step. The embedding gradients are divided by the same S. With one rank
this is plain mean-loss SGD, which the golden test compares against a single-process reference.

Control words ride on that all-reduce: each rank's batch size, whether it has heard the job is
paused, and the newest checkpoint and model version requests it has heard of; after them, its
batch's loss sum of each task. Every rank reads the same sums after the step, so all agree, at no
collective of their own, on the step's sample count, on holding or cutting before the next step,
and on publishing a version cut after it, and every rank reports the whole step's mean loss.
Only while holding do the ranks all-reduce control words alone.

Every call into torch runs on the rank's one torch thread (`Trainer.thread`): collectives are
issued in one order, and the thread's current CUDA device is this rank's.
"""

from __future__ import annotations

import copy
import io
import logging
import os
import weakref
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

import numpy as np
import torch
import torch.distributed as dist

from trillium.models import Objective, SlotTensors, logits
from trillium.timeouts import RANK_FINISH_S
from trillium.wire.batch import Batch

from .embeddings import SlotEmbeddings

logger = logging.getLogger("trillium.nn_worker")

ENV_DEVICE = "TRILLIUM_DEVICE"  # cpu, cuda or cuda:N: overrides the automatic choice
FINISH_TIMEOUT = timedelta(seconds=RANK_FINISH_S)

# A rank's control words: its batch size, paused, the checkpoint and the model version requests
# it has heard of. They travel in the gradients' dtype: exact integers below 2**24 in float32.
# In a step, each task's loss sum follows them in the rank's row (a float, for the step's mean).
WORDS = 4


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
    """What the ranks agreed on in a step's all-reduce (or, while they hold, in `Trainer.control`)."""

    samples: int  # in the step, over all ranks (0 outside a step)
    paused: bool  # some rank has heard the job is paused
    seq: int  # the highest checkpoint request any rank has heard of
    publish: int  # the highest model version request any rank has heard of

    @classmethod
    def of(cls, table: torch.Tensor) -> Control:
        """From the all-reduced table whose row r was rank r's words (the others' zeros), first WORDS columns."""
        words = table.to(torch.int64)
        return cls(
            samples=int(words[:, 0].sum()),
            paused=bool(words[:, 1].any()),
            seq=int(words[:, 2].max()),
            publish=int(words[:, 3].max()),
        )


@dataclass(frozen=True)
class StepResult:
    loss_sum: float  # of this rank's batch
    grads: SlotEmbeddings  # the embedding gradients, in the embeddings' form
    probs: np.ndarray  # the batch's scores before the update (`Objective.scores`): its progressive validation
    control: Control  # the step's agreement
    task_loss_sums: list[float]  # each task's part of `loss_sum`, in task order
    step_loss_sums: list[float]  # each task's loss summed over the whole step: every rank's batch


class HostStaging:
    """One host buffer that a batch's inputs are packed into, for a single host→device copy.

    Pinned on CUDA, so that copy is DMA which `non_blocking` lets run while the host goes on.
    Reused by every step and grown to the largest batch: overwriting it is safe because every
    step and every scoring ends by waiting for its results, which the stream computes after it
    has read the buffer.
    """

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self.buffer = torch.empty(0, dtype=torch.float32)

    def pack(self, arrays: Sequence[np.ndarray]) -> torch.Tensor:
        """The arrays as float32, one after another in C order, in a view of the buffer."""
        total = sum(a.size for a in arrays)
        if self.buffer.numel() < total:
            self.buffer = torch.empty(total, dtype=torch.float32, pin_memory=self.pin)
        flat = self.buffer.numpy()
        offset = 0
        for a in arrays:
            # np.copyto takes read-only and fp16 arrays too (torch.from_numpy wants writable ones).
            np.copyto(flat[offset : offset + a.size].reshape(a.shape), a, casting="unsafe")
            offset += a.size
        return self.buffer[:total]


def _parts(flat: torch.Tensor, embeddings: SlotEmbeddings) -> list[torch.Tensor]:
    """A flat tensor holding the pooled block then each sequence slot (`HostStaging`'s order), as
    views of their shapes."""
    shapes = [embeddings.pooled.shape, *(s.shape for s in embeddings.sequences)]
    return [part.view(shape) for part, shape in zip(flat.split([int(np.prod(s)) for s in shapes]), shapes, strict=True)]


def _per_slot(parts: list[torch.Tensor], widths: Sequence[int]) -> SlotTensors:
    """The model's inputs, one per slot: the pooled block's columns of each pooled slot (views:
    autograd joins their gradients back into the block's), each sequence slot's own tensor; with
    no sequence slot, the block itself as `joined`."""
    pooled, *sequences = parts
    columns = iter(pooled.split([w for w in widths if w], dim=1))
    rest = iter(sequences)
    slots = SlotTensors(next(columns) if width else next(rest) for width in widths)
    if widths and all(widths):
        slots.joined = pooled
    return slots


def _reduce_hook(trainer: weakref.ref[Trainer], bucket):  # DDP refuses a string annotation on `bucket`
    return trainer()._reduce(bucket)


class Trainer:
    """The dense model of one rank under DDP, and its optimizer.

    The pooled slots' embeddings are one leaf tensor, as the wire carries them, split into the
    model's per-slot inputs: their gradients come back joined in one block (what the wire takes)
    instead of a leaf, a gradient and a copy per slot. On CUDA a batch's inputs arrive in one
    non-blocking copy (`HostStaging`) and all the embeddings are one leaf, so their gradients
    leave in one copy; results go back into pinned memory without waiting, then one
    synchronization ends the step. On the CPU the embeddings are used in place. Either way the
    arithmetic is the same, so a step on the CPU gives the same bits as before staging existed
    (the golden test). `staged` runs the CUDA path's host side on the CPU (unpinned), for tests
    without a GPU.
    """

    def __init__(
        self,
        thread: ThreadPoolExecutor,
        ddp: torch.nn.parallel.DistributedDataParallel,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        world: int,
        rank: int,
        control_group: Any,
        precision: Literal["fp32", "bf16"] = "fp32",
        staged: bool = False,
        objective: Objective | None = None,
    ) -> None:
        self.thread = thread
        self.objective = objective or Objective.one_label()
        self.ddp = ddp
        self.model = ddp.module
        self.optimizer = optimizer
        self.device = device
        self.world = world
        self.rank = rank
        self.control_group = control_group
        self.bf16 = precision == "bf16"
        cuda = device.type == "cuda"
        self.staging = HostStaging(pin=cuda) if cuda or staged else None
        odd = {p.dtype for p in self.model.parameters() if p.requires_grad} - {torch.float32, torch.float64}
        if odd:  # the control words travel in the gradients' dtype, and must stay exact integers
            raise ValueError(f"the model's trained parameters must be float32 or float64, not {sorted(map(str, odd))}")
        self._columns = WORDS + len(self.objective.tasks)  # the control words, then each task's loss sum
        self._words: torch.Tensor | None = None  # this step's [R * columns] control words (row `rank` ours)
        self._agreed: torch.Tensor | None = None  # their all-reduced [R, columns] table
        self._samples: torch.Tensor | None = None  # the step's sample count (at least 1), on the device
        # The hook's state lives in DDP's C++ reducer, where Python's GC cannot see it: the Trainer
        # itself there would make a cycle (Trainer -> DDP -> reducer -> Trainer) never collected,
        # and every finished job's process group would live on with its gloo threads.
        ddp.register_comm_hook(weakref.ref(self), _reduce_hook)

    def control(self, paused: bool, seq: int, publish: int = 0) -> Control:
        """The ranks' agreement outside a step (before the first, and while they hold): row r of a
        [R, WORDS] table is rank r's words; a sum all-reduce gives every rank all of them."""
        table = torch.zeros((self.world, WORDS), dtype=torch.int64)
        table[self.rank] = torch.tensor([0, int(paused), seq, publish])
        dist.all_reduce(table, group=self.control_group)
        return Control.of(table)

    def step(
        self, batch: Batch, embeddings: SlotEmbeddings, paused: bool = False, seq: int = 0, publish: int = 0
    ) -> StepResult:
        """One synchronous step, telling the other ranks what this one has heard (`paused`, the
        checkpoint request `seq`, the model version request `publish`).

        The loss comes back with the gradients, which the caller needs every step anyway: reading
        it costs no synchronization of its own.
        """
        dense, labels, leaves, embs = self._inputs(
            batch.dense, batch.labels, embeddings, grad=True, words=(batch.batch_size, int(paused), seq, publish)
        )
        out = self._forward(self.ddp, dense, embs)
        task_sums = self.objective.loss_sums(out, labels)
        loss_sum = task_sums.sum()
        # The loss sums join the words in a table of their own: writing into the staged inputs
        # would change tensors that autograd saved for the backward.
        assert self._words is not None
        losses = self._words.new_zeros((self.world, len(task_sums)))
        losses[self.rank] = task_sums.detach()
        self._words = torch.cat([self._words.view(self.world, WORDS), losses], 1).ravel()
        self.optimizer.zero_grad(set_to_none=True)
        self._agreed = None
        loss_sum.backward()  # the hook has all-reduced the gradients and the words once it returns
        assert self._agreed is not None, "DDP's communication hook did not run"
        # A step of no sample at all (an idle stream's tick, which carries the control words while
        # no data comes) changes no weight: an optimizer with momentum would move them on zero
        # gradients. Only a rank with an empty batch of its own asks (on CUDA, a synchronization).
        if batch.batch_size or int(self._agreed[:, 0].sum()):
            self.optimizer.step()
        grads = [(x.grad if x.grad is not None else torch.zeros_like(x)).div_(self._samples) for x in leaves]
        loss, tasks, probs, table, *grads = self._to_host(
            [loss_sum.detach(), task_sums.detach(), self.objective.scores(out.detach()), self._agreed, *grads]
        )
        if self.staging is not None:  # one leaf for every slot: split it
            grads = _parts(grads[0], embeddings)
        pooled, *sequences = (g.numpy() for g in grads)
        return StepResult(
            loss.item(),
            SlotEmbeddings(pooled, embeddings.widths, sequences),
            probs.numpy(),
            Control.of(table),
            tasks.tolist(),
            table[:, WORDS:].sum(0).tolist(),
        )

    def _reduce(self, bucket):  # a dist.GradBucket -> a Future of a tensor (DDP refuses string annotations)
        """DDP's communication hook: a bucket's gradients all-reduced with the step's control words,
        their sum divided by the step's sample count. Every bucket carries the words (a model of
        many buckets sums them in each), so each knows the count."""
        grads = bucket.buffer()
        assert self._words is not None
        joined = torch.cat([grads, self._words.to(grads.dtype)])
        reduced = dist.all_reduce(joined, group=self.ddp.process_group, async_op=True).get_future()
        # Not `self`: gloo's thread may drop this callback after the step has returned, and the
        # trainer's last reference dropped there tears its group down on the group's own thread
        # (std::terminate, "Resource deadlock avoided").
        trainer = weakref.ref(self)

        def finish(done: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
            out, me = done.value()[0], trainer()
            assert me is not None, "the step that waits for its gradients holds its trainer"
            me._agreed = out[grads.numel() :].view(me.world, me._columns)
            me._samples = me._agreed[:, 0].sum().clamp(min=1)
            return out[: grads.numel()].div_(me._samples)

        return reduced.then(finish)

    def scores(self, batch: Batch, embeddings: SlotEmbeddings) -> np.ndarray:
        """Predicted probabilities of a batch (evaluation: no gradients, the model in eval mode)."""
        self.model.eval()
        try:
            with torch.no_grad():
                dense, _, _, embs = self._inputs(batch.dense, batch.labels, embeddings, grad=False)
                out = self._forward(self.model, dense, embs)
            # A blocking copy: the caller keeps the array (pinned memory is for reuse), and the
            # wait frees the staging buffer.
            return self.objective.scores(out).cpu().numpy()
        finally:
            self.model.train()

    def warm_up(self, batch_size: int, num_dense: int, shapes: Sequence[tuple[int, ...]]) -> None:
        """One untimed forward and backward of a zero batch at the job's shapes and precision.

        The first GEMM of each shape and dtype creates cuBLAS's handle and workspace (per thread:
        hence on the torch thread) and loads its kernels; backward has GEMMs of its own and starts
        autograd's device thread; the staging buffer and the pinned results are allocated. On a
        deep copy of the module, without DDP (whose hooks on the parameters would all-reduce) and
        without an optimizer step: the parameters and the optimizer state stay as they were.
        """
        dense, labels, leaves, embs = self._inputs(
            np.zeros((batch_size, num_dense), np.float32),
            np.zeros((batch_size, *self.objective.label_shape), np.float32),
            SlotEmbeddings.of([np.zeros((batch_size, *shape), np.float32) for shape in shapes]),
            grad=True,
        )
        out = self._forward(copy.deepcopy(self.model), dense, embs)
        self.objective.loss_sum(out, labels).backward()
        self._to_host([out.detach(), *(x.grad for x in leaves if x.grad is not None)])

    def _inputs(
        self,
        dense: np.ndarray,
        labels: np.ndarray,
        embeddings: SlotEmbeddings,
        grad: bool,
        words: tuple[int, int, int, int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        """On the device: dense [B, num_dense], labels [B], the leaves whose `.grad` are the
        embedding gradients (the pooled block's, then each sequence slot's; on CUDA one leaf
        for all), and embeddings[f] as the model takes them; `words` (this rank's control words)
        become `self._words`, in the same copy on CUDA."""
        table = np.zeros((self.world, WORDS), np.float32)
        if words is not None:
            table[self.rank] = words
        if self.staging is None:  # the CPU: tensors share the arrays' memory
            leaves = [torch.from_numpy(e).requires_grad_(grad) for e in (embeddings.pooled, *embeddings.sequences)]
            self._words = torch.from_numpy(table.ravel())
            return (
                torch.from_numpy(np.array(dense, dtype=np.float32)),
                torch.from_numpy(np.array(labels, dtype=np.float32)),
                leaves,
                _per_slot(leaves, embeddings.widths),
            )
        parts = (embeddings.pooled, *embeddings.sequences)
        flat = self.staging.pack([dense, labels, *parts, table]).to(self.device, non_blocking=True)
        head, tail = dense.size + labels.size, flat.numel() - table.size
        leaf = flat[head:tail].detach().requires_grad_(grad)
        self._words = flat[tail:]
        embs = _per_slot(_parts(leaf, embeddings), embeddings.widths)
        return flat[: dense.size].view(dense.shape), flat[dense.size : head].view(labels.shape), [leaf], embs

    def _forward(self, model: torch.nn.Module, dense: torch.Tensor, embs: list[torch.Tensor]) -> torch.Tensor:
        """The model's outputs, fp32, in the objective's shape: (B,), or (B, T) for several tasks."""
        return self.objective.outputs(logits(model, dense, embs, self.bf16))

    def _to_host(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The tensors on the host: from CUDA one non-blocking copy each into pinned memory (from
        torch's caching host allocator, so no allocation per step), then one wait for them all."""
        if self.device.type != "cuda":
            return tensors
        host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True) for t in tensors]
        torch.cuda.current_stream(self.device).synchronize()
        return host

    def dense_state(self) -> bytes:
        """The model and optimizer state as `torch.save` bytes of plain state_dicts (loadable
        with weights_only=True): a copy, so training may go on while it is written."""
        state = {
            "model": {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()},
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
        }
        buffer = io.BytesIO()
        torch.save(state, buffer)
        return buffer.getvalue()

    def finish(self, timeout: timedelta = FINISH_TIMEOUT) -> None:
        """End the job's process group: a barrier first, so that no rank tears down while a peer is
        still in the last collective (gloo aborted such a rank: "terminate called without an active
        exception", 3 runs in 40). A monitored barrier: a dead peer fails it within `timeout`, naming
        the rank, instead of leaving the others in the collective's 10-minute timeout."""
        dist.monitored_barrier(group=self.control_group, timeout=timeout)
        dist.destroy_process_group()

    def dense_weights(self) -> bytes:
        """The model's weights alone as `torch.save` bytes of its state_dict (a model version's
        `dense.pt`: serving needs no optimizer state)."""
        buffer = io.BytesIO()
        torch.save({"model": {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}}, buffer)
        return buffer.getvalue()

    def load_dense(self, data: bytes) -> None:
        state = torch.load(io.BytesIO(data), map_location=self.device, weights_only=True)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
