"""What a job learns: its tasks. `label:` is the one-task shorthand (`LabelConfig`, a binary
task named "label"); `labels:` lists several (`TaskConfig`), trained together on one model whose
forward returns one output a task, in the list's order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BeforeValidator, Field, model_validator

from .base import NonNegativeFloat, PositiveFloat, Strict

if TYPE_CHECKING:
    from .data import JoinConfig

TASK_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"
# A mask cell that lets a task train on its row, and one that keeps it out; anything else is a
# malformed row.
MASK_ON = ("1", "true")
MASK_OFF = ("0", "false", "")


def _one_or_many(value: Any) -> Any:
    return [value] if isinstance(value, str) else value


# Label values: one, or a list.
Values = Annotated[list[str], BeforeValidator(_one_or_many), Field(min_length=1)]


class LabelConfig(Strict):
    """The label column: values in `positive` are 1, those in `negative` 0. Without
    `negative`, every other non-empty value is 0; with it, any other value is a malformed row."""

    column: str
    """The label's column (or event field)."""
    positive: Values
    """The values that are a positive (1): one, or a list."""
    negative: Values | None = None
    """The values that are a negative (0); null: every other non-empty value."""

    @model_validator(mode="after")
    def _disjoint(self) -> LabelConfig:
        both = set(self.positive) & set(self.negative or ())
        if both:
            raise ValueError(f"label values {sorted(both)} are both positive and negative")
        return self


class TaskConfig(Strict):
    """One objective of a multi-task job (`labels:`). An empty cell in its column is no label
    for that row: the row adds nothing to this task's loss or metrics (a row with no label for
    any task is malformed).

    `binary`: a 0/1 label (values in `positive` are 1; with `negative`, those are 0 and any
    other value is a malformed row; without, every other value is 0), trained by BCE with
    logits, scored by AUC, GAUC and log loss. `regression`: a number, trained by `mse` or
    `huber` on the label after `transform`, scored by MSE and MAE on that scale; serving answers
    in the label's own units (the transform undone)."""

    name: Annotated[str, Field(pattern=TASK_NAME_PATTERN, max_length=64)]
    """The task's name: in reports, metrics (`task` label) and serving's answers."""
    column: str
    """Its label's column (or event field)."""
    kind: Literal["binary", "regression"] = "binary"
    """`binary` (BCE) or `regression` (`loss`: mse or huber)."""
    positive: Values | None = None
    """binary: the values that are a positive (1); default "1"."""
    negative: Values | None = None
    """binary: the values that are a negative (0); null: every other non-empty value."""
    loss: Literal["bce", "mse", "huber"] | None = None
    """The loss: `bce` for binary (the default and only one); `mse` (default) or `huber` for
    regression."""
    huber_delta: PositiveFloat = 1.0
    """`huber`'s delta: quadratic within it, linear beyond."""
    transform: Literal["none", "log", "log1p"] = "none"
    """regression: the label the model learns, `log` (labels > 0) or `log1p` (labels > -1) of
    it, as for durations; a label outside the domain is a malformed row."""
    weight: NonNegativeFloat = 1.0
    """The task's weight in the summed loss."""
    mask: str | None = None
    """A column whose cell says whether the row trains this task: "1"/"true" yes, "0"/"false" or
    empty no (e.g. a conversion rate learnt on clicked rows only); any other value is malformed."""

    @model_validator(mode="after")
    def _fits_kind(self) -> TaskConfig:
        where = f"labels: task {self.name!r}"
        if self.kind == "binary":
            if self.loss not in (None, "bce"):
                raise ValueError(f"{where}: a binary task's loss is bce, got {self.loss!r}")
            if self.transform != "none":
                raise ValueError(f"{where}: transform is for regression tasks")
            both = set(self.positive or ["1"]) & set(self.negative or ())
            if both:
                raise ValueError(f"{where}: values {sorted(both)} are both positive and negative")
        else:
            if self.loss == "bce":
                raise ValueError(f"{where}: a regression task's loss is mse or huber, not bce")
            if self.positive is not None or self.negative is not None:
                raise ValueError(f"{where}: positive/negative are for binary tasks")
        return self

    @property
    def positive_values(self) -> list[str]:
        return self.positive or ["1"]

    @property
    def loss_name(self) -> str:
        return self.loss or ("bce" if self.kind == "binary" else "mse")

    @classmethod
    def of_label(cls, label: LabelConfig) -> TaskConfig:
        """The `label:` shorthand as the one binary task it is."""
        return cls(name="label", column=label.column, positive=label.positive, negative=label.negative)


def check_tasks(tasks: list[TaskConfig]) -> None:
    """Names unique, columns distinct, some weight: a `ValueError` naming the task at fault."""
    for i, task in enumerate(tasks):
        earlier = tasks[:i]
        if any(t.name == task.name for t in earlier):
            raise ValueError(f"labels[{i}]: duplicate task name {task.name!r}")
        if any(t.column == task.column for t in earlier):
            raise ValueError(f"labels[{i}] {task.name!r}: column {task.column!r} is another task's label")
    if not any(t.weight > 0 for t in tasks):
        raise ValueError("labels: every task has weight 0: nothing would train")


def check_joined_tasks(tasks: list[TaskConfig], join: JoinConfig) -> None:
    """A multi-task job's join names a label topic for every task, each a binary task whose label
    the joiner sets: a `ValueError` naming what is at fault."""
    if not join.per_task:
        raise ValueError(
            "data.join.labels: a multi-task job's join names each task's label topic: "
            "[{topic, task, window_seconds}, ...]"
        )
    names = [t.name for t in tasks]
    for i, joined in enumerate(join.labels):
        if joined.task not in names:
            raise ValueError(f"data.join.labels[{i}]: task {joined.task!r} is not in labels ({', '.join(names)})")
    for task in tasks:
        where = f"labels: task {task.name!r}"
        if task.name not in (j.task for j in join.labels):
            raise ValueError(f"{where}: no label topic in data.join.labels (a joined job's tasks are each joined)")
        if task.kind != "binary":
            raise ValueError(f"{where}: a joined task is binary (its label events are positives)")
        if task.positive_values != ["1"] or task.negative not in (None, ["0"]) or task.mask is not None:
            raise ValueError(
                f'{where}: the joiner sets a joined task\'s label to "1" or "0": use positive: "1" '
                '(and negative: "0"), no mask'
            )
