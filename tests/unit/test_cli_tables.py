"""The CLI's wide tables (`trillium models`, `trillium checkpoints`): where the terminal holds the
cells whole, a table; where it does not, one block per row, every cell whole (an 80-column table
of eleven columns cut each URL and model name to "htt…", "adu…")."""

from __future__ import annotations

import importlib
import io

from rich.console import Console

cli_app = importlib.import_module("trillium.cli.app")  # the module: `trillium.cli.app` names the Typer app

COLUMNS = ("replica", "model", "version", "step", "kind", "pinned", "age", "freshness lag", "watermark lag")
ROWS = [
    ("https://10.250.0.21:8080", "adult-income", "12", "4,199", "full", "", "3 s ago", "1.2 s", "0.4 s"),
    ("https://10.250.0.22:8080", "adult-income", "12", "4,199", "full", "", "3 s ago", "1.3 s", "0.5 s"),
]


def _printed(monkeypatch, width: int) -> str:
    out = io.StringIO()
    monkeypatch.setattr(cli_app, "console", Console(file=out, width=width, markup=False, highlight=False))
    cli_app.print_table(COLUMNS, ROWS)
    return out.getvalue()


def test_a_narrow_terminal_gets_one_block_a_row_with_every_cell_whole(monkeypatch) -> None:
    text = _printed(monkeypatch, 80)
    assert "…" not in text
    blocks = text.strip().split("\n\n")
    assert len(blocks) == 2
    for block, row in zip(blocks, ROWS, strict=True):
        lines = [line.strip() for line in block.splitlines()]
        assert lines == [f"{name}  {value}".strip() for name, value in zip(COLUMNS, row, strict=True)]
    assert max(len(line) for line in text.splitlines()) <= 80


def test_a_wide_terminal_gets_the_table(monkeypatch) -> None:
    text = _printed(monkeypatch, 200)
    assert "…" not in text
    header = next(line for line in text.splitlines() if "replica" in line)
    assert all(name in header for name in COLUMNS)
    assert sum("https://10.250.0.2" in line for line in text.splitlines()) == 2
