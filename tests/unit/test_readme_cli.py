"""The `trillium` commands of README.md and docs/*.md exist, with the flags they are shown with:
every command in a shell code block (```sh), and every inline code span that starts with
`trillium`, is checked against the CLI's own `trillium SUBCOMMAND --help` (the Typer app
in-process), so a renamed command or flag fails here, naming the page and line, instead of
failing a reader.

What counts as a command: in a shell block, each command of a line (split at `;`, `&&`, `||`,
`|`, `&`, `$(`, `)`), after variable assignments and `watch`'s options, whose program is
`trillium` or `.venv/bin/trillium`; `kubectl -n trillium create` is not one. Its subcommand is
the first word after the program and its flags every `--word` after it, and those of the line's
`# comment` (`# --take asks for one`). An inline span is one too when it starts with
`trillium`, or with a subcommand and a flag (`stop --no-checkpoint`).
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from trillium.cli import app

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
SHELL_BLOCKS = {"sh", "bash", "shell", "console"}
PROGRAMS = {"trillium", ".venv/bin/trillium"}
SEPARATORS = re.compile(r"\$\(|&&|\|\||[;|&()]")
FLAG = re.compile(r"--[a-z][a-z0-9-]*")


@dataclass(frozen=True)
class Command:
    line: int  # 1-based, in its page
    subcommand: str
    flags: tuple[str, ...]
    text: str
    page: str = "README.md"

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {self.text!r}"


def _command(words: list[str], line: int, text: str) -> Command | None:
    """The `trillium` command of one shell command's words, or None for another program."""
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
        words = words[1:]  # VAR=value before the program
    if words[:1] == ["watch"]:
        words = words[1:]
        while words and words[0].startswith("-"):
            words = words[1:]
    if not words or words[0] not in PROGRAMS:
        return None
    args = words[1:]
    if not args:
        return None  # the program named in passing (`the trillium command`), not a command line
    flags = tuple(dict.fromkeys(m.group(0).split("=")[0] for w in args[1:] for m in [FLAG.match(w.strip("[]"))] if m))
    return Command(line, args[0], flags, text)


def _words(text: str) -> list[str]:
    try:
        return shlex.split(text, comments=True)
    except ValueError:  # a quote closed on another line (a curl body): its words as they are
        return text.split("#", 1)[0].split()


def commands_in(markdown: str) -> list[Command]:
    """Every `trillium` command of `markdown`'s shell blocks and inline code spans."""
    out: list[Command] = []
    fence: str | None = None  # the open block's language
    prose: list[tuple[int, str]] = []  # (line number, line) outside code blocks
    for number, line in enumerate(markdown.splitlines(), start=1):
        if line.lstrip().startswith("```"):
            fence = None if fence is not None else (line.strip()[3:].strip() or "-")
            continue
        if fence is None:
            prose.append((number, line))
        elif fence in SHELL_BLOCKS and not line.lstrip().startswith("#"):
            code, _, comment = line.partition(" #")
            found = [c for part in SEPARATORS.split(code) if (c := _command(_words(part), number, part.strip()))]
            if len(found) == 1 and (more := FLAG.findall(comment)):
                # `trillium checkpoints JOB   # --take asks for one`: the comment's flags are its own.
                c = found[0]
                found = [Command(c.line, c.subcommand, tuple(dict.fromkeys(c.flags + tuple(more))), line.strip())]
            out.extend(found)
    # Inline spans may run over a line break: join the prose, keeping each character's line.
    text = "\n".join(line for _, line in prose)
    starts = [0]
    for _, line in prose:
        starts.append(starts[-1] + len(line) + 1)
    for span in re.finditer(r"`([^`]+)`", text):
        code = " ".join(span.group(1).split())
        words = code.split(" ")
        if words[0] in subcommands() and len(words) > 1 and words[1].startswith("--"):
            code = f"trillium {code}"  # `stop --no-checkpoint`: a subcommand's flag, said in passing
        if code.split(" ", 1)[0] in PROGRAMS:
            index = next(i for i in range(len(prose)) if starts[i + 1] > span.start())
            for part in SEPARATORS.split(code):
                if (cmd := _command(_words(part), prose[index][0], part.strip())) is not None:
                    out.append(cmd)
    return sorted(out, key=lambda c: c.line)


