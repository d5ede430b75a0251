"""The OpenAPI document, made to match what the server really answers.

FastAPI's generated document describes an error body the server never sends (``{"detail": [...]}``), names
operations ``compute_kernel_v1_models__name__ntk_post`` and omits the status codes raised inside routes. One pass
here, run over every route when the document is first built (routes added by any module later are covered too),
fixes that centrally:

- operation ids are the route functions' names (``compute_kernel``), unique across the app;
- every route gets the ``ErrorBody`` schema (``{"error": {"type", "message"}}``) for each status it can answer,
  inferred from what it declares: an access dependency (401, and 403 for ``write``), path parameters (404, 422),
  query parameters or a body (422), a body (400, 413, 415), several response media types (406), a compute slot
  (429), ``/v1`` state (503), and any error status a route lists itself in ``responses`` (e.g. ``{409: {...}}``);
- binary responses (``.npy``, safetensors) are ``string/binary``.

    >>> app = FastAPI(generate_unique_id_function=operation_id)  # doctest: +SKIP
    >>> install_openapi(app)  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import fastapi.routing
from fastapi import FastAPI
from fastapi.dependencies.models import Dependant
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field

from ntk_service.server.deps import AUTH_DEPENDENCIES, COMPUTE_DEPENDENCIES

__all__ = [
    "ERROR_DESCRIPTIONS",
    "ERROR_EXAMPLES",
    "ErrorBody",
    "ErrorDetail",
    "api_routes",
    "install_openapi",
    "operation_id",
    "statuses_of",
]

ERROR_DESCRIPTIONS: dict[int, str] = {
    400: "Malformed request: the body cannot be parsed (invalid JSON, a corrupt .npy or safetensors body).",
    401: "No API key, or a key that is not valid: send `Authorization: Bearer <key>`.",
    403: "The key's scope is too small (a `read` key on a route that changes state).",
    404: "The model, version, data set or job does not exist.",
    406: "No acceptable response type for `Accept`, or a JSON response over the server's JSON limit.",
    409: "Conflicts with the current state (a name taken, a job not finished).",
    413: "The body is over the server's limit, or the work would exceed its memory or disk budget "
    "(`estimate_bytes`, `budget_bytes` say by how much).",
    415: "The `Content-Type` is not one this route reads.",
    422: "A field, parameter or tensor is invalid (the message names it and says what is expected).",
    429: "At capacity: retry after the `Retry-After` seconds.",
    500: "An unexpected server error (a bug: the server log has the traceback).",
    501: "A feature needs an optional dependency the server lacks (the message names the extra to install).",
    503: "The server is starting or stopping: retry after `Retry-After` seconds.",
}
"""What each error status means, as OpenAPI response descriptions."""

ERROR_EXAMPLES: dict[int, tuple[str, str]] = {
    400: ("malformed_request", "ntk of model 'mnist-mlp': the body is not valid JSON (Expecting value)"),
    401: ("unauthenticated", "GET /v1/models: no API key; send Authorization: Bearer <key>"),
    403: ("permission_denied", "POST /v1/models: this key has scope 'read'; the route needs a 'write' key"),
    404: ("model_not_found", "get model: model 'mnist-mlp' not found; list models with GET /v1/models"),
    406: ("not_acceptable", "ntk of model 'mnist-mlp': the response would be 80.0 MiB, over the JSON limit"),
    409: ("name_conflict", "register model: a model named 'mnist-mlp' exists; pick another name"),
    413: ("memory_estimate_exceeded", "compute_ntk: needs about 12.0 GiB, over the memory budget of 4.0 GiB"),
    415: ("unsupported_media_type", "ntk of model 'mnist-mlp': Content-Type text/plain is not application/json"),
    422: ("invalid_input", "ntk of model 'mnist-mlp': mode: Input should be 'full', 'trace', ..."),
    429: ("busy", "ntk of model 'mnist-mlp': 2 computations running and 8 waiting; retry after 3 s"),
    500: ("internal_error", "POST /v1/models/mnist-mlp/ntk: internal error; the server log has details"),
    501: ("optional_dependency_missing", "jobs: the Ray executor needs ray; pip install 'ntk-service[ray]'"),
    503: ("service_unavailable", "readyz: the server is starting or stopping; retry shortly"),
}
"""One example error body per status (type, message), so ReDoc shows each status its own sample instead of the
schema's one example under every status."""

_RETRY_AFTER = {
    "Retry-After": {"description": "Seconds to wait before retrying.", "schema": {"type": "integer", "minimum": 1}}
}
_HEADERS: dict[int, dict[str, Any]] = {
    401: {"WWW-Authenticate": {"description": "`Bearer`.", "schema": {"type": "string"}}},
    429: _RETRY_AFTER,
    503: _RETRY_AFTER,
}

_JSON = "application/json"
_BINARY_SCHEMA = {"type": "string", "format": "binary"}
_ERROR_REF = {"$ref": "#/components/schemas/ErrorBody"}
_FASTAPI_VALIDATION_SCHEMAS = ("HTTPValidationError", "ValidationError")
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


class ErrorDetail(BaseModel):
    """What went wrong; 413 estimate refusals add ``estimate_bytes`` and ``budget_bytes``."""

    model_config = ConfigDict(extra="allow")

    type: str = Field(
        description="Machine-readable error type; the client maps it to an `ntk_service.errors` class.",
        examples=["model_not_found"],
    )
    message: str = Field(
        description="What was expected, what came, and how to fix it; starts with the operation.",
        examples=["get model: model 'mnist-mlp' not found; list models with GET /v1/models"],
    )


