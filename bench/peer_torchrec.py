"""The job bench/peer.py measures the stack against, trained with TorchRec on CPU.

Runs in the peer environment (`make peer`: .cache/peer-venv, bench/peer-requirements.txt), not in
the project's: it imports torch, torchrec and fbgemm-gpu-cpu and never trillium, and reads the
Criteo-format TSV files `trillium datagen` wrote (label, I1..I13, C1..C26, tab-separated).

The model is the stack's default one, `trillium.models.DNN`, rebuilt layer for layer: the 13
dense columns (log1p, missing = 0) and the 26 pooled embeddings (an `EmbeddingBagCollection` of
one table per slot) each projected and normalized, then the ReLU MLP; BCE on the logit. The
tables are sharded by torchrec's `DistributedModelParallel` on a one-process gloo group, each
on the compute kernel `EmbeddingComputeKernel.FUSED` (a planner constraint): fbgemm's Adagrad
(`acc += g*g; w -= lr * g / (sqrt(acc) + eps)`, the stack's `adagrad`) runs inside the backward
pass. A hand-made run found the CPU planner choosing the DENSE kernel, whose tables stayed at
their initial values; the run stops if the plan holds another kernel or if no table value changed
in training. The dense network: SGD. One epoch in file order, then the test split's AUC.

Each distinct ID of a slot (in the train and test files together) has a row of its own, as in the
stack's tables, which hold a row for every ID they see: no hashing into fewer rows. Rows start
uniform in [init_low, init_high], as the stack's do.

Three phases, each with its wall time and its process CPU time (`resource.getrusage`, every
thread): `read` (parse both files, index the IDs, build every batch's `KeyedJaggedTensor`, as a
TorchRec data loader hands them to the model), `train` and `evaluate`. `cpu_us_per_sample` is
each over the samples trained; `total` is the three together, the work the stack's processes
do between a job's submission and its end. samples/s is the training phase's.

    .cache/peer-venv/bin/python bench/peer_torchrec.py --train train.tsv --test test.tsv --threads 1
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torchrec
from torch import nn
from torchmetrics.functional.classification import binary_auroc
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints
from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation
from torchrec.distributed.planner.types import KernelConfig, TopologyFactory, TrainerConfig
from torchrec.distributed.types import ShardingType
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

NUM_DENSE, NUM_SLOTS = 13, 26
FIELDS = 1 + NUM_DENSE + NUM_SLOTS  # a row's cells: its tabs and its newline
KEYS = [f"c{i}" for i in range(1, NUM_SLOTS + 1)]


class Rows:
    """A TSV file's rows, parsed with numpy (no per-row Python): each cell is read through a window
    of the file's bytes at its start, so a column is one gather of fixed-width rows."""

    labels: np.ndarray  # float32[n]
    dense: np.ndarray  # float32[n, 13]: log1p(count), missing = 0
    ids: np.ndarray  # int64[n, 26]: the cell's 32-bit hex value, -1 where missing

    def __init__(self, path: Path) -> None:
        buf = np.fromfile(path, np.uint8)
        ends = np.flatnonzero((buf == 9) | (buf == 10))  # every cell ends at a tab or a newline
        if len(ends) % FIELDS:
            raise ValueError(f"{path}: {len(ends)} cells, not a multiple of {FIELDS}")
        ends = ends.reshape(-1, FIELDS)
        if not (buf[ends[:, -1]] == 10).all():
            raise ValueError(f"{path}: a row without {FIELDS} cells")
        starts = np.empty_like(ends)
        starts[:, 0] = np.concatenate([[0], ends[:-1, -1] + 1])
        starts[:, 1:] = ends[:, :-1] + 1
        width = ends - starts
        self.labels = (buf[starts[:, 0]] - ord("0")).astype(np.float32)

        cols = slice(1, 1 + NUM_DENSE)  # non-negative decimal counts, or empty
        most = int(width[:, cols].max(initial=1))
        digits = _windows(buf, starts[:, cols], most)  # [n, 13, most]
        counts = np.zeros(digits.shape[:2], np.int64)
        for k in range(most):
            counts = np.where(k < width[:, cols], counts * 10 + digits[..., k] - ord("0"), counts)
        self.dense = np.log1p(counts.astype(np.float64)).astype(np.float32)

        cats = slice(1 + NUM_DENSE, FIELDS)  # 8 hex digits, or empty
        if not np.isin(width[:, cats], (0, 8)).all():
            raise ValueError(f"{path}: a categorical cell that is not 8 hex digits")
        nibbles = _HEX[_windows(buf, starts[:, cats], 8)]  # [n, 26, 8]
        octets = (nibbles[..., 0::2] << 4) | nibbles[..., 1::2]
        ids = np.ascontiguousarray(octets).view(">u4")[..., 0].astype(np.int64)
        ids[width[:, cats] == 0] = -1
        self.ids = ids


