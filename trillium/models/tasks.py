"""What the multi-task models (MMoE, ESMM, PLE) share: their tasks, named as a job's `labels:`."""

from __future__ import annotations

from collections.abc import Sequence


def task_names(model: str, tasks: Sequence[str] | int) -> list[str]:
    """The task names from a list of them or a count ("task0", ...); ValueError naming `model`
    and `tasks` otherwise."""
    if isinstance(tasks, int) and not isinstance(tasks, bool):
        if tasks < 1:
            raise ValueError(f"{model} needs at least one task, got tasks={tasks}")
        return [f"task{k}" for k in range(tasks)]
    if isinstance(tasks, str) or not isinstance(tasks, Sequence) or not all(isinstance(name, str) for name in tasks):
        raise ValueError(f"{model} tasks must be a list of names or their number, got tasks={tasks!r}")
    names = list(tasks)
    if not names:
        raise ValueError(f"{model} needs at least one task, got tasks=[]")
    if len(set(names)) < len(names):
        raise ValueError(f"{model} task names must be unique, got tasks={names}")
    return names
