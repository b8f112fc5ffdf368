"""Every request body of the coordinator's API (views.py: what it answers), and the bounds every
body must keep. The bodies its parts take as they are: `WorkerRegistration`, `ForgetRequest`."""

from __future__ import annotations

from typing import Annotated, Any

import yaml
from fastapi import HTTPException, Request, status
from pydantic import AfterValidator, BaseModel, BeforeValidator, Field

from trillium.job import JobConfig

# Bodies are kept as JSON records in Redis and read back all the time: they must stay within
# what pydantic reads back (nesting) and what validation walks quickly (YAML aliases can make
# a small body expand to a huge value).
MAX_DEPTH = 32
MAX_VALUES = 100_000
YAML_TYPES = ("application/yaml", "application/x-yaml", "text/yaml")


def bounded(doc: Any) -> Any:
    """`doc` itself, unless it is too large or too deeply nested to keep (ValueError)."""
    stack, seen = [(doc, 1)], 0
    while stack:
        node, depth = stack.pop()
        seen += 1
        if seen > MAX_VALUES:
            raise ValueError(f"the document expands to more than {MAX_VALUES} values")
        if depth > MAX_DEPTH:
            raise ValueError(f"the document nests deeper than {MAX_DEPTH} levels")
        children = [*node.keys(), *node.values()] if isinstance(node, dict) else node if isinstance(node, list) else []
        stack.extend((child, depth + 1) for child in children)
    return doc


# ---- a job -------------------------------------------------------------------------------------


def _parsed(value: Any) -> Any:
    """FastAPI decodes only JSON bodies: a YAML one reaches the model as bytes."""
    if isinstance(value, bytes):
        try:
            value = yaml.safe_load(value)
        except (yaml.YAMLError, RecursionError, UnicodeDecodeError) as err:
            raise ValueError(f"invalid YAML: {err}") from None
    return bounded(value)


JobConfigBody = Annotated[JobConfig, BeforeValidator(_parsed)]


async def job_media_type(request: Request) -> None:
    media = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
    if media not in ("application/json", *YAML_TYPES):
        raise HTTPException(
            status.HTTP_415_UNSUPPORTED_MEDIA_TYPE, f"send a job as application/json or application/yaml, not {media}"
        )


# ---- a job's control ---------------------------------------------------------------------------


class StopRequest(BaseModel):
    checkpoint: bool = Field(True, description="take a final checkpoint at the step the job stops at")


class ResumeRequest(BaseModel):
    checkpoint: Annotated[int, Field(ge=0)] | None = Field(
        None,
        description="a stopped or failed job: the step of the checkpoint to resume from (default: the "
        "newest); a paused job takes none",
    )


class ReshardRequest(BaseModel):
    ps_shards: Annotated[int, Field(ge=1, le=64)] = Field(
        description="the PS shards the job goes on with: embedding_ps-0..N-1, which the stack must run"
    )


class StalenessUpdate(BaseModel):
    bound: Annotated[int, Field(ge=0, le=(1 << 31) - 1)] | None = Field(
        description="0: synchronous; k: up to k steps of gradients not yet applied; null: unbounded"
    )


# ---- a worker's heartbeat ----------------------------------------------------------------------


class HeartbeatRequest(BaseModel):
    health: Annotated[dict[str, Any], AfterValidator(bounded)] = {}
    job_digest: str | None = Field(
        None, max_length=64, description="the job_digest of the last answer whose job the worker holds"
    )
