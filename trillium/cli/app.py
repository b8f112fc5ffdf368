"""The command line's app, its console and what its commands share: the run directory, one-line
failures, loading a job file, a client of the stack's coordinator."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Annotated, Optional

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table
from rich.text import Text

from trillium import stack
from trillium.config import ENV_RUN_DIR, default_run_dir, describe_validation_error
from trillium.data import load_job
from trillium.job import JobConfig
from trillium.stack.client import ApiError, CoordinatorClient, CoordinatorUnavailable

app = typer.Typer(
    help="Trillium: hybrid training of recommender models with huge embedding tables.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
# No markup in what we print: job errors, paths and server messages are remote or user text
# ("[/__w/...]" in an error once crashed the CLI). Our own emphasis is explicit styles.
console = Console(markup=False, highlight=False)

RunDir = Annotated[
    Optional[Path],
    typer.Option(
        "--run-dir", help=f"stack directory (default: ${ENV_RUN_DIR} or .trillium/run; the demo's own: .trillium/demo)"
    ),
]


def print_table(columns: Sequence[str], rows: Sequence[Sequence[str | Text]]) -> None:
    """`rows` as a table where the terminal holds its cells whole, else one block per row of
    `column: value` lines: a table squeezed into 80 columns cuts a URL or an id to three letters."""
    cells = [[c if isinstance(c, Text) else Text(c) for c in row] for row in rows]
    widths = [max([len(name), *(row[i].cell_len for row in cells)]) for i, name in enumerate(columns)]
    if sum(widths) + 3 * len(columns) + 1 <= console.width:  # rich's box: a bar and two spaces a column
        table = Table(*columns)
        for row in cells:
            table.add_row(*row)
        console.print(table)
        return
    key = max(len(name) for name in columns)
    for n, row in enumerate(cells):
        if n:
            console.print()
        for name, cell in zip(columns, row, strict=True):
            console.print(Text.assemble((f"{name:>{key}}", "bold"), "  ", cell), soft_wrap=True)


def run_dir_of(run_dir: Path | None) -> Path:
    return (run_dir or default_run_dir()).absolute()


def fail(message: str) -> None:
    console.print(Text.assemble(("error: ", "red"), " ".join(message.split())), soft_wrap=True)  # one line
    raise typer.Exit(1)


def load_job_or_exit(path: Path) -> JobConfig:
    try:
        return load_job(path)
    except ValidationError as err:
        console.print(Text.assemble((f"invalid job {path}:", "red"), "\n" + describe_validation_error(err)))
    except (OSError, ValueError) as err:
        console.print(Text.assemble((f"invalid job {path}:", "red"), f" {err}"))
    raise typer.Exit(2)


JobId = Annotated[str, typer.Argument(help="the job's id (see `trillium jobs`)")]
JsonOut = Annotated[bool, typer.Option("--json", help="machine-readable output")]


@contextlib.contextmanager
def coordinator(run_dir: Path | None) -> Iterator[CoordinatorClient]:
    """A client of the stack's coordinator; API errors end the command with one line."""
    try:
        client = CoordinatorClient.for_stack(run_dir_of(run_dir))
    except (stack.LauncherError, OSError) as err:
        fail(str(err))
    try:
        yield client
    except (ApiError, CoordinatorUnavailable) as err:
        fail(str(err))
    finally:
        client.close()
