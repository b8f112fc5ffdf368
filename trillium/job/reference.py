"""The job-file reference (docs/job-reference.md), made from the job schema's own descriptions (a
field's docstring, see `base.Strict`): `python -m trillium.job.reference > docs/job-reference.md`.
tests/unit/test_job_reference.py fails when the page is not what this makes, or a field has no
description."""

from __future__ import annotations

import json
import re
import typing
from typing import Any

from pydantic import BaseModel

from .schema import JobConfig

INTRO = """\
Every key a job file (YAML, or JSON to `POST /v1/jobs`) may hold, made from the job schema
(`trillium/job/`) by `python -m trillium.job.reference`: a key not listed here is an error naming
it, as is a value outside what its type says. `examples/adult/job.yaml` and
`tests/data/tiny_job.yaml` are complete jobs; [Training a job](jobs.md) says how the parts fit.
"""


def _anchor(name: str) -> str:
    return re.sub(r"[^a-z0-9-]", "", name.lower())


def _bounds(prop: dict[str, Any]) -> str:
    marks = {"minimum": "≥", "exclusiveMinimum": ">", "maximum": "≤", "exclusiveMaximum": "<"}
    said = [f"{sign} {prop[key]}" for key, sign in marks.items() if key in prop]
    if "minLength" in prop and prop["minLength"] > 1:
        said.append(f"at least {prop['minLength']} long")
    if "maxLength" in prop:
        said.append(f"at most {prop['maxLength']} long")
    if "minItems" in prop and prop["minItems"] > 1:
        said.append(f"at least {prop['minItems']}")
    return f" ({', '.join(said)})" if said else ""


def _type(prop: dict[str, Any]) -> str:
    """A property's type as a reader says it: `string`, `list of FeatureSlot`, `"sum" or "mean"`."""
    if "$ref" in prop:
        name = prop["$ref"].rsplit("/", 1)[-1]
        return f"[{name}](#{_anchor(name)})"
    for key in ("anyOf", "oneOf"):
        if key in prop:
            return " or ".join(dict.fromkeys(_type(option) for option in prop[key]))
    if "const" in prop:
        return f"`{json.dumps(prop['const'])}`"
    if "enum" in prop:
        return " or ".join(f"`{json.dumps(value)}`" for value in prop["enum"])
    kind = prop.get("type")
    if kind == "array":
        return f"list of {_type(prop.get('items', {}))}{_bounds(prop)}"
    if kind == "object":
        values = prop.get("additionalProperties")
        return f"map of {_type(values)}" if isinstance(values, dict) and values else "map"
    if kind is None:
        return "any"
    return f"{kind}{_bounds(prop)}"


def _default(model: type[BaseModel] | None, key: str, required: bool) -> str:
    if required:
        return "required"
    value = model.model_fields[key].get_default(call_default_factory=True) if model else None
    if isinstance(value, BaseModel):  # a section made by a factory: short, or each key's own
        said = json.dumps(value.model_dump(mode="json"), separators=(", ", ": "))
        return f"`{said}`" if len(said) <= 48 else "each key's default"
    return f"`{json.dumps(value)}`"


def _classes(root: type[BaseModel]) -> dict[str, type[BaseModel]]:
    """Every model the job reaches, by the name its schema gives it."""
    found: dict[str, type[BaseModel]] = {}
    queue: list[Any] = [root]
    while queue:
        annotation = queue.pop()
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            if annotation.__name__ not in found:
                found[annotation.__name__] = annotation
                queue.extend(field.annotation for field in annotation.model_fields.values())
        else:
            queue.extend(typing.get_args(annotation))
    return found


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _order(schema: dict[str, Any]) -> list[str]:
    """The models in the order a reader meets them: the job first, then each where it is first named."""
    defs = schema.get("$defs", {})
    order, queue = [], [schema]
    while queue:
        node = queue.pop(0)
        refs = re.findall(r'"\$ref": "#/\$defs/([^"]+)"', json.dumps(node.get("properties", {})))
        for name in refs:
            if name not in order:
                order.append(name)
                queue.append(defs[name])
    return order


def markdown() -> str:
    schema = JobConfig.model_json_schema(mode="validation")
    defs = schema.get("$defs", {})
    classes = _classes(JobConfig)
    lines = ["# Job file reference", "", INTRO]
    for name, model in [("JobConfig", schema), *((n, defs[n]) for n in _order(schema))]:
        lines += [f"## {name}", "", _cell(model.get("description", "")), ""]
        lines += ["| key | type | default | what it is |", "|---|---|---|---|"]
        required = set(model.get("required", []))
        for key, prop in model.get("properties", {}).items():
            default = _default(classes.get(name), key, key in required)
            row = [f"`{key}`", _type(prop), default, _cell(prop.get("description", ""))]
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown(), end="")