_HEX = np.zeros(256, np.uint8)
_HEX[np.frombuffer(b"0123456789", np.uint8)] = np.arange(10)
_HEX[np.frombuffer(b"abcdef", np.uint8)] = np.arange(10, 16)
_HEX[np.frombuffer(b"ABCDEF", np.uint8)] = np.arange(10, 16)


def _windows(buf: np.ndarray, starts: np.ndarray, width: int) -> np.ndarray:
    """uint8[*starts.shape, width]: the `width` bytes from each start (zeros past the end)."""
    padded = np.concatenate([buf, np.zeros(width, np.uint8)])
    view = np.lib.stride_tricks.sliding_window_view(padded, width)  # [len(buf) + 1, width], no copy
    return view[starts]


def index_ids(train: Rows, test: Rows) -> list[int]:
    """Replace each slot's IDs in both splits by a row number, 0..distinct - 1; returns the rows per
    slot (each table's num_embeddings)."""
    sizes = []
    n = len(train.ids)
    for j in range(NUM_SLOTS):
        both = np.concatenate([train.ids[:, j], test.ids[:, j]])
        present = both >= 0
        distinct, rows = np.unique(both[present], return_inverse=True)
        both[present] = rows
        train.ids[:, j], test.ids[:, j] = both[:n], both[n:]
        sizes.append(max(len(distinct), 1))
    return sizes


def batches(rows: Rows, size: int) -> list[tuple[torch.Tensor, KeyedJaggedTensor, torch.Tensor]]:
    """(dense [B, 13], the IDs as a KeyedJaggedTensor of 26 keys, labels [B]) per batch: values
    key-major, a length of 1 or 0 (missing) per key and sample."""
    out = []
    ids = torch.from_numpy(rows.ids)
    dense, labels = torch.from_numpy(rows.dense), torch.from_numpy(rows.labels)
    for start in range(0, len(ids), size):
        by_key = ids[start : start + size].t()  # [26, B]
        present = by_key >= 0
        kjt = KeyedJaggedTensor(keys=KEYS, values=by_key[present], lengths=present.reshape(-1).to(torch.int32))
        out.append((dense[start : start + size], kjt, labels[start : start + size]))
    return out


class DNN(nn.Module):
    """`trillium.models.DNN` over an `EmbeddingBagCollection`: the same layers and widths."""

    def __init__(
        self, ebc: torchrec.EmbeddingBagCollection, hidden: list[int], dense_proj: int = 16, sparse_proj: int = 128
    ):
        super().__init__()
        self.ebc = ebc
        dims = sum(t.embedding_dim for t in ebc.embedding_bag_configs())
        self.dense_proj = nn.Sequential(nn.Linear(NUM_DENSE, dense_proj), nn.LayerNorm(dense_proj))
        self.sparse_proj = nn.Sequential(nn.Linear(dims, sparse_proj), nn.LayerNorm(sparse_proj))
        layers: list[nn.Module] = []
        width = dense_proj + sparse_proj
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        self.mlp = nn.Sequential(*layers, nn.Linear(width, 1))

    def forward(self, dense: torch.Tensor, ids: KeyedJaggedTensor) -> torch.Tensor:
        pooled = self.ebc(ids).values()  # [B, 26 * dim], the keys in KEYS' order
        return self.mlp(torch.cat([self.dense_proj(dense), self.sparse_proj(pooled)], dim=1)).squeeze(-1)


def build(args: argparse.Namespace, sizes: list[int]) -> tuple[nn.Module, torch.optim.Optimizer, dict[str, Any]]:
    """The model sharded by DMP on this one-process group, every table on the FUSED kernel."""
    tables = [
        torchrec.EmbeddingBagConfig(
            name=f"t_{key}",
            embedding_dim=args.dim,
            num_embeddings=size,
            feature_names=[key],
            pooling=torchrec.PoolingType.SUM,
            weight_init_min=args.init_low,
            weight_init_max=args.init_high,
        )
        for key, size in zip(KEYS, sizes, strict=True)
    ]
    ebc = torchrec.EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    apply_optimizer_in_backward(torch.optim.Adagrad, ebc.parameters(), {"lr": args.lr, "eps": args.eps})
    model = DNN(ebc, args.hidden)
    constraints = {
        t.name: ParameterConstraints(
            sharding_types=[ShardingType.TABLE_WISE.value], compute_kernels=[EmbeddingComputeKernel.FUSED.value]
        )
        for t in tables
    }
    sharders = [EmbeddingBagCollectionSharder()]
    topology = TopologyFactory.create_topology(
        trainer_config=TrainerConfig(world_size=1, local_world_size=1), kernel_config=KernelConfig(compute_device="cpu")
    )
    planner = EmbeddingShardingPlanner(
        topology=topology,
        batch_size=args.batch,
        constraints=constraints,
        storage_reservation=FixedPercentageStorageReservation(0.15),
    )
    plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)
    dmp = DistributedModelParallel(module=model, device=torch.device("cpu"), plan=plan, sharders=sharders)
    kernels = sorted({p.compute_kernel for m in plan.plan.values() for p in m.values()})  # type: ignore[attr-defined]
    if kernels != [EmbeddingComputeKernel.FUSED.value]:
        raise RuntimeError(f"the planner chose {kernels}, not the fused kernel")
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())), lambda ps: torch.optim.SGD(ps, lr=args.dense_lr)
    )
    return dmp, dense, {"compute_kernels": kernels}