@cache
def _help(args: tuple[str, ...]) -> tuple[int, str]:
    result = CliRunner().invoke(app, [*args, "--help"], env={"COLUMNS": "250", "NO_COLOR": "1"}, terminal_width=250)
    return result.exit_code, result.output


@cache
def subcommands() -> frozenset[str]:
    """The subcommands `trillium --help` lists (the app's Click group: what the help is made from)."""
    group = typer.main.get_command(app)
    return frozenset(name for name, cmd in group.commands.items() if not cmd.hidden)  # type: ignore[attr-defined]


def problems(command: Command) -> list[str]:
    """What is wrong with `command` by the CLI's help: an unknown subcommand or unknown flags."""
    if command.subcommand not in subcommands():
        return [f"{command}: no subcommand {command.subcommand!r} in `trillium --help`"]
    code, text = _help((command.subcommand,))
    assert code == 0, text
    known = set(FLAG.findall(text))
    return [
        f"{command}: `trillium {command.subcommand} --help` has no {flag}"
        for flag in command.flags
        if flag not in known
    ]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_command_and_flag_of_a_page_is_in_the_cli_help(page: Path) -> None:
    name = str(page.relative_to(ROOT))
    commands = [dataclasses.replace(c, page=name) for c in commands_in(page.read_text())]
    wrong = [p for c in commands for p in problems(c)]
    assert not wrong, "\n".join(wrong)


def test_the_pages_show_the_commands() -> None:
    counts = {page.name: len(commands_in(page.read_text())) for page in PAGES}
    assert counts["README.md"] >= 8 and sum(counts.values()) >= 40, f"the pages' commands were not found: {counts}"


def test_the_extraction_finds_commands_where_they_are_and_only_there() -> None:
    markdown = """Run `trillium up --ps-shards N` (or `trillium serve
MODEL [--version N]`); `kubectl -n trillium get pods` is not ours; `stop --no-checkpoint` is.

```sh
.venv/bin/trillium stop $JOB; .venv/bin/trillium resume $JOB --checkpoint STEP   # --take: a comment
SERVE=$(.venv/bin/trillium status --json | python3 -c "import json")
watch -n1 .venv/bin/trillium models online &
.venv/bin/trillium checkpoints JOB_ID   # --take asks for one; --delete STEP
kubectl -n trillium create secret generic trillium-secrets --from-literal=token=x
```

```
trillium up/status/down   (a layout block, not shell)
```
"""
    got = [(c.line, c.subcommand, c.flags) for c in commands_in(markdown)]
    assert got == [
        (1, "up", ("--ps-shards",)),
        (1, "serve", ("--version",)),
        (2, "stop", ("--no-checkpoint",)),
        (5, "stop", ()),
        (5, "resume", ("--checkpoint",)),
        (6, "status", ("--json",)),
        (7, "models", ()),
        (8, "checkpoints", ("--take", "--delete")),
    ]


@pytest.mark.parametrize(
    "line, why",
    [
        (".venv/bin/trillium train job.yaml --reprot r.json", "has no --reprot"),
        (".venv/bin/trillium trian job.yaml", "no subcommand 'trian'"),
        (".venv/bin/trillium reshard JOB --shards 3", "has no --shards"),
    ],
)
def test_a_stale_command_or_flag_fails(line: str, why: str) -> None:
    """The check can fail: the README with one bogus command added is refused, naming it."""
    broken = README.read_text() + f"\n```sh\n{line}\n```\n"
    wrong = [p for c in commands_in(broken) for p in problems(c)]
    assert len(wrong) == 1 and why in wrong[0], wrong
