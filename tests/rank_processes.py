"""NN ranks as processes of their own, for the tests that form a real gloo group: started from a
forkserver, which imports torch once (a spawned rank would import it afresh, seconds here, per
rank) and forks every rank from itself, never from the test process, whose gloo group runs
threads a fork would not carry."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch


def rank_processes(*preload: str) -> Any:
    """The multiprocessing context ranks start in; `preload`: modules the forkserver imports first."""
    context = torch.multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch.distributed", *preload])
    return context


def run_ranks(context: Any, target: Callable[..., None], args: Sequence[tuple]) -> dict[int, list]:
    """Run a rank per `args` (`target(*args[r], results)` puts `(rank, *what)` on `results`):
    what each rank put, by rank, once every rank exited 0."""
    results = context.Queue()
    ranks = [context.Process(target=target, args=(*a, results)) for a in args]
    for p in ranks:
        p.start()
    got = {r: rest for r, *rest in (results.get(timeout=120) for _ in ranks)}
    for p in ranks:
        p.join(timeout=60)
        assert p.exitcode == 0
    return got