def table_weights(model: nn.Module) -> torch.Tensor:
    """The first table's rows, read through the sharded module's state dict."""
    for name, value in model.state_dict().items():
        if "embedding_bags" in name and name.endswith("weight"):
            local = value.local_shards()[0].tensor if hasattr(value, "local_shards") else value
            return local.detach().clone()
    raise RuntimeError("no embedding table in the model's state dict")


class Phase:
    """Wall and process CPU seconds (every thread's, user + system) of a `with` block."""

    def __enter__(self) -> Phase:
        self._wall, self._cpu = time.perf_counter(), _cpu()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall, self.cpu = time.perf_counter() - self._wall, _cpu() - self._cpu


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train", type=Path, required=True, help="Criteo-format TSV to train on")
    parser.add_argument("--test", type=Path, required=True, help="Criteo-format TSV to evaluate on (AUC)")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--batch", type=int, default=512, help="samples a step")
    parser.add_argument("--eval-batch", type=int, default=4096, help="samples a forward pass in evaluation")
    parser.add_argument("--dim", type=int, default=16, help="each table's embedding dim")
    parser.add_argument("--hidden", type=lambda s: [int(x) for x in s.split(",")], default=[128, 64], help="MLP")
    parser.add_argument("--lr", type=float, default=0.05, help="the tables' Adagrad learning rate")
    parser.add_argument("--eps", type=float, default=1e-8, help="the tables' Adagrad eps")
    parser.add_argument("--dense-lr", type=float, default=0.1, help="the dense network's SGD learning rate")
    parser.add_argument("--init-low", type=float, default=-0.01, help="rows start uniform in [low, high]")
    parser.add_argument("--init-high", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0, help="torch.manual_seed")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    # One process, one rank: gloo over an in-memory store, no port.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with Phase() as read:
            train_rows, test_rows = Rows(args.train), Rows(args.test)
            sizes = index_ids(train_rows, test_rows)
            train_batches = batches(train_rows, args.batch)
            test_batches = batches(test_rows, args.eval_batch)
        model, dense_opt, plan = build(args, sizes)
        before = table_weights(model)
        loss_fn = nn.BCEWithLogitsLoss()
        model.train()
        with Phase() as train:
            for dense, ids, labels in train_batches:
                dense_opt.zero_grad()
                loss = loss_fn(model(dense, ids), labels)
                loss.backward()  # the tables' fused Adagrad runs in here
                dense_opt.step()
        moved = float((table_weights(model) - before).abs().max())
        model.eval()
        with Phase() as evaluate, torch.no_grad():
            scores = torch.cat([torch.sigmoid(model(dense, ids)) for dense, ids, _ in test_batches])
            truth = torch.from_numpy(test_rows.labels)
            auc = float(binary_auroc(scores, truth.int()))
            logloss = float(nn.functional.binary_cross_entropy(scores.clamp(1e-7, 1 - 1e-7), truth))
    finally:
        dist.destroy_process_group()
    if moved == 0.0:
        raise RuntimeError("the embedding tables did not change in training")
    samples = len(train_rows.labels)
    phases = {"read": read, "train": train, "evaluate": evaluate}
    cpu_us = {k: round(p.cpu / samples * 1e6, 1) for k, p in phases.items()}
    result = {
        "versions": {
            "torch": torch.__version__,
            "torchrec": version("torchrec"),
            "fbgemm_gpu_cpu": version("fbgemm-gpu-cpu"),
        },
        "threads": args.threads,
        **plan,
        "train_rows": samples,
        "test_rows": len(test_rows.labels),
        "table_rows": sum(sizes),
        "steps": len(train_batches),
        "auc": auc,
        "logloss": logloss,
        "samples_per_sec": round(samples / train.wall, 1),
        "seconds": {k: round(p.wall, 3) for k, p in phases.items()},
        "cpu_seconds": {k: round(p.cpu, 3) for k, p in phases.items()},
        "cpu_us_per_sample": {**cpu_us, "total": round(sum(p.cpu for p in phases.values()) / samples * 1e6, 1)},
        "largest_change_of_a_table_value": moved,
    }
    json.dump(result, sys.stdout)
    print()


if __name__ == "__main__":
    main()
