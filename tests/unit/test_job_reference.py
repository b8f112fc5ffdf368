"""The job-file reference (docs/job-reference.md) is made from the schema's descriptions: every
field of every part of a job has one, and the page is what `trillium.job.reference` makes of them
today (regenerate it with `python -m trillium.job.reference > docs/job-reference.md`)."""

from __future__ import annotations

import typing
from pathlib import Path

from pydantic import BaseModel

from trillium.job import JobConfig
from trillium.job.reference import markdown

PAGE = Path(__file__).resolve().parents[2] / "docs" / "job-reference.md"


def models(root: type[BaseModel]) -> list[type[BaseModel]]:
    """Every model a job file reaches from `root`, through unions, lists, maps and Annotated."""
    seen: list[type[BaseModel]] = []

    def types_in(annotation: object) -> list[object]:
        inner = typing.get_args(annotation)
        return [annotation] if not inner else [t for arg in inner for t in types_in(arg)]

    def visit(model: type[BaseModel]) -> None:
        if model in seen:
            return
        seen.append(model)
        for field in model.model_fields.values():
            for t in types_in(field.annotation):
                if isinstance(t, type) and issubclass(t, BaseModel):
                    visit(t)

    visit(root)
    return seen


def test_every_field_of_a_job_has_a_description() -> None:
    reached = models(JobConfig)
    assert len(reached) >= 25, [m.__name__ for m in reached]
    missing = [f"{m.__name__}.{name}" for m in reached for name, f in m.model_fields.items() if not f.description]
    assert not missing, f"fields without a description (a docstring after the field): {missing}"


def test_the_reference_page_is_what_the_schema_says() -> None:
    assert PAGE.read_text() == markdown(), "docs/job-reference.md is stale: python -m trillium.job.reference > it"
    for model in models(JobConfig):
        assert f"## {model.__name__}\n" in PAGE.read_text(), model.__name__
