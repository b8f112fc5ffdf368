"""Exactly-once where the gradients land: the final model holds each training step's gradients of
each NN rank exactly once, on every PS shard, and no shard applied any twice — read from the
shards' gradient ledgers (trillium.runtime.ledger, in the job view's `ledgers`), not from counters
the ranks restore from a checkpoint.

What exactly must hold. Steps are numbered across epochs (epoch e's first step is the sum of the
earlier epochs' steps); every rank trains every step (a rank short of batches trains empty ones:
DDP needs the ranks in lock-step) and its embedding worker sends every PS shard a message for every
step, an empty one too. So on each shard of the job's final topology, of each rank r, the held
steps are exactly 0 .. S-1, S = epochs × steps an epoch: none missing, none beyond, none twice.
And in every attempt's last ledgers (an abandoned attempt's too) nothing was applied twice.

The step count comes from the job's config alone, not from the code under test: with one data
loader an epoch takes ceil(ceil(rows / batch_size) / nn_ranks) steps (the last batch may be short;
the ranks' last step may be short of a batch). Several loaders pad to the longest share, which
depends on how the source splits: the caller says `steps_per_epoch` then.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from trillium.job import JobConfig
from trillium.job.data import CriteoData, SyntheticData


def train_rows(job: JobConfig) -> int:
    """The train split's rows, from the config (synthetic: `data.rows`) or by counting the lines of
    its one Criteo file (no header; a test split of its own)."""
    data = job.data
    if isinstance(data, SyntheticData):
        return data.rows
    if isinstance(data, CriteoData) and isinstance(data.train, Path) and data.split is None:
        with data.train.open("rb") as f:
            return sum(1 for line in f if line.strip())
    raise ValueError(f"cannot tell the train rows of a {data.source} source here: pass train_rows")


def train_steps(job: JobConfig, *, rows: int | None = None, steps_per_epoch: int | None = None) -> int:
    """The steps the job trains, all epochs: see the module docstring."""
    if steps_per_epoch is None:
        if job.topology.data_loaders != 1:
            raise ValueError(f"{job.topology.data_loaders} data loaders: pass steps_per_epoch")
        rows = train_rows(job) if rows is None else rows
        steps_per_epoch = math.ceil(math.ceil(rows / job.training.batch_size) / job.topology.nn_ranks)
    return job.training.epochs * steps_per_epoch


def ledger_problems(view: dict[str, Any], steps: int, ranks: int) -> list[str]:
    """What breaks exactly-once in a finished job's ledgers (`view`: the job view as JSON), for a
    job of `steps` steps on `ranks` NN ranks; empty when nothing does."""
    job = view["job"]
    ledgers = {int(a): {int(s): led for s, led in by_shard.items()} for a, by_shard in view["ledgers"].items()}
    shards = job["config"]["topology"]["ps_shards"]
    problems = []
    final = ledgers.get(job["attempt"], {})
    for shard in range(shards):
        ledger = final.get(shard)
        if ledger is None:
            problems.append(f"shard {shard}: no ledger in attempt {job['attempt']}: what its state holds is unknown")
            continue
        if ledger["unknown_through"] is not None:
            problems.append(
                f"shard {shard}: restored from a checkpoint without a ledger (step {ledger['unknown_through']}): "
                "what its state holds up to there is unknown"
            )
        for rank in range(ranks):
            held = _steps(ledger["contained"].get(str(rank), []))
            if held != ([(0, steps - 1)] if steps else []):
                problems.append(f"shard {shard}, rank {rank}: holds steps {held}, expected 0..{steps - 1} once each")
        extra = sorted(set(ledger["contained"]) - {str(r) for r in range(ranks)})
        if extra:
            problems.append(f"shard {shard}: holds gradients of ranks {extra}, not of the job's {ranks} ranks")
    for attempt, by_shard in sorted(ledgers.items()):
        for shard, ledger in sorted(by_shard.items()):
            if ledger["duplicate_count"] or ledger["duplicates"]:
                problems.append(
                    f"attempt {attempt}, shard {shard}: {ledger['duplicate_count']} (step, rank) applied again "
                    f"to a state that held them: {ledger['duplicates']} (by rank, [first, last, attempt])"
                )
    return problems


def assert_exactly_once_at_the_ps(
    view: dict[str, Any], config: JobConfig, *, rows: int | None = None, steps_per_epoch: int | None = None
) -> None:
    """Assert `ledger_problems` finds nothing in a finished job (`config`: the job as submitted)."""
    steps = train_steps(config, rows=rows, steps_per_epoch=steps_per_epoch)
    problems = ledger_problems(view, steps, config.topology.nn_ranks)
    assert not problems, "the PS shards' ledgers break exactly-once:\n  " + "\n  ".join(problems)


def final_runs(view: dict[str, Any]) -> str:
    """The final model's ledgers in a line: per shard, per rank, its [first, last, attempt] runs."""
    final = view["ledgers"].get(str(view["job"]["attempt"]), {})
    return "; ".join(f"shard {s}: {ledger['contained']}" for s, ledger in sorted(final.items()))


def _steps(runs: list[list[int]]) -> list[tuple[int, int]]:
    """[first, last, attempt] runs as (first, last) ranges, adjacent ones joined."""
    out: list[tuple[int, int]] = []
    for first, last, _ in runs:
        if out and out[-1][1] == first - 1:
            out[-1] = (out[-1][0], last)
        else:
            out.append((first, last))
    return out
