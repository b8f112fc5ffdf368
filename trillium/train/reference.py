"""Single-process PyTorch trainers of a job: the golden reference and the benchmark baseline.

`train_reference` is the correctness oracle the distributed system is compared against. It sees
the same batches in the same order (`BatchBuilder`), builds the same dense model
(`build_model`), starts every embedding row from exactly the value the native store gives that ID
(it asks an `EmbeddingStore` configured like the job's tables), and applies the embedding
optimizers with the native store's documented math in float32 numpy, gradients of an ID repeated
within a batch summed first; its evaluation reads an ID no training step looked up as zeros, as
the PS's read-only evaluation does. It is the distributed job with one NN rank and synchronous
embedding updates (staleness 0). Kept deliberately plain.

`train_baseline` is "the single-process PyTorch baseline" of the benchmarks: one
`nn.EmbeddingBag`-style sparse parameter per table over IDs remapped to dense indices, trained
with torch's own sparse optimizers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn import functional as F

import trillium_native
from trillium.data.features import BatchBuilder
from trillium.job import (
    AdagradConfig,
    AdamConfig,
    FeatureSlot,
    FtrlConfig,
    JobConfig,
    SgdConfig,
    TableConfig,
)
from trillium.metrics import task_metrics
from trillium.models import Objective, build_dense_optimizer, build_model
from trillium.wire.batch import Batch

__all__ = ["TrainResult", "train_baseline", "train_reference"]


@dataclass(frozen=True)
class TrainResult:
    losses: list[float]  # training loss of every step, in order
    test_auc: float | None  # None when the job has no test split
    test_logloss: float | None
    test_gauc: float | None  # None without evaluation.group_by or a test split
    examples: int  # training examples processed
    seconds: float  # wall time of the training steps (not of reading the data)
    test_tasks: dict[str, dict[str, float | int]] | None = None  # every task's test metrics, by name
    task_losses: list[list[float]] | None = None  # a multi-task job's: per step, each task's mean loss


def _table_vocab(job: JobConfig, builder: BatchBuilder) -> dict[str, np.ndarray]:
    """Every ID a table will see (train and test), sorted: row `i` of a table is its `i`-th."""
    splits = [builder.split("train")] + ([builder.split("test")] if builder.has_test else [])
    vocab = {}
    for name in job.tables:
        ids = [split.slot_values[k] for split in splits for k, slot in enumerate(job.slots) if slot.table == name]
        vocab[name] = np.unique(np.concatenate(ids))
    return vocab


def _slot_rows(batch: Batch, slot: str, vocab: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For one slot of a batch: each ID's table row, its sample, and its position in the sample."""
    values, lengths = batch.ids.slot(slot)
    sample = np.repeat(np.arange(len(lengths)), lengths)
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.searchsorted(vocab, values), sample, np.arange(len(values)) - starts


def _pool(
    rows: Tensor,
    sample: np.ndarray,
    position: np.ndarray,
    lengths: np.ndarray,
    slot: FeatureSlot,
) -> Tensor:
    """Per-ID embedding rows -> the slot's model input: (B, dim) pooled or (B, max_len, dim)."""
    batch_size, dim = len(lengths), rows.shape[1]
    if slot.pooling == "none":
        assert slot.max_len is not None
        flat = torch.from_numpy(sample * slot.max_len + position)
        padded = rows.new_zeros(batch_size * slot.max_len, dim).index_add(0, flat, rows)
        return padded.view(batch_size, slot.max_len, dim)
    pooled = rows.new_zeros(batch_size, dim).index_add(0, torch.from_numpy(sample), rows)
    if slot.pooling == "mean":
        pooled = pooled / torch.from_numpy(np.maximum(lengths, 1).astype(np.float32))[:, None]
    return pooled


