"""Online data: create a job's input topics (`topics`), replay a data set as a live stream
(`replay`), write Criteo-format data from a planted model (`datagen`)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from trillium import stack
from trillium.config import KafkaConnection
from trillium.data.sources.datagen import DatagenReport, generate_criteo
from trillium.data.sources.datagen_multitask import MultitaskReport, generate_multitask
from trillium.job import JobConfig, KafkaData
from trillium.wire import kafka

from .app import RunDir, app, console, fail, load_job_or_exit, run_dir_of


def _input_kafka(config: JobConfig, run_dir: Path | None) -> KafkaConnection:
    """The Kafka a stream job reads: its data.bootstrap, else the stack's."""
    bootstrap = getattr(config.data, "bootstrap", None)
    if not bootstrap:
        st = stack.read_state(run_dir_of(run_dir))
        if not st:
            fail(f"no stack in {run_dir_of(run_dir)} and no data.bootstrap in the job: where is Kafka?")
        bootstrap = st["kafka"]["bootstrap"]
    return KafkaConnection.from_env(bootstrap)


@app.command()
def topics(
    job_file: Annotated[
        Path, typer.Option("--job", help="the online job whose input topics to create", exists=True, dir_okay=False)
    ],
    partitions: Annotated[
        int, typer.Option(min=1, help="partitions of each (the same for all: a join needs co-partitioned topics)")
    ] = 4,
    run_dir: RunDir = None,
) -> None:
    """Create a stream job's input topics (those missing) for producers of your own, such as kcat."""
    config = load_job_or_exit(job_file)
    if not isinstance(config.data, KafkaData):
        fail(f"the job's data.source is {config.data.source!r}: it reads no topics")
    names = config.data.input_topics
    asyncio.run(kafka.ensure_topics(_input_kafka(config, run_dir), {name: partitions for name in names}))
    console.print(f"topics {', '.join(names)}: ready")


@app.command()
def replay(
    file: Annotated[
        Path,
        typer.Argument(
            help="the data set (a criteo TSV, e.g. `trillium datagen` output, or an adult CSV)",
            exists=True,
            dir_okay=False,
        ),
    ],
    job_file: Annotated[
        Path, typer.Option("--job", help="the online job whose topics to feed", exists=True, dir_okay=False)
    ],
    rate: Annotated[float, typer.Option(min=0, help="impressions a second (0: as fast as it can)")] = 1000.0,
    fmt: Annotated[str, typer.Option("--format", help="criteo or adult")] = "criteo",
    limit: Annotated[Optional[int], typer.Option(min=1, help="rows to replay (default: all)")] = None,
    late_fraction: Annotated[float, typer.Option(min=0, max=1, help="clicks sent after the window")] = 0.0,
    malformed_fraction: Annotated[float, typer.Option(min=0, max=1, help="messages replaced by garbage")] = 0.0,
    seed: Annotated[int, typer.Option(help="of the delays and the choices")] = 0,
    run_dir: RunDir = None,
) -> None:
    """Turn a data set into a live stream: timestamped impression events, and a click event 0..W
    seconds later for each positive row (W: the job's attribution window), on the job's topics."""
    from trillium.data.replay import replay as run_replay

    config = load_job_or_exit(job_file)
    conn = _input_kafka(config, run_dir)
    try:
        result = asyncio.run(
            run_replay(
                file,
                config,
                conn,
                fmt=fmt,
                rate=rate,
                limit=limit,
                late_fraction=late_fraction,
                malformed_fraction=malformed_fraction,
                seed=seed,
            )
        )
    except ValueError as err:
        fail(str(err))
    console.print_json(json.dumps(dataclasses.asdict(result) | {"events_per_sec": round(result.events_per_sec, 1)}))


@app.command()
def datagen(
    path: Annotated[Path, typer.Argument(help="the file to write: Criteo-format TSV, or CSV with --multitask")],
    rows: Annotated[int, typer.Option(min=1, help="rows to write")] = 100_000,
    seed: Annotated[int, typer.Option(help="seed of the planted model and the draws")] = 0,
    vocab_size: Annotated[
        Optional[int], typer.Option(min=1, help="IDs per categorical slot (default: 10^3..10^6, varying by slot)")
    ] = None,
    multitask: Annotated[
        bool,
        typer.Option(
            "--multitask",
            help="a feed's impressions instead: user, item, recent items; a click, the seconds watched, a conversion",
        ),
    ] = False,
    split: Annotated[str, typer.Option(help="train or test: independent rows of the same planted model")] = "train",
) -> None:
    """Write data drawn from a planted model and print that model's own (Bayes-optimal) scores:
    the ceiling a trained model can approach. By default Criteo-format TSV from a planted logistic
    model (its AUC); with --multitask a feed's impressions as CSV, with each task's AUC and GAUC
    (grouped by user) or, for the watch time, the MSE of its log."""
    if split != "train" and split != "test":  # as written, mypy narrows it to the Split literal
        fail(f"--split must be train or test, got {split!r}")
    if multitask:
        if vocab_size is not None:
            fail("--vocab-size is for Criteo-format data, not --multitask")
        report: MultitaskReport | DatagenReport = generate_multitask(path, rows, seed, split=split)
    else:
        report = generate_criteo(path, rows, seed, split=split, vocab_sizes=[vocab_size] * 26 if vocab_size else None)
    console.print_json(json.dumps(dataclasses.asdict(report), default=str))


if __name__ == "__main__":
    app()