class ErrorBody(BaseModel):
    """Every error response: ``{"error": {"type", "message"}}``."""

    error: ErrorDetail


def operation_id(route: APIRoute) -> str:
    """A route's operation id: its function's name (``compute_kernel``), as a client generator would name it."""
    return route.name


def api_routes(app: FastAPI) -> list[Any]:
    """Every API route of ``app`` in the schema, as seen with its router's prefix (an ``APIRoute``-like view).

    Recent FastAPI wraps included routers lazily (``app.routes`` holds the routers, not their routes);
    ``iter_route_contexts`` is how its own schema generator reaches the routes, and the fallback covers older ones.
    """
    contexts = getattr(fastapi.routing, "iter_route_contexts", None)
    candidates: list[tuple[Any, Any]]
    if contexts is None:
        candidates = [(route, route) for route in app.routes]
    else:
        candidates = [(context.original_route, context) for context in contexts(app.routes)]
    return [view for original, view in candidates if isinstance(original, APIRoute) and view.include_in_schema]


def _calls(dependant: Dependant) -> Iterator[Any]:
    for sub in dependant.dependencies:
        yield sub.call
        yield from _calls(sub)


def _params(dependant: Dependant, kind: str) -> bool:
    return bool(getattr(dependant, kind)) or any(_params(sub, kind) for sub in dependant.dependencies)


def statuses_of(route: Any, operation: dict[str, Any]) -> set[int]:
    """The error statuses ``route`` can answer, from what it declares (see the module docstring)."""
    calls = set(_calls(route.dependant))
    scopes = {AUTH_DEPENDENCIES[c] for c in calls if c in AUTH_DEPENDENCIES}
    has_body = "requestBody" in operation or route.body_field is not None
    statuses = {500}
    if scopes:
        statuses.add(401)
    if "write" in scopes:
        statuses.add(403)
    if _params(route.dependant, "path_params"):
        statuses |= {404, 422}
    if _params(route.dependant, "query_params") or has_body:
        statuses.add(422)
    if has_body or route.methods & _BODY_METHODS:
        statuses |= {400, 413, 415}
    success = operation.get("responses", {}).get(str(route.status_code or 200), {})
    if len(success.get("content", {})) > 1:
        statuses.add(406)
    if calls & COMPUTE_DEPENDENCIES:
        statuses |= {413, 429}  # a compute also refuses work over the memory budget
    if route.path.startswith("/v1/"):
        statuses.add(503)
    statuses |= {int(code) for code in operation.get("responses", {}) if str(code).isdigit() and int(code) >= 400}
    return statuses


def _fix_success_content(operation: dict[str, Any]) -> None:
    """Binary media types (declared with an empty schema) as ``string/binary``."""
    for code, response in operation.get("responses", {}).items():
        content = response.get("content")
        if not content or not str(code).startswith("2"):
            continue
        for media, entry in content.items():
            if media != _JSON and not media.startswith("text/") and not entry.get("schema"):
                entry["schema"] = dict(_BINARY_SCHEMA)


def _fix_operation(route: Any, operation: dict[str, Any]) -> None:
    _fix_success_content(operation)
    responses = operation.setdefault("responses", {})
    for status in sorted(statuses_of(route, operation)):
        declared = responses.get(str(status), {})
        entry: dict[str, Any] = {
            "description": declared.get("description") or ERROR_DESCRIPTIONS.get(status, "Error."),
            "content": {_JSON: {"schema": _ERROR_REF}},
        }
        if status in ERROR_EXAMPLES:
            error_type, message = ERROR_EXAMPLES[status]
            entry["content"][_JSON]["example"] = {"error": {"type": error_type, "message": message}}
        if status in _HEADERS:
            entry["headers"] = _HEADERS[status]
        responses[str(status)] = entry
    operation["responses"] = dict(sorted(responses.items()))


def build_openapi(app: FastAPI) -> dict[str, Any]:
    """The app's OpenAPI document with the pass above applied to every route."""
    schema = get_openapi(
        title=app.title,
        version=app.version,
        description=app.description,
        routes=app.routes,
        tags=app.openapi_tags,
    )
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for name in _FASTAPI_VALIDATION_SCHEMAS:
        components.pop(name, None)
    error_schema = ErrorBody.model_json_schema(ref_template="#/components/schemas/{model}")
    components.update(error_schema.pop("$defs", {}))
    components["ErrorBody"] = error_schema
    for route in api_routes(app):
        for method in route.methods:
            operation = schema["paths"].get(route.path_format, {}).get(method.lower())
            if operation is not None:
                _fix_operation(route, operation)
    return schema


def install_openapi(app: FastAPI) -> None:
    """Serve ``build_openapi(app)`` at ``/openapi.json`` (built once, on first request).

    Raises:
        ValueError: two routes share an operation id (name one of the route functions differently).
    """

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            seen: dict[str, str] = {}
            for route in api_routes(app):
                where = f"{sorted(route.methods)} {route.path}"
                if route.name in seen:
                    raise ValueError(
                        f"openapi: operation id {route.name!r} names both {seen[route.name]} and {where}; "
                        "rename one route function"
                    )
                seen[route.name] = where
            app.openapi_schema = build_openapi(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