class _Table:
    """A table as the native store keeps it: float32 math, weights stored in the table's dtype."""

    def __init__(
        self,
        name: str,
        config: TableConfig,
        vocab: np.ndarray,
        store: trillium_native.EmbeddingStore,
    ) -> None:
        self.name, self.config, self.vocab, self.store = name, config, vocab, store
        n, dim = len(vocab), config.dim
        self.weight = np.zeros((n, dim), np.float32)
        self.known = np.zeros(n, bool)
        opt = config.optimizer
        acc0 = np.float32(getattr(opt, "initial_accumulator", 0.0))
        if opt.name == "adagrad":
            self.acc = np.full((n, dim), acc0, np.float32)
        elif opt.name == "rowwise_adagrad":
            self.acc = np.full(n, acc0, np.float32)
        elif opt.name == "adam":
            self.m = np.zeros((n, dim), np.float32)
            self.v = np.zeros((n, dim), np.float32)
            self.steps = np.zeros(n, np.int64)
        elif opt.name == "ftrl":
            self.z = np.zeros((n, dim), np.float32)
            self.n = np.full((n, dim), acc0, np.float32)

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """Row indices of `ids` (unique), creating the rows of IDs seen for the first time."""
        idx = np.searchsorted(self.vocab, ids)
        new = idx[~self.known[idx]]
        if len(new):
            self.weight[new] = self.store.lookup(self.name, self.vocab[new])
            self.known[new] = True
            opt = self.config.optimizer
            if isinstance(opt, FtrlConfig):  # start z where the FTRL weight is the initial weight
                w, n = self.weight[new], self.n[new]
                d = (np.float32(opt.beta) + np.sqrt(n)) / np.float32(opt.alpha) + np.float32(opt.l2)
                self.z[new] = np.where(w == 0, 0, -(w * d + np.sign(w) * np.float32(opt.l1)))
        return idx

    def apply(self, idx: np.ndarray, grad: np.ndarray) -> None:
        """One optimizer step on rows `idx` (unique) with their summed gradients."""
        opt, f32 = self.config.optimizer, np.float32
        w = self.weight[idx]
        if isinstance(opt, FtrlConfig):
            n_old = self.n[idx]
            n_new = n_old + grad * grad
            sigma = (np.sqrt(n_new) - np.sqrt(n_old)) * (f32(1) / f32(opt.alpha))
            z = self.z[idx] + grad - sigma * w
            self.z[idx], self.n[idx] = z, n_new
            denom = (f32(opt.beta) + np.sqrt(n_new)) / f32(opt.alpha) + f32(opt.l2)
            w = np.where(np.abs(z) <= f32(opt.l1), f32(0), -(z - np.sign(z) * f32(opt.l1)) / denom)
        else:
            lr = f32(opt.lr)
            g = grad + f32(opt.weight_decay) * w
            if isinstance(opt, SgdConfig):
                w = w - lr * g
            elif isinstance(opt, AdagradConfig) and opt.name == "adagrad":
                acc = self.acc[idx] + g * g
                self.acc[idx] = acc
                w = w - lr * g / (np.sqrt(acc) + f32(opt.eps))
            elif isinstance(opt, AdagradConfig):  # rowwise: one accumulator per row, of mean(g^2)
                acc = self.acc[idx] + (g * g).sum(axis=1) / f32(w.shape[1])
                self.acc[idx] = acc
                w = w - (lr / (np.sqrt(acc) + f32(opt.eps)))[:, None] * g
            else:
                assert isinstance(opt, AdamConfig)
                steps = self.steps[idx] + 1
                self.steps[idx] = steps
                # Per-row step count: a row's bias correction counts only its own updates.
                bc1 = (1.0 - opt.beta1**steps).astype(f32)[:, None]
                bc2 = (1.0 - opt.beta2**steps).astype(f32)[:, None]
                b1, b2 = f32(opt.beta1), f32(opt.beta2)
                m = b1 * self.m[idx] + (f32(1) - b1) * g
                v = b2 * self.v[idx] + (f32(1) - b2) * g * g
                self.m[idx], self.v[idx] = m, v
                w = w - lr * ((m / bc1) / (np.sqrt(v / bc2) + f32(opt.eps)))
        if self.config.weight_bound is not None:
            bound = f32(self.config.weight_bound)
            w = np.clip(w, -bound, bound)
        self.weight[idx] = _round_to_dtype(w.astype(f32), self.config.dtype)


