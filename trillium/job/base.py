"""What every part of the job schema shares: models that forbid unknown keys and are frozen, and
the constrained number types."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

PositiveInt = Annotated[int, Field(ge=1)]
NonNegativeFloat = Annotated[float, Field(ge=0)]
PositiveFloat = Annotated[float, Field(gt=0)]
Probability = Annotated[float, Field(ge=0, lt=1)]


class Strict(BaseModel):
    """A misspelt key fails naming the field; a value never changes after validation."""

    model_config = ConfigDict(extra="forbid", frozen=True)
