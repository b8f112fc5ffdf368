"""Micro-benchmark of one NN rank's step: the project's `Trainer.step`
(services/nn_worker/step.py) against a plain torch loop of the same model doing the same work,
on the same pre-made batches in one process.

The model is trillium.models:DNN at Criteo-like shapes (13 dense columns, 26 slots of dim 16,
hidden [512, 256]) with SGD (lr 0.1, as in bench/e2e.py's job). A step of either loop takes
numpy arrays (dense, labels, the 26 looked-up embeddings, side by side in one block as the wire
carries them) and gives back numpy arrays (the embeddings' gradients, the probabilities) and the
loss sum as a float: what an NN rank exchanges with the rest of the stack. The plain loop takes
the slots one by one (column views of the block) and gives their gradients one by one; the
Trainer gives them joined in one block, as the wire takes them. The plain loop does it the obvious way
(`torch.from_numpy(x).to(device)`, `.cpu().numpy()`, `.item()`) with no DDP, staging or
warm-up; the Trainer runs under DDP in a 1-rank gloo group (a file:// store in a temporary
directory), so it runs anywhere, and is warmed up as the NN worker warms it on CUDA.

Both start from the same weights and see the same batches in the same order, so their losses
agree to rounding (`max_loss_difference`: the Trainer back-propagates the loss sum and divides the
all-reduced gradients by the step's sample count, the plain loop back-propagates the mean loss;
at a power-of-two batch the two are the same bits). After two untimed steps each, they are timed
alternately, `--rounds` rounds of `--steps` steps (wall clock: on a GPU that is what
counts), and each one's best round is taken: the development machine is shared.
`vs_plain_loop` is the Trainer's steps/s over the plain loop's (issue 11: >= 0.8 at batch 8192
on a GPU).

    python bench/nn_step.py                        # a short summary
    python bench/nn_step.py --json --batch 8192 --device cuda --precision bf16
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from trillium.models import DNN
from trillium.services.nn_worker.embeddings import SlotEmbeddings
from trillium.services.nn_worker.step import Trainer
from trillium.wire.batch import Batch, KeyedIds

NUM_DENSE, SLOTS, DIM, HIDDEN, LR = 13, 26, 16, (512, 256), 0.1

# (batch, embeddings) -> (loss sum, the embeddings' gradients, probabilities), all on the host
Step = Callable[[Batch, SlotEmbeddings], tuple[float, Any, np.ndarray]]


def make_batches(count: int, size: int) -> list[tuple[Batch, SlotEmbeddings]]:
    rng = np.random.default_rng(0)
    ids = KeyedIds.from_slots(
        {f"c{i}": (np.arange(size, dtype=np.uint64), np.ones(size, np.int32)) for i in range(SLOTS)}
    )
    return [
        (
            Batch(
                batch_id=i,
                epoch=0,
                rank=0,
                ids=ids,
                dense=rng.normal(size=(size, NUM_DENSE)).astype(np.float32),
                labels=(rng.random(size) < 0.25).astype(np.float32),
            ),
            SlotEmbeddings.of([rng.normal(scale=0.01, size=(size, DIM)).astype(np.float32) for _ in range(SLOTS)]),
        )
        for i in range(count)
    ]


def new_model(device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    return DNN(NUM_DENSE, [DIM] * SLOTS, hidden=HIDDEN).to(device)


def plain_loop(device: torch.device, bf16: bool) -> Step:
    model = new_model(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)

    def step(batch: Batch, embeddings: SlotEmbeddings) -> tuple[float, list[np.ndarray], np.ndarray]:
        dense = torch.from_numpy(batch.dense).to(device)
        labels = torch.from_numpy(batch.labels).to(device)
        embs = [torch.from_numpy(e).to(device).requires_grad_() for e in embeddings.slots()]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            logits = model(dense, embs)
        loss_sum = F.binary_cross_entropy_with_logits(logits.float(), labels, reduction="sum")
        optimizer.zero_grad(set_to_none=True)
        (loss_sum * (1 / batch.batch_size)).backward()
        optimizer.step()
        grads = [e.grad.cpu().numpy() for e in embs]
        return loss_sum.item(), grads, torch.sigmoid(logits.detach().float()).cpu().numpy()

    return step


def trainer_loop(device: torch.device, precision: str, batch: int) -> Step:
    ddp = DistributedDataParallel(new_model(device), device_ids=[device.index] if device.type == "cuda" else None)
    trainer = Trainer(
        ThreadPoolExecutor(1), ddp, torch.optim.SGD(ddp.parameters(), lr=LR), device, 1, 0, None, precision
    )
    if device.type == "cuda":
        trainer.warm_up(batch, NUM_DENSE, [(DIM,)] * SLOTS)

    def step(b: Batch, embeddings: SlotEmbeddings) -> tuple[float, SlotEmbeddings, np.ndarray]:
        result = trainer.step(b, embeddings)
        return result.loss_sum, result.grads, result.probs

    return step


def run(args: argparse.Namespace, store: Path) -> dict[str, Any]:
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", device.index or 0)
        torch.cuda.set_device(device)
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        batches = make_batches(args.batches, args.batch)
        loops = {
            "trainer": trainer_loop(device, args.precision, args.batch),
            "plain": plain_loop(device, args.precision == "bf16"),
        }
        losses: dict[str, list[float]] = {name: [] for name in loops}
        best = {name: float("inf") for name in loops}
        for name, step in loops.items():  # untimed: allocators, lazy initialization
            losses[name] += [step(*batches[i % len(batches)])[0] for i in range(2)]
        for _ in range(args.rounds):
            for name, step in loops.items():
                start = time.perf_counter()
                for _ in range(args.steps):
                    losses[name].append(step(*batches[len(losses[name]) % len(batches)])[0])
                best[name] = min(best[name], time.perf_counter() - start)
    finally:
        dist.destroy_process_group()
    rates = {name: args.steps / seconds for name, seconds in best.items()}
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "threads": args.threads,
        "batch": args.batch,
        "precision": args.precision,
        "steps": args.steps,
        "rounds": args.rounds,
        "trainer_steps_per_s": rates["trainer"],
        "plain_steps_per_s": rates["plain"],
        "trainer_samples_per_s": rates["trainer"] * args.batch,
        "vs_plain_loop": rates["trainer"] / rates["plain"],
        "max_loss_difference": float(np.max(np.abs(np.subtract(losses["trainer"], losses["plain"])))),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print only the JSON result on stdout")
    parser.add_argument("--batch", type=int, default=8192, help="samples per step")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument(
        "--steps", type=int, default=None, help="timed steps per round [default: 100 on CUDA, 5 on CPU]"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", type=int, default=4, help="distinct pre-made batches, cycled")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (an NN rank's default)")
    args = parser.parse_args()
    if args.steps is None:
        args.steps = 100 if args.device.startswith("cuda") else 5
    with tempfile.TemporaryDirectory(prefix="trillium-nn-step-") as tmp:
        result = run(args, Path(tmp) / "store")
    if args.json:
        print(json.dumps(result))
        return
    print(
        f"{result['device']}, batch {args.batch}, {args.precision}, torch {result['torch']}, {args.threads} thread(s)"
    )
    print(
        f"  Trainer.step  {result['trainer_steps_per_s']:8.2f} steps/s ({result['trainer_samples_per_s']:,.0f} samples/s)"
    )
    print(f"  plain loop    {result['plain_steps_per_s']:8.2f} steps/s")
    print(f"  vs_plain_loop {result['vs_plain_loop']:8.3f}   (max loss difference {result['max_loss_difference']:.3g})")


if __name__ == "__main__":
    main()
