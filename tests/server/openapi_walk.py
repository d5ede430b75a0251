"""Typed helpers for the OpenAPI tests: walk every request input schema of a document."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

__all__ = ["input_schemas", "unbounded"]


def _resolve(node: Any, document: dict[str, Any]) -> Any:
    while isinstance(node, dict) and isinstance(node.get("$ref"), str):
        ref: str = node["$ref"]
        target: Any = document
        for part in ref.removeprefix("#/").split("/"):
            target = target[part]
        node = target
    return node


def _walk(node: Any, where: str, document: dict[str, Any], seen: frozenset[str]) -> Iterator[tuple[str, Any]]:
    if isinstance(node, dict) and isinstance(node.get("$ref"), str):
        if node["$ref"] in seen:
            return
        seen = seen | {node["$ref"]}
        node = _resolve(node, document)
    if not isinstance(node, dict):
        return
    yield where, node
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
        for i, sub in enumerate(node.get(key, [])):
            yield from _walk(sub, f"{where}[{key}{i}]", document, seen)
    if isinstance(node.get("items"), dict):
        yield from _walk(node["items"], f"{where}[]", document, seen)
    for name, sub in node.get("properties", {}).items():
        yield from _walk(sub, f"{where}.{name}", document, seen)
    if isinstance(node.get("additionalProperties"), dict):
        yield from _walk(node["additionalProperties"], f"{where}.*", document, seen)


def input_schemas(document: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, schema) for every node of every parameter and request-body schema in ``document``."""
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            op = f"{method.upper()} {path}"
            for parameter in operation.get("parameters", []):
                parameter = _resolve(parameter, document)
                yield from _walk(
                    parameter.get("schema", {}), f"{op} {parameter['in']} {parameter['name']}", document, frozenset()
                )
            body = operation.get("requestBody", {}).get("content", {})
            for media, entry in body.items():
                yield from _walk(entry.get("schema", {}), f"{op} body({media})", document, frozenset())


def unbounded(schema: dict[str, Any]) -> str | None:
    """Why ``schema`` lets through an unbounded integer or string, or None when it is bounded."""
    kind = schema.get("type")
    if "enum" in schema or "const" in schema:
        return None
    if kind == "integer" and ("maximum" not in schema or "minimum" not in schema):
        return "integer without minimum and maximum"
    if kind == "string" and schema.get("format") != "binary" and "maxLength" not in schema:
        pattern = schema.get("pattern", "")
        if not (pattern.startswith("^") and pattern.endswith("$") and "*" not in pattern and "+" not in pattern):
            return "string without maxLength (or an anchored pattern of bounded length)"
    if kind == "array" and "maxItems" not in schema:
        return "array without maxItems"
    return None
