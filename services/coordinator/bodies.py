"""What every route of the coordinator's API shares: the bounds a body must keep and the shape
of an error's answer."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

# Bodies are kept as JSON records in Redis and read back all the time: they must stay within
# what pydantic reads back (nesting) and what validation walks quickly (YAML aliases can make
# a small body expand to a huge value).
MAX_DEPTH = 32
MAX_VALUES = 100_000


class ErrorResponse(BaseModel):
    detail: str


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI's `responses` for these error codes."""
    return {code: {"model": ErrorResponse} for code in codes}


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
