"""What every part of the job schema shares: models that forbid unknown keys and are frozen, the
constrained number types, and the one pattern of names that become paths."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

PositiveInt = Annotated[int, Field(ge=1)]
NonNegativeFloat = Annotated[float, Field(ge=0)]
PositiveFloat = Annotated[float, Field(gt=0)]
Probability = Annotated[float, Field(ge=0, lt=1)]
# A name that becomes part of a path or a topic (a job's, a model's, a job id): one path component,
# never "." or "..", no separator.
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"


class Strict(BaseModel):
    """A misspelt key fails naming the field; a value never changes after validation. A field's
    docstring (the string after it) is its description: the job-file reference
    (docs/job-reference.md) and the API's schema are made from them."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)
