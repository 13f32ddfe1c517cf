"""OpenAI response shapes: validate bodies against the official schemas (a
subset of openai/openai-openapi, in tests/data), parse SSE streams."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

SCHEMAS = Path(__file__).resolve().parents[1] / "data" / "openai-response-schemas.json"


def _nullable_to_anyof(node):
    """The schemas mark null the OpenAPI 3.0 way (`nullable: true`); turn that
    into JSON Schema so a validator honours it."""
    if isinstance(node, dict):
        node = {k: _nullable_to_anyof(v) for k, v in node.items()}
        if node.pop("nullable", False):
            return {"anyOf": [node, {"type": "null"}]}
        return node
    if isinstance(node, list):
        return [_nullable_to_anyof(v) for v in node]
    return node


_DOC = _nullable_to_anyof(json.loads(SCHEMAS.read_text()))
_REGISTRY = Registry().with_resource("urn:openai", Resource.from_contents(_DOC, default_specification=DRAFT202012))


def validate(body: dict, schema: str) -> None:
    """Raise if `body` does not validate against components.schemas[schema]."""
    validator = jsonschema.Draft202012Validator({"$ref": f"urn:openai#/components/schemas/{schema}"},
                                                registry=_REGISTRY)
    validator.validate(body)


def sse_events(lines) -> list:
    """Parse SSE `data:` lines into JSON objects; '[DONE]' stays a string."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out