def _round_to_dtype(w: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "fp16":
        return w.astype(np.float16).astype(np.float32)
    if dtype == "bf16":
        return torch.from_numpy(w).to(torch.bfloat16).float().numpy()
    return w


class _Embeddings(Protocol):
    """How a trainer turns a batch's IDs into model inputs and learns from their gradients."""

    def __call__(self, batch: Batch, training: bool = True) -> list[Tensor]:
        """The batch's model inputs; evaluating (`training` False), an ID never trained reads as
        zeros where the trainer models the PS (which evaluates read-only)."""
        ...

    def step(self) -> None:
        """Apply the gradients of the last batch embedded (called after `backward`)."""


def _fit(job: JobConfig, builder: BatchBuilder, model: nn.Module, embeddings: _Embeddings) -> TrainResult:
    """The training loop both trainers share; then the test-set evaluation."""
    optimizer = build_dense_optimizer(job.training.dense_optimizer, model.parameters())
    objective = Objective.of(job)
    model.train()
    losses, examples, start = [], 0, time.perf_counter()
    task_losses: list[list[float]] = []
    for epoch in range(job.training.epochs):
        for batch in builder.batches("train", epoch):
            out = objective.outputs(model(torch.from_numpy(batch.dense), embeddings(batch)))
            labels = torch.from_numpy(batch.labels)
            loss = objective.loss_mean(out, labels)
            if objective.multitask:
                sums = objective.loss_sums(out.detach(), labels).tolist()
                task_losses.append([x / batch.batch_size for x in sums])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            embeddings.step()
            losses.append(loss.item())
            examples += batch.batch_size
    seconds = time.perf_counter() - start
    if not builder.has_test:
        return TrainResult(losses, None, None, None, examples, seconds, None, task_losses)
    model.eval()
    group_by = job.evaluation.group_by
    labels, scores, groups = [], [], []
    with torch.no_grad():
        for batch in builder.batches("test"):
            out = objective.outputs(model(torch.from_numpy(batch.dense), embeddings(batch, training=False)))
            scores.append(objective.scores(out).numpy())
            labels.append(batch.labels)
            if group_by is not None:
                groups.append(batch.ids.first(group_by))
    model.train()
    y, p = np.concatenate(labels), np.concatenate(scores)
    shape = (len(y), -1)  # a one-label job's (N,) as one task's column
    first = np.concatenate([g for g, _ in groups]) if groups else None
    has = np.concatenate([h for _, h in groups]) if groups else None
    kinds = [t.kind for t in objective.tasks]
    per_task = task_metrics(kinds, y.reshape(shape), p.reshape(shape), first, has)
    tasks = dict(zip(objective.names, per_task, strict=True))
    head = per_task[0]
    return TrainResult(
        losses, head.get("auc"), head.get("logloss"), head.get("gauc"), examples, seconds, tasks, task_losses
    )


class _ReferenceEmbeddings:
    def __init__(self, job: JobConfig, tables: dict[str, _Table]) -> None:
        self.job, self.tables = job, tables
        self.leaves: dict[str, tuple[np.ndarray, Tensor]] = {}

    def __call__(self, batch: Batch, training: bool = True) -> list[Tensor]:
        # Per table, the rows of the batch's unique IDs as one leaf tensor: autograd then sums
        # the gradients of an ID used several times into its row of `leaf.grad`.
        self.leaves = {}
        for name, table in self.tables.items():
            ids = np.unique(np.concatenate([batch.ids.slot(s.name)[0] for s in self.job.slots if s.table == name]))
            if training:
                idx = table.rows(ids)
                weight = table.weight[idx]
            else:  # read-only, as the PS evaluates: no row created, one never trained is zeros
                idx = np.searchsorted(table.vocab, ids)
                weight = np.where(table.known[idx][:, None], table.weight[idx], np.float32(0))
            self.leaves[name] = (idx, torch.from_numpy(weight).requires_grad_(training))
        inputs = []
        for slot in self.job.slots:
            idx, leaf = self.leaves[slot.table]
            rows, sample, position = _slot_rows(batch, slot.name, self.tables[slot.table].vocab)
            per_id = leaf[np.searchsorted(idx, rows)]  # idx is sorted, like the vocabulary
            inputs.append(_pool(per_id, sample, position, batch.ids.slot(slot.name)[1], slot))
        return inputs

    def step(self) -> None:
        for name, (idx, leaf) in self.leaves.items():
            if leaf.grad is not None:
                self.tables[name].apply(idx, leaf.grad.numpy())


def train_reference(job: JobConfig, *, builder: BatchBuilder | None = None) -> TrainResult:
    """Train `job` in this process, as described in the module docstring."""
    for name, config in job.tables.items():
        if config.admission.policy != "off":
            raise ValueError(f"reference: table {name!r}: admission is not modelled, set it off")
    builder = builder or BatchBuilder(job)
    vocab = _table_vocab(job, builder)
    store = trillium_native.EmbeddingStore()
    for name, config in job.tables.items():
        store.create_table(name, **config.store_kwargs(job.training.seed))
    tables = {name: _Table(name, job.tables[name], vocab[name], store) for name in job.tables}
    return _fit(job, builder, build_model(job), _ReferenceEmbeddings(job, tables))


class _BaselineEmbeddings:
    def __init__(self, job: JobConfig, vocab: dict[str, np.ndarray]) -> None:
        self.job, self.vocab = job, vocab
        self.weights: dict[str, nn.Parameter] = {}
        self.optimizers: list[torch.optim.Optimizer] = []
        for name, config in job.tables.items():
            # One extra zero row: the padding index of sequence slots.
            weight = torch.zeros(len(vocab[name]) + 1, config.dim)
            if config.initializer == "uniform":
                nn.init.uniform_(weight[:-1], config.init_low, config.init_high)
            else:
                nn.init.normal_(weight[:-1], config.init_mean, config.init_std)
            self.weights[name] = param = nn.Parameter(weight)
            opt = config.optimizer
            if getattr(opt, "weight_decay", 0.0):
                raise ValueError(f"baseline: table {name!r}: weight_decay needs dense gradients")
            if isinstance(opt, SgdConfig):
                self.optimizers.append(torch.optim.SGD([param], lr=opt.lr))
            elif isinstance(opt, AdagradConfig) and opt.name == "adagrad":
                self.optimizers.append(
                    torch.optim.Adagrad(
                        [param],
                        lr=opt.lr,
                        eps=opt.eps,
                        initial_accumulator_value=opt.initial_accumulator,
                    )
                )
            elif isinstance(opt, AdamConfig):
                betas = (opt.beta1, opt.beta2)
                self.optimizers.append(torch.optim.SparseAdam([param], lr=opt.lr, betas=betas, eps=opt.eps))
            else:
                raise ValueError(f"baseline: table {name!r}: torch has no sparse {opt.name!r}")

    def __call__(self, batch: Batch, training: bool = True) -> list[Tensor]:
        # torch's tables hold a row for every ID from the start: evaluating reads it as trained.
        out = []
        for slot in self.job.slots:
            weight, pad = self.weights[slot.table], len(self.vocab[slot.table])
            rows, sample, position = _slot_rows(batch, slot.name, self.vocab[slot.table])
            lengths = batch.ids.slot(slot.name)[1]
            if slot.pooling == "none":
                assert slot.max_len is not None
                padded = np.full((len(lengths), slot.max_len), pad, np.int64)
                padded[sample, position] = rows
                ids = torch.from_numpy(padded)
                out.append(F.embedding(ids, weight, padding_idx=pad, sparse=True))
            else:
                ids = torch.from_numpy(rows)
                offsets = torch.from_numpy(np.cumsum(lengths) - lengths)
                out.append(F.embedding_bag(ids, weight, offsets, mode=slot.pooling, sparse=True))
        return out

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()
            optimizer.zero_grad()


def train_baseline(job: JobConfig, *, builder: BatchBuilder | None = None) -> TrainResult:
    """Train `job` the plain PyTorch way: sparse-gradient embedding parameters (fp32, initialised
    by torch from the tables' initializer settings) and torch's sparse optimizers (`sgd`,
    `adagrad`, `adam` as SparseAdam). PS-only table settings (dtype, weight_bound, admission,
    capacity, ttl) do not apply."""
    builder = builder or BatchBuilder(job)
    vocab = _table_vocab(job, builder)
    model = build_model(job)
    # Explicitly skip torch's (costly, opt-in) sparse invariant checks, which it warns about.
    with torch.sparse.check_sparse_tensor_invariants(enable=False):
        return _fit(job, builder, model, _BaselineEmbeddings(job, vocab))
