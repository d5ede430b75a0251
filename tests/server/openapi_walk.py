"""Typed helpers for the OpenAPI tests: walk every request input schema of a document."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

__all__ = ["input_schemas", "unbounded", "undocumented_fields"]


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


def _fields(node: Any, where: str, document: dict[str, Any], seen: frozenset[str]) -> Iterator[tuple[str, Any]]:
    """(where, schema) of every object property below ``node``, through $ref, unions and arrays."""
    if isinstance(node, dict) and isinstance(node.get("$ref"), str):
        if node["$ref"] in seen:
            return
        seen = seen | {node["$ref"]}
        node = _resolve(node, document)
    if not isinstance(node, dict):
        return
    for key in ("anyOf", "oneOf", "allOf"):
        for sub in node.get(key, []):
            yield from _fields(sub, where, document, seen)
    if isinstance(node.get("items"), dict):
        yield from _fields(node["items"], f"{where}[]", document, seen)
    for name, sub in node.get("properties", {}).items():
        yield f"{where}.{name}", sub
        yield from _fields(sub, f"{where}.{name}", document, seen)


def undocumented_fields(document: dict[str, Any], *, skip: tuple[str, ...] = ()) -> list[str]:
    """Every request or response field (and parameter) without a description, as ``"POST /path body.x.y"``; a
    field whose place starts with one of ``skip`` is not checked."""
    missing = []
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            op = f"{method.upper()} {path}"
            for parameter in operation.get("parameters", []):
                parameter = _resolve(parameter, document)
                if not (parameter.get("description") or parameter.get("schema", {}).get("description")):
                    missing.append(f"{op} {parameter['in']} {parameter['name']}")
            places = [("body", entry) for entry in operation.get("requestBody", {}).get("content", {}).values()]
            places += [
                (f"response {code}", entry)
                for code, response in operation.get("responses", {}).items()
                for entry in response.get("content", {}).values()
            ]
            for label, entry in places:
                for where, field in _fields(entry.get("schema", {}), f"{op} {label}", document, frozenset()):
                    described = field.get("description") or _resolve(field, document).get("description")
                    if not described and not where.startswith(skip):
                        missing.append(where)
    return sorted(set(missing))
